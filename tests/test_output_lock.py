"""One run per output: the lock file, stale locks, every command that takes one, staged and atomic outputs."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from amphista_jax.assets import default_model_dir, shipped_heads_dir
from amphista_jax.cli import main
from amphista_jax.infra.errors import BAD_INPUT_EXIT
from amphista_jax.infra.output_lock import (
    LOCK_FILE,
    OutputLockedError,
    atomic_file,
    file_lock,
    lock_beside,
    output_lock,
    staged_output,
    write_atomic,
)
from tests.helpers import ROOT


def _hold(path, pid: int, host: str | None = None, command: str = "train") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "command": command}))


@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.fixture
def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_lock_is_exclusive_released_and_stale_locks_are_taken_over(tmp_path, live_pid, dead_pid, capsys):
    with output_lock(tmp_path / "out", "eval") as path:
        assert path == tmp_path / "out" / LOCK_FILE
        held = json.loads(path.read_text())
        assert held["command"] == "eval" and held["host"] == socket.gethostname()
        with pytest.raises(OutputLockedError, match=r"being written by eval \(pid \d+ on .*\): wait"):
            with output_lock(tmp_path / "out", "train"):
                pass
    assert not path.exists()
    with pytest.raises(RuntimeError, match="boom"), output_lock(tmp_path / "out", "eval"):
        raise RuntimeError("boom")
    assert not path.exists()  # released however the block ends
    _hold(path, live_pid)
    with pytest.raises(OutputLockedError, match=f"pid {live_pid}"):
        with output_lock(tmp_path / "out", "eval"):
            pass
    _hold(path, dead_pid)  # a killed run's lock
    with output_lock(tmp_path / "out", "eval"):
        assert json.loads(path.read_text())["command"] == "eval"
    err = capsys.readouterr().err
    assert f"pid {dead_pid}" in err and "is stale" in err
    _hold(path, 1, host="another-host")
    with pytest.raises(OutputLockedError, match=f"if that run is over, delete {path}"):
        with file_lock(path, "eval"):
            pass
    assert lock_beside(tmp_path / "a.jsonl") == tmp_path / "a.jsonl.lock"


MODEL = str(default_model_dir())
# Every command that writes: (its arguments, where its lock sits), under a temporary directory `t`.
DOORS = {
    "train": (lambda t: ["train", "--config", "configs/medusa/code.yaml", "--set", f"out_dir={t / 'out'}", "--set",
                         "loop.steps=1"], lambda t: t / "out" / LOCK_FILE),
    "eval": (lambda t: ["eval", "--config", "configs/eval/humaneval-code.yaml", "--methods", "ar", "--set",
                        f"out_dir={t / 'out'}", "--set", "dataset.limit=1", "--set", "max_new_tokens=2"],
             lambda t: t / "out" / LOCK_FILE),
    "distill": (lambda t: ["distill", "--model", MODEL, "--prompts", str(t / "prompts.jsonl"), "--out",
                           str(t / "out.jsonl"), "--max-new-tokens", "2", "--prompt-len", "16"],
                lambda t: lock_beside(t / "out.jsonl")),
    "tree-search": (lambda t: ["tree-search", "--heads", str(shipped_heads_dir("medusa")), "--out",
                               str(t / "tree.json"), "--tasks", "100:101", "--max-nodes", "2"],
                    lambda t: lock_beside(t / "tree.json")),
    "calibrate": (lambda t: ["calibrate", "--model", "tiny", "--heads", "medusa", "--acceptance", "--out",
                             str(t / "acceptance.json"), "--prompts", "1"],
                  lambda t: lock_beside(t / "acceptance.json")),
    "fetch": (lambda t: ["fetch", "mt-bench"], lambda t: t / "home" / ".fetch-mt-bench.lock"),
    "pretrain-target": (lambda t: ["pretrain-target", "--config", "configs/target/tiny-code.yaml", "steps=1",
                                   f"run_dir={t / 'out'}", f"export_dir={t / 'out' / 'export'}"],
                        lambda t: t / "out" / LOCK_FILE),
    "plan": (lambda t: ["plan", "--config", "configs/medusa/vicuna-7b.yaml", "--out", str(t / "out")],
             lambda t: t / "out" / LOCK_FILE),
}


@pytest.mark.parametrize("command", DOORS)
def test_every_command_refuses_an_output_another_run_is_writing(command, tmp_path, live_pid, capsys, monkeypatch):
    """The second run into an output another (live) run holds stops in one line naming the owner, before any
    work, and writes nothing."""
    argv, lock = DOORS[command]
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("AMPHISTA_HOME", str(tmp_path / "home"))
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"id": "a", "prompt": "def add(a, b):"}) + "\n")
    _hold(lock(tmp_path), live_pid, command=command)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code = main(argv(tmp_path))
    err = capsys.readouterr().err
    assert code == BAD_INPUT_EXIT and f"being written by {command} (pid {live_pid}" in err, err[-2000:]
    assert "Traceback" not in err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing else written


def test_atomic_writes_leave_the_old_file_or_the_new_one(tmp_path):
    path = tmp_path / "summary.json"
    write_atomic(path, "old\n")
    with pytest.raises(RuntimeError), atomic_file(path) as tmp:  # a writer dying half-way
        assert tmp.parent == path.parent and tmp.suffix == ".json" and tmp != path
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    assert write_atomic(path, "new\n").read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_a_replaced_output_stays_whole_until_the_new_one_is_complete(tmp_path, dead_pid, capsys):
    """`staged_output(replace=True)` (pretrain-target's export): a failing writer leaves the old output as it was;
    a finished one swaps in whole, carrying over what it does not write; a swap killed between its renames is put
    back by the next run."""
    out = tmp_path / "export"
    with staged_output(out, "pretrain-target") as staging:
        (staging / "model.safetensors").write_text("old")
    with pytest.raises(RuntimeError), staged_output(out, "pretrain-target", replace=True) as staging:
        (staging / "model.safetensors").write_text("half")
        raise RuntimeError("killed")
    assert (out / "model.safetensors").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == [
        "export"]
    (out / "notes.md").write_text("mine")
    with staged_output(out, "pretrain-target", replace=True) as staging:
        (staging / "model.safetensors").write_text("new")
        assert (out / "model.safetensors").read_text() == "old"  # readable while the new one is written
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "notes.md"]  # the user's file carried
    assert (out / "model.safetensors").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == [
        "export"]
    out.rename(tmp_path / f".export.replaced-{dead_pid}")  # killed after moving the old output aside
    _hold(tmp_path / f".export.partial-{dead_pid}" / LOCK_FILE, dead_pid, command="pretrain-target")
    with staged_output(out, "pretrain-target", replace=True) as staging:
        assert (out / "model.safetensors").read_text() == "new"
        (staging / "model.safetensors").write_text("newer")
    err = capsys.readouterr().err
    assert "partial output of a killed run" in err and "restoring the earlier output" in err
    assert (out / "model.safetensors").read_text() == "newer" and sorted(p.name for p in tmp_path.iterdir()) == [
        "export"]


def test_two_real_train_runs_into_one_out_dir(tmp_path):
    """A real race: while one `amphista-jax train` process holds out_dir (paused there, so the overlap does not
    depend on the machine's speed), a second process started into it stops in one line naming the first, and the
    first then finishes intact (every step logged once, its heads and summary, no lock left)."""
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "amphista_jax.cli", "train", "--config", "configs/medusa/code.yaml", "--set",
            "data.kind=text", "--set", f"data.train={ROOT / 'pallas_kernels'}", "--set", "data.max_len=32", "--set",
            "data.batch_size=2", "--set", "drafter.num_heads=2", "--set", "loop.steps=30", "--set",
            "loop.log_every=1", "--set", f"out_dir={out}"]
    first = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while not (out / LOCK_FILE).is_file() and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)
        try:
            second = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
        finally:
            first.send_signal(signal.SIGCONT)
        log = first.communicate(timeout=600)[0]
    finally:
        first.kill()
    assert first.returncode == 0, log[-2000:]
    assert second.returncode == BAD_INPUT_EXIT and "Traceback" not in second.stderr, second.stderr[-2000:]
    assert f"being written by train (pid {first.pid}" in second.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 31))  # each step once, by one run
    assert json.loads((out / "summary.json").read_text())["steps"] == 30 and (out / "heads" / "draft.json").is_file()
    assert not (out / LOCK_FILE).exists()
