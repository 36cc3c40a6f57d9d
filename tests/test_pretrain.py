"""The embedded-target recipe end to end on a tiny budget: export, transformers loading, resume, SIGTERM."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import tomllib
from pathlib import Path, PurePath

import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax.models.hf import load_params
from amphista_jax.models.llama import Transformer
from amphista_jax.train.corpus import build_corpus, is_heldout, is_test_or_vendored, package_files, stdlib_files
from amphista_jax.train.pretrain_target import run
from tests.conftest import SMOKE_OVERRIDES, smoke_pretrain_config


def test_corpus_is_the_stdlib_with_a_stable_five_percent_split():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    assert files == sorted(files) and not any("site-packages" in f.parts for f in files)
    held = [f for f in files if is_heldout(f.relative_to(root).as_posix(), 0.05)]
    assert 0.03 < len(held) / len(files) < 0.07
    assert is_heldout("json/decoder.py", 0.05) == is_heldout("json/decoder.py", 0.05)


@pytest.mark.parametrize("path, excluded", [
    ("test/test_json.py", True), ("idlelib/idle_test/test_x.py", True), ("numpy/linalg/tests/test_linalg.py", True),
    ("pip/_vendor/rich/console.py", True), ("jax/_src/test_util.py", True), ("conftest.py", True),
    ("optax/_src/alias_test.py", True), ("json/decoder.py", False), ("unittest/case.py", False),
    ("numpy/testing/_private/utils.py", False), ("jax/_src/testing_utils_like.py", False)])
def test_test_suites_and_vendored_code_are_recognised(path, excluded):
    assert is_test_or_vendored(PurePath(path)) is excluded


def test_code_corpus_drops_tests_and_duplicates_and_records_versions():
    corpus = build_corpus(stdlib=False, packages=("tqdm", "optax"), exclude_tests=True, heldout_fraction=0.2)
    texts = corpus.train + corpus.heldout
    assert len(set(texts)) == len(texts) > 20  # identical files (e.g. empty __init__.py) kept once
    sources = corpus.manifest["sources"]
    assert sources["optax"]["version"] == importlib.metadata.version("optax")
    assert sum(s["files"] for s in sources.values()) == len(texts)
    kept = {f.key for f in package_files("optax", exclude_tests=True)}
    every = {f.key for f in package_files("optax")}
    assert "optax/_src/alias_test.py" in every and "optax/_src/alias_test.py" not in kept
    assert "optax/_src/alias.py" in kept
    assert len(stdlib_files(exclude_tests=True)) < len(stdlib_files()) / 1.5  # Lib/test dominated the old corpus


LATER_DEPENDENCIES = {"gguf", "jinja2"}  # runtime dependencies added after the embedded target was trained


def test_the_default_recipe_reads_the_runtime_dependencies():
    """configs/target/code.yaml's corpus is the project's direct runtime dependencies (pyproject.toml) as they were
    when the embedded target was trained (gguf and jinja2, added later for `convert --gguf` and chat templates, are
    not in its recipe), and its bits-per-byte package is in none of them."""
    from amphista_jax.infra.config_io import load_config
    from amphista_jax.train.pretrain_target import PretrainConfig

    root = Path(__file__).parents[1]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip().lower() for d in deps}
    cfg = load_config(PretrainConfig, root / "configs" / "target" / "code.yaml", [])
    assert set(cfg.packages) == names - LATER_DEPENDENCIES and cfg.exclude_tests and cfg.bpb_package not in names


def test_export_is_a_hf_checkpoint_that_transformers_loads(smoke_model):
    torch = pytest.importorskip("torch")
    from transformers import AutoTokenizer, LlamaForCausalLM

    run_dir, summary = smoke_model
    export = run_dir / "export"
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "training_summary.json"):
        assert (export / name).is_file(), name
    assert summary["steps"] == 3 and summary["tokens_seen"] == 3 * 4 * 32
    assert np.isfinite(summary["heldout_loss_nats_per_token"])
    tok = AutoTokenizer.from_pretrained(export)
    ids = tok("def add(a, b):\n    return a + b\n")["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True).startswith("def add")

    params, config = load_params(export, dtype="float32")
    hf = LlamaForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    tokens = np.asarray([ids])
    ours = Transformer(config).apply({"params": params}, jnp.asarray(tokens), jnp.arange(len(ids))[None]).logits
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4)


def test_rerun_resumes_from_the_last_checkpoint(smoke_model, tmp_path, capsys):
    shared_run, first = smoke_model
    run_dir = tmp_path / "run"  # a copy: other tests use the shared run's export
    shutil.copytree(shared_run, run_dir)
    resumed = run(smoke_pretrain_config(run_dir, steps=5))
    assert "resumed from step 3" in capsys.readouterr().out
    assert resumed["steps"] == 5 and resumed["tokens_seen"] == 5 * 4 * 32
    assert resumed["config"]["steps"] == 5 and first["config"]["steps"] == 3


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits(tmp_path):
    """Under -m slow: test_train_heads.py's test_exact_resume_after_sigterm sends SIGTERM into the same `run_loop`
    (a checkpoint, exit status 143, then an exact resume), and test_rerun_resumes_from_the_last_checkpoint resumes
    this recipe's run."""
    overrides = SMOKE_OVERRIDES + [f"run_dir={tmp_path}", f"export_dir={tmp_path}/export", "steps=100000",
                                   "checkpoint_every=100000"]
    proc = subprocess.Popen([sys.executable, "-m", "amphista_jax.cli", "pretrain-target", "--config",
                             "configs/target/tiny-code.yaml", *overrides], cwd=Path(__file__).parents[1],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    out = ""
    deadline = time.time() + 240
    while "loss=" not in out and time.time() < deadline:  # wait until training steps are running
        out += proc.stdout.read(1)
    proc.send_signal(signal.SIGTERM)
    out += proc.communicate(timeout=120)[0]
    assert proc.returncode == 143, out[-2000:]
    assert "checkpoint saved, rerun the same command to resume" in out
    saved = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
    assert saved and max(saved) > 0
    extra = json.loads(next((tmp_path / "checkpoints" / str(max(saved))).rglob("extra/*")).read_text())
    assert extra["tokens_seen"] == max(saved) * 4 * 32
