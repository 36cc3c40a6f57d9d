"""One run per output: the lock file, stale locks, and the commands that take it (train, eval, distill)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from amphista_jax.cli import main
from amphista_jax.errors import BAD_INPUT_EXIT
from amphista_jax.output_lock import (
    LOCK_FILE,
    OutputLockedError,
    atomic_file,
    file_lock,
    lock_beside,
    output_lock,
    staged_output,
    write_atomic,
)


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


def test_train_and_eval_refuse_an_output_another_run_is_writing(tmp_path, live_pid, capsys):
    out = tmp_path / "run"
    _hold(out / LOCK_FILE, live_pid)
    code = main(["train", "--config", "configs/medusa/code.yaml", "--set", f"out_dir={out}", "--set", "loop.steps=1"])
    err = capsys.readouterr().err
    assert code == BAD_INPUT_EXIT and "being written by train" in err and "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # nothing else written
    evals = tmp_path / "eval"
    _hold(evals / LOCK_FILE, live_pid, command="eval")
    code = main(["eval", "--config", "configs/eval/humaneval-code.yaml", "--methods", "ar", "--set",
                 f"out_dir={evals}", "--set", "dataset.limit=1", "--set", "max_new_tokens=2"])
    assert code == BAD_INPUT_EXIT and "being written by eval" in capsys.readouterr().err
    assert sorted(p.name for p in evals.iterdir()) == [LOCK_FILE]


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
    a finished one swaps in whole; a swap killed between its renames is put back by the next run."""
    out = tmp_path / "export"
    with staged_output(out, "pretrain-target") as staging:
        (staging / "model.safetensors").write_text("old")
    with pytest.raises(RuntimeError), staged_output(out, "pretrain-target", replace=True) as staging:
        (staging / "model.safetensors").write_text("half")
        raise RuntimeError("killed")
    assert (out / "model.safetensors").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == [
        "export"]
    with staged_output(out, "pretrain-target", replace=True) as staging:
        (staging / "model.safetensors").write_text("new")
        assert (out / "model.safetensors").read_text() == "old"  # readable while the new one is written
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
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
