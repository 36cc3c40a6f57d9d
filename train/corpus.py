"""The offline code corpus and its byte-level BPE tokenizer.

Sources are the interpreter's standard library and the installed Python sources of named distributions (the
project's own runtime dependencies: real, diverse code that every install already has on disk). Test suites and
vendored copies of other packages can be left out; identical files are kept once; a file is held out by a stable
hash of its path relative to its root (`json/decoder.py`, `numpy/linalg/_linalg.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import sysconfig
from collections.abc import Sequence
from pathlib import Path, PurePath
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from amphista_jax.infra.errors import UserError

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
# A minimal template so `--chat` works; the embedded model is a code model, not an instruction model.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}# {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
VENDORED_DIRS = frozenset({"_vendor", "vendor", "_vendored"})


class CorpusError(UserError, ValueError):
    """A corpus source that is not installed, or a split that leaves nothing to train or evaluate on."""


@dataclasses.dataclass(frozen=True)
class SourceFile:
    source: str  # "stdlib" or a distribution name
    key: str  # path relative to the source's root: the split and report key
    path: Path


def is_test_or_vendored(rel: PurePath) -> bool:
    """Test suites (`test/`, `tests/`, `test_*.py`, `*_test.py`, `conftest.py`) and vendored packages."""
    dirs = set(rel.parts[:-1])
    return (bool((TEST_DIRS | VENDORED_DIRS) & dirs) or rel.name.startswith("test_") or rel.name.endswith("_test.py")
            or rel.name == "conftest.py")


def stdlib_files(root: str | Path | None = None, exclude_tests: bool = False) -> list[Path]:
    """The `.py` files of the standard library, sorted, without installed packages (nor test suites)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)
                  and not (exclude_tests and is_test_or_vendored(p.relative_to(root))))


def package_files(dist_name: str, exclude_tests: bool = False) -> list[SourceFile]:
    """The installed `.py` files of distribution `dist_name` (e.g. `numpy`, `orbax-checkpoint`), sorted."""
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise CorpusError(f"corpus package {dist_name!r} is not installed: `pip install {dist_name}` or remove it "
                          "from `packages`") from None
    rels = sorted(PurePath(str(f)) for f in dist.files or () if str(f).endswith(".py"))
    files = [SourceFile(dist_name, r.as_posix(), Path(str(dist.locate_file(r)))) for r in rels
             if not (exclude_tests and is_test_or_vendored(r)) and ".." not in r.parts]
    return [f for f in files if f.path.is_file()]


def package_version(dist_name: str) -> str:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise CorpusError(f"package {dist_name!r} is not installed: `pip install {dist_name}` or name another "
                          "package") from None


def is_heldout(rel_path: str, fraction: float) -> bool:
    """Stable split: a file is held out when the hash of its relative path falls under `fraction`."""
    return _unit_hash(rel_path) < fraction


def _unit_hash(key: str) -> float:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


@dataclasses.dataclass
class Corpus:
    train: list[str]
    heldout: list[str]
    manifest: dict[str, Any]  # per source: version, files, bytes; duplicates dropped; for the training summary


def _first_bytes(items: Sequence[tuple[str, str]], max_bytes: float) -> list[tuple[str, str]]:
    """The leading `(key, text)` items whose texts add up to `max_bytes` (the one crossing it included)."""
    kept, total = [], 0
    for key, text in items:
        if total >= max_bytes:
            break
        kept.append((key, text))
        total += len(text.encode())
    return kept


def build_corpus(stdlib: bool, packages: Sequence[str], exclude_tests: bool, heldout_fraction: float,
                 max_source_mb: float = 0.0, max_files: int = 0) -> Corpus:
    """Read every source, drop unreadable (non-UTF-8) files and identical copies (the first copy in reading order
    wins: stdlib, then packages in the given order, files sorted), cap each source at `max_source_mb` (files
    taken in path-hash order, so the cap is a stable random subset), then split by path hash. `max_files > 0`
    keeps the first N files overall (smoke tests)."""
    sources: list[list[SourceFile]] = []
    if stdlib:
        root = Path(sysconfig.get_paths()["stdlib"])
        sources.append([SourceFile("stdlib", p.relative_to(root).as_posix(), p)
                        for p in stdlib_files(root, exclude_tests)])
    for name in packages:
        if not (files := package_files(name, exclude_tests)):
            raise CorpusError(f"corpus package {name!r} has no readable .py files installed (an editable or conda "
                              "install lists none): reinstall it with pip or remove it from `packages`")
        sources.append(files)
    seen: set[str] = set()
    duplicates = 0
    train, heldout, manifest = [], [], {}
    budget = max_files or None
    for files in sources:
        texts = {}
        for f in files:
            if (text := _read(f.path)) is None:
                continue
            digest = hashlib.sha256(text.encode()).hexdigest()
            duplicates += digest in seen
            if digest not in seen:
                seen.add(digest)
                texts[f.key] = text
        if max_source_mb > 0:
            texts = dict(_first_bytes(sorted(texts.items(), key=lambda kv: _unit_hash(kv[0])), max_source_mb * 2**20))
        keys = sorted(texts, key=PurePath)[:budget]
        if budget is not None:
            budget -= len(keys)
        held = [k for k in keys if is_heldout(k, heldout_fraction)]
        train += [texts[k] for k in keys if not is_heldout(k, heldout_fraction)]
        heldout += [texts[k] for k in held]
        name = files[0].source
        manifest[name] = {
            "version": package_version(name) if name != "stdlib" else sysconfig.get_python_version(),
            "files": len(keys), "heldout_files": len(held), "bytes": sum(len(texts[k].encode()) for k in keys)}
        if budget == 0:
            break
    return Corpus(train, heldout, {"sources": manifest, "duplicate_files_dropped": duplicates,
                                   "exclude_tests": exclude_tests, "max_source_mb": max_source_mb})


def package_texts(dist_name: str, max_bytes: int) -> list[str]:
    """Readable non-empty non-test `.py` files of one distribution in path-hash order, up to `max_bytes` in
    total: the held-out package for bits-per-byte (it must be in no training source)."""
    files = sorted(package_files(dist_name, exclude_tests=True), key=lambda f: _unit_hash(f.key))
    items = [(f.key, text) for f in files if (text := _read(f.path)) is not None and text.strip()]
    return [text for _, text in _first_bytes(items, max_bytes)]


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with `<pad>`=0, `<s>`=1, `</s>`=2; encoding prepends BOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS], min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=4096, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast
