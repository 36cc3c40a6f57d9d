"""Compiled programs kept across runs (`infra.compile_cache`): one folder per machine, jaxlib and XLA flags; off by
a setting; an unwritable home or a damaged entry is one `note:` line (and a recompile), never an error."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax

from amphista_jax.infra.compile_cache import SETTING, cache_key, enable_compile_cache
from amphista_jax.infra.machine import this_machine


def test_the_key_changes_with_the_machine_jax_jaxlib_backend_and_flags():
    machine, env = this_machine(), {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}
    key = cache_key(machine, "0.10.2", env)
    assert key == cache_key(machine, "0.10.2", dict(env, HOME="/elsewhere"))  # what does not change a program
    others = [cache_key(dataclasses.replace(machine, jax="0.11.0"), "0.10.2", env),
              cache_key(machine, "0.10.3", env),
              cache_key(dataclasses.replace(machine, backend="gpu", device="NVIDIA H200"), "0.10.2", env),
              cache_key(dataclasses.replace(machine, isa=machine.isa[:-1]), "0.10.2", env),
              cache_key(machine, "0.10.2", {}),
              cache_key(machine, "0.10.2", env | {"LIBTPU_INIT_ARGS": "--xla_tpu_enable_latency_hiding_scheduler"}),
              cache_key(dataclasses.replace(machine, library="0.2.0"), "0.10.2", env)]
    assert key not in others and len(set(others)) == len(others)


def test_off_and_unwritable_homes_keep_nothing_and_say_so_in_one_line(tmp_path, monkeypatch, capsys):
    assert os.environ[SETTING] == "0" and enable_compile_cache(tmp_path) is None  # the tests' own setting: off
    assert not (tmp_path / "compiled").exists()
    monkeypatch.setenv(SETTING, "1")
    assert enable_compile_cache(tmp_path) == Path(jax.config.jax_compilation_cache_dir)  # the process's own: kept
    assert not (tmp_path / "compiled").exists()
    (tmp_path / "file").write_text("a file, not a folder")
    own = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert enable_compile_cache(tmp_path / "file") is None
    finally:
        jax.config.update("jax_compilation_cache_dir", own)
    err = capsys.readouterr().err
    assert err.startswith("note: compiled programs are not kept") and len(err.strip().splitlines()) == 1
    assert (tmp_path / "file").read_text() == "a file, not a folder"


RUN = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    import jax, jax.numpy as jnp
    from amphista_jax.infra.compile_cache import enable_compile_cache
    import amphista_jax.infra.compile_cache as cc
    cc.MIN_COMPILE_SECONDS = 0.0
    folder = enable_compile_cache(Path(sys.argv[1]))
    f = jax.jit(lambda x: jnp.tanh(x) @ x.T + jnp.arange(64.0))
    print(folder, float(f(jnp.ones((64, 64))).sum()))
""")


def _run(home, env):
    out = subprocess.run([sys.executable, "-c", RUN, str(home)], capture_output=True, text=True, env=env, check=True)
    return out.stdout.split(), out.stderr


def test_a_second_process_reads_the_program_and_a_damaged_entry_is_one_note_and_a_recompile(tmp_path):
    env = dict(os.environ, **{SETTING: "1", "JAX_PLATFORMS": "cpu"})
    (folder, value), err = _run(tmp_path, env)
    entries = sorted(p for p in (tmp_path / "compiled").rglob("*") if p.is_file())
    assert folder.startswith(str(tmp_path / "compiled")) and entries and "note:" not in err
    assert _run(tmp_path, env)[0] == [folder, value]  # read back: the same folder, the same result
    for p in entries:
        p.write_bytes(b"damaged")
    for _ in range(2):  # JAX leaves a damaged entry as it is: each process says it once and compiles again
        (_, again), err = _run(tmp_path, env)
        notes = [line for line in err.splitlines() if "note:" in line]
        assert again == value and len(notes) == 1 and "compiled again" in notes[0], err
        assert "Traceback" not in err and "UserWarning" not in err
