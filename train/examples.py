"""Training examples: tokenised, split into train and held-out, batched, with the target's hidden states
attached where cached, and the data's identity for resumes."""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from amphista_jax.drafters.draft_vocab import DraftVocab, most_frequent, token_counts
from amphista_jax.infra import config_io
from amphista_jax.infra.identity import files_digest, json_digest, matching_files
from amphista_jax.infra.output_lock import LOCK_FILE, file_lock, write_atomic
from amphista_jax.models.fetch import resolve_data
from amphista_jax.models.llama import Transformer
from amphista_jax.train.config import DataConfig, TrainConfig, TrainConfigError, check_store_layers
from amphista_jax.train.corpus import build_corpus, package_version
from amphista_jax.train.data import (
    DataError,
    bucket_cut,
    conversation_examples,
    packed_examples,
    text_examples,
    trained_lengths,
)
from amphista_jax.train.pretrain_target import PretrainConfig
from amphista_jax.train.step import target_forward


def choose_draft_vocab(cfg: TrainConfig, examples: list[dict], vocab_size: int) -> DraftVocab | None:
    """The `cfg.draft_vocab_size` most frequent label tokens (`tokens` where `loss_mask` is 1) of the training
    `examples`, ties by id; None without a `draft_vocab_size`."""
    if not cfg.draft_vocab_size:
        return None
    tokens = np.concatenate([np.ravel(e["tokens"]) for e in examples])
    mask = np.concatenate([np.ravel(e["loss_mask"]) for e in examples])
    return most_frequent(token_counts(tokens, mask, vocab_size), cfg.draft_vocab_size)


def answer_vocabulary(path: str | Path, tok: Any, n: int, conversations: int, max_len: int = 2048
                      ) -> tuple[DraftVocab, float]:
    """A draft model's draft vocabulary: the `n` most frequent tokens of the answers (assistant turns through the
    chat template, `conversation_examples`) of the first `conversations` conversations of `path`, ties by id, with
    the share of those answer tokens it covers. Calibration prompts come from the file's end (held out)."""
    examples, _ = conversation_examples(path, tok, max_len, limit=conversations)
    if not examples:
        raise DataError(f"{path} holds no conversation with an answer to choose a draft vocabulary from")
    tokens = np.concatenate([e["tokens"] for e in examples])
    counts = token_counts(tokens, np.concatenate([e["loss_mask"] for e in examples]), len(tok))
    vocab = most_frequent(counts, min(n, len(counts)))
    return vocab, float(counts[list(vocab)].sum() / counts.sum())


DRAFT_VOCAB_CONVERSATIONS = 3000  # the ShareGPT conversations, from the file's start, `sharegpt_draft_vocab` counts


def sharegpt_draft_vocab(tok: Any, n: int) -> tuple[DraftVocab, str]:
    """(`answer_vocabulary` of ShareGPT's first `DRAFT_VOCAB_CONVERSATIONS` conversations, what it is in words)."""
    vocab, covered = answer_vocabulary(resolve_data("sharegpt"), tok, n, DRAFT_VOCAB_CONVERSATIONS)
    return vocab, (f"the {len(vocab)} most frequent answer tokens of the first {DRAFT_VOCAB_CONVERSATIONS} ShareGPT "
                   f"conversations through the target's chat template, {covered:.2%} of those answers' tokens")


@dataclasses.dataclass(frozen=True)
class ExampleSource(abc.ABC):
    """Where a run's examples come from (`data.kind`, chosen once by `example_source`): checked before slow
    work, identified for resumes, tokenised into (train, held-out) examples."""

    cfg: DataConfig

    @abc.abstractmethod
    def check(self) -> None:
        """Raise a one-line `TrainConfigError` when the data cannot be read."""

    @abc.abstractmethod
    def identity(self) -> dict[str, Any]:
        """What the data is (digests), for `train/run_identity`."""

    @abc.abstractmethod
    def split(self, tok: Any) -> tuple[list, list]:
        """(train, held-out) examples."""

    def heldout(self, tok: Any) -> list:
        """The held-out examples of `split`."""
        return self.split(tok)[1]


class TextFiles(ExampleSource):
    """Files (a directory or a glob) of plain text or code, packed; held out: `data.heldout` or a seeded
    `heldout_fraction` of the examples."""

    def _paths(self) -> list[tuple[str, str]]:
        return [(name, path) for name, path in (("data.train", self.cfg.train), ("data.heldout", self.cfg.heldout))
                if path]

    def check(self) -> None:
        for name, path in self._paths():
            if not matching_files(path):
                raise TrainConfigError(f"{name} {path} matches no file: point it at a file, a directory or a glob "
                                       "of text files")

    def identity(self) -> dict[str, Any]:
        return {name: files_digest(matching_files(path), Path(path) if Path(path).is_dir() else None)
                for name, path in self._paths()}

    def load(self, path: str, tok: Any) -> tuple[list, Any]:
        examples, report = text_examples(path, tok, self.cfg.max_len)
        return examples[: self.cfg.max_examples or None], report

    def split(self, tok: Any) -> tuple[list, list]:
        cfg = self.cfg
        train, report = self.load(cfg.train, tok)
        print(report.summary())
        if cfg.heldout:
            heldout, held_report = self.load(cfg.heldout, tok)
            print(held_report.summary())
            return train, heldout
        order = np.random.RandomState(cfg.seed).permutation(len(train))
        n_held = max(1, int(len(train) * cfg.heldout_fraction))
        if len(train) - n_held < cfg.batch_size:
            raise DataError(f"{cfg.train} has {len(train)} examples: too few for a held-out split and a batch of "
                            f"{cfg.batch_size}; add data or set data.heldout")
        return [train[i] for i in order[n_held:]], [train[i] for i in order[:n_held]]


class Conversations(TextFiles):
    """ShareGPT-style conversations (JSON / JSONL): chat template, loss on the assistant's turns only."""

    def check(self) -> None:
        for name, path in self._paths():
            if not Path(path).is_file():
                raise TrainConfigError(f"{name} {path} is not a file: point it at a conversations JSON / JSONL file")

    def load(self, path: str, tok: Any) -> tuple[list, Any]:
        examples, report = conversation_examples(path, tok, self.cfg.max_len, self.cfg.max_examples)
        if self.cfg.max_examples and len(examples) < self.cfg.max_examples:
            # a file that is still growing (a running distill) yields another split and store key once it grows
            print(f"note: {path} yields {len(examples)} examples, fewer than data.max_examples="
                  f"{self.cfg.max_examples}: the held-out split and the store depend on the count")
        return examples, report


class CodeCorpus(ExampleSource):
    """The offline code corpus of an embedded target's pre-training (`train/corpus.py`), split by path hash as
    there, so the target's held-out files stay unseen."""

    def recipe(self) -> PretrainConfig | None:
        """The target recipe whose corpus this is (None: the standard library alone)."""
        if not self.cfg.corpus:
            return None
        summary = Path(self.cfg.corpus) / "training_summary.json"
        if summary.is_file():
            return config_io.from_dict(PretrainConfig, json.loads(summary.read_text())["config"], f"{summary}: ")
        if not Path(self.cfg.corpus).is_file():
            raise TrainConfigError(f"data.corpus {self.cfg.corpus} is neither a target recipe YAML nor an exported "
                                   "target directory (with training_summary.json): fix the path, or set "
                                   "data.corpus='' for the standard library alone")
        return config_io.load_config(PretrainConfig, self.cfg.corpus, [])

    def check(self) -> None:
        for package in (t := self.recipe()) and t.packages or ():
            package_version(package)  # installed, or a one-line error naming it

    def identity(self) -> dict[str, Any]:
        """The recipe of a corpus read from installed sources, and those sources' versions."""
        t = self.recipe()
        recipe = ({k: getattr(t, k) for k in ("stdlib", "packages", "exclude_tests", "heldout_fraction",
                                              "max_source_mb")} if t else
                  {"stdlib": True, "packages": (), "exclude_tests": False,
                   "heldout_fraction": self.cfg.heldout_fraction})
        versions = {"python": platform.python_version()} | {p: package_version(p) for p in recipe["packages"]}
        return {"data.corpus": {"sha256": json_digest([recipe, versions]), "recipe": recipe, "versions": versions}}

    def _texts(self) -> tuple[list[str], list[str]]:
        if t := self.recipe():
            corpus = build_corpus(t.stdlib, t.packages, t.exclude_tests, t.heldout_fraction, t.max_source_mb)
        else:
            corpus = build_corpus(True, (), False, self.cfg.heldout_fraction)
        print(f"code corpus ({', '.join(corpus.manifest['sources'])}): {len(corpus.train)} train / "
              f"{len(corpus.heldout)} held-out files")
        return corpus.train, corpus.heldout

    def split(self, tok: Any) -> tuple[list, list]:
        train, heldout = self._texts()
        return packed_examples(train, tok, self.cfg.max_len), packed_examples(heldout, tok, self.cfg.max_len)

    def heldout(self, tok: Any) -> list:  # without tokenising the train split
        return packed_examples(self._texts()[1], tok, self.cfg.max_len)


SOURCES: dict[str, type[ExampleSource]] = {"text": TextFiles, "sharegpt": Conversations, "stdlib": CodeCorpus}


def example_source(cfg: DataConfig) -> ExampleSource:
    """`cfg`'s source, with registry data names (`sharegpt`) as their fetched files (fetched on first use)."""
    return SOURCES[cfg.kind](dataclasses.replace(cfg, train=resolve_data(cfg.train), heldout=resolve_data(cfg.heldout)))


def batch_examples(examples: list[dict], batch_size: int, max_batches: int) -> list[dict[str, np.ndarray]]:
    """Up to `max_batches` full batches (fixed, shardable shapes) of `examples`, in order."""
    n = min(len(examples) // batch_size, max_batches)
    if n == 0:
        raise DataError(f"{len(examples)} held-out examples are fewer than one batch of {batch_size}: add held-out "
                        "data, raise data.heldout_fraction or lower data.batch_size")
    return [{k: np.stack([e[k] for e in examples[i * batch_size: (i + 1) * batch_size]]) for k in examples[0]}
            for i in range(n)]


def stored_fields(hidden_size: int, captures: int = 0, label_top_k: int = 0) -> dict[str, tuple[int, Any]]:
    """What a stored example carries per position, name: (width, dtype): the target's hidden state, the inputs of
    `captures` layers side by side, its top-`label_top_k` label ids and log-probs."""
    fields: dict[str, tuple[int, Any]] = {"hidden": (hidden_size, np.float16)}
    if captures:
        fields["captured"] = (captures * hidden_size, np.float16)
    if label_top_k:
        fields |= {"label_ids": (label_top_k, np.int32), "label_logp": (label_top_k, np.float32)}
    return fields


def with_hidden(examples: list[dict], model: Transformer, target_params: dict, batch: int,
                store: str | Path = "", target: Any = None, captures: tuple[int, ...] = (), label_top_k: int = 0,
                store_layers: tuple[int, ...] = ()) -> StoredExamples:
    """Attach the target's hidden states `[T, D]` (fp16 on host) to every example, with `captures` the inputs of
    those layers `[T, C * D]` (`captured`, EAGLE-3's and DFlash's features), and with `label_top_k` its labels:
    the top-k next-token log-probabilities at each position (`label_ids [T, k]` int32, `label_logp [T, k]` fp32,
    from its fp32 logits; the rest of the mass is what they leave).

    With a `store` directory each is kept there (`hidden-<key>.npy`, `captured-<key>-<layers>.npy`,
    `label_ids-<key>-top<k>.npy`, ...; key: a digest of the target's identity `target`, its params' dtype,
    every example's tokens and trained length) and read back, memory-mapped, by any later run over the same
    examples and target, so the methods trained on one data set compute them once. `store_layers` (a superset of
    `captures`) is the layers whose inputs the store keeps, so methods capturing different layers share one file
    and one target pass; each reads its own layers' columns. Files complete in the store are read without
    waiting; the pass that fills the missing ones holds the store's lock (another run filling it then fails with a
    line saying so) and writes `<file>.partial<process>` files, recording the rows it has finished: a killed pass
    resumes there, and only complete files get their final names.

    The pass runs over rows sorted by length (`trained_lengths`) and cuts each batch at its longest row
    (`bucket_cut`); a row's positions past that cut, all padding after its last trained token, repeat the states of
    the last position computed (no loss reads them)."""
    tokens = np.stack([e["tokens"] for e in examples])  # [N, T]
    lengths = trained_lengths(examples)  # [N]
    d = model.config.hidden_size
    stored = (tuple(store_layers) or tuple(captures)) if captures else ()
    check_store_layers(stored, captures, model.config.num_layers)
    suffixes = {"hidden": "", "captured": "-" + "-".join(map(str, stored)), "label_ids": f"-top{label_top_k}",
                "label_logp": f"-top{label_top_k}"}
    wanted = {name: (suffixes[name], width, dtype)  # name: (file name suffix, width, dtype)
              for name, (width, dtype) in stored_fields(d, len(stored), label_top_k).items()}
    paths: dict[str, Path | None] = dict.fromkeys(wanted)
    if store:
        dtype = str(jax.tree.leaves(target_params)[0].dtype)
        key = json_digest([target, dtype, list(tokens.shape), hashlib.sha256(tokens.tobytes()).hexdigest(),
                           hashlib.sha256(lengths.astype(np.int64).tobytes()).hexdigest()])[:24]  # the cuts
        paths = {name: Path(store) / f"{name}-{key}{suffix}.npy" for name, (suffix, _, _) in wanted.items()}
    arrays = _read_complete(paths)
    if any(name not in arrays for name in wanted):
        # each process of a multi-process run fills its own copy (same rows, same result: the last rename wins)
        lock = Path(store) / f"{LOCK_FILE}-states-{jax.process_index()}"
        with file_lock(lock, "the target's states") if store else contextlib.nullcontext():
            arrays |= _read_complete({n: p for n, p in paths.items() if n not in arrays})  # completed meanwhile
            missing = [name for name in wanted if name not in arrays]
            arrays |= _compute_states(tokens, lengths, model, target_params, batch,
                                      {n: wanted[n][1:] for n in missing}, {n: paths[n] for n in missing},
                                      stored if "captured" in missing else ())
    columns = [stored.index(layer) for layer in captures]
    return StoredExamples(examples, arrays, None if columns == list(range(len(stored))) else columns)


def _read_complete(paths: dict[str, Path | None]) -> dict[str, np.ndarray]:
    """The store files of `paths` that are complete, memory-mapped (this process's leftovers of a pass that
    another process completed are removed)."""
    arrays = {}
    for name, path in paths.items():
        if path is not None and path.is_file():
            arrays[name] = np.load(path, mmap_mode="r")
            print(f"target {name} states: read from {path}")
            for leftover in _partial(path):
                leftover.unlink(missing_ok=True)
    return arrays


class StoredExamples(Sequence):
    """`examples` with row i of each of `arrays` (the target's states, memory-mapped) attached on access, and
    `captured` cut to the stored layers at positions `columns` (None: all of them)."""

    def __init__(self, examples: list[dict], arrays: dict[str, np.ndarray], columns: list[int] | None) -> None:
        self.examples, self.arrays, self.columns = examples, arrays, columns

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        example = self.examples[i] | {name: a[i] for name, a in self.arrays.items()}
        if self.columns is not None:
            captured = example["captured"]  # [T, stored layers * D]
            t, d = captured.shape[0], self.arrays["hidden"].shape[-1]
            example["captured"] = captured.reshape(t, -1, d)[:, self.columns].reshape(t, -1)
        return example


def target_states(model: Transformer, params: dict, tokens: jax.Array, names: dict[str, tuple[int, Any]],
                  captures: tuple[int, ...] = ()) -> dict[str, jax.Array]:
    """The target's states over `tokens [B, T]` named in `names` (name: (width, dtype)): `hidden`, `captured`
    (the inputs of layers `captures`), and `label_ids` / `label_logp`, its top-width next-token log-probs from
    its fp32 logits at each position."""
    out = target_forward(model, params, {"tokens": tokens}, captures if "captured" in names else ())
    states = {name: getattr(out, name).astype(dtype) for name, (_, dtype) in names.items()
              if name in ("hidden", "captured")}
    if "label_logp" in names or "label_ids" in names:
        k = (names.get("label_logp") or names["label_ids"])[0]
        logp, ids = jax.lax.top_k(jax.nn.log_softmax(out.logits.astype(jnp.float32), axis=-1), k)
        states |= {"label_ids": ids.astype(jnp.int32), "label_logp": logp}
    return {name: states[name] for name in names}


PARTIAL = ".partial"  # a store file being filled (`<file>.partial<process>`), with `.rows-by-length`: how many rows
# are done, in the pass's order (shortest first)
SAVE_EVERY_S = 60.0  # how often a store pass flushes its files and records its rows


def _compute_states(tokens: np.ndarray, lengths: np.ndarray, model: Transformer, target_params: dict, batch: int,
                    names: dict[str, tuple[int, Any]], paths: dict[str, Path | None], captures: tuple[int, ...]
                    ) -> dict[str, np.ndarray]:
    """One pass of the target over `tokens [N, T]`, rows shortest first by `lengths [N]`, each batch cut at its
    longest row (`bucket_cut`; the positions past the cut repeat the last one computed), filling the
    named states (`target_states`; name: (width, dtype)) into memory or, where `paths` name files, into their
    `.partial` files, resumed from the rows every one of them has recorded, and renamed to their paths when
    complete."""
    forward = jax.jit(functools.partial(target_states, model, names=names, captures=captures))
    order = np.argsort(lengths, kind="stable")  # the pass's order; a resume counts rows in it
    t = tokens.shape[1]
    arrays, done = {}, len(tokens)
    for name, (width, dtype) in names.items():
        shape = tokens.shape + (width,)
        if (path := paths[name]) is None:
            arrays[name], done = np.empty(shape, dtype), 0
            continue
        partial, rows = _partial(path)
        if partial.is_file() and rows.is_file():
            arrays[name] = np.lib.format.open_memmap(partial, "r+")
            if arrays[name].shape == shape and arrays[name].dtype == dtype:
                done = min(done, int(rows.read_text()))
                continue
        path.parent.mkdir(parents=True, exist_ok=True)
        rows.unlink(missing_ok=True)
        arrays[name], done = np.lib.format.open_memmap(partial, "w+", dtype, shape), 0
    start = done - done % batch
    if start:
        print(f"target {' and '.join(names)}: resuming a killed pass at row {start} of {len(tokens)}")
    saved = time.monotonic()
    for i in tqdm(range(start, len(tokens), batch), desc=f"target {' and '.join(names)}", unit="batch",
                  initial=start // batch, total=-(-len(tokens) // batch)):
        picked = np.sort(order[i: i + batch])
        cut = bucket_cut(int(lengths[picked].max()), t)
        for name, value in forward(target_params, jnp.asarray(tokens[picked, :cut])).items():
            arrays[name][picked] = np.pad(np.asarray(value), ((0, 0), (0, t - cut), (0, 0)), mode="edge")
        if time.monotonic() - saved > SAVE_EVERY_S:
            _record(arrays, paths, min(i + batch, len(tokens)))
            saved = time.monotonic()
    for name, path in paths.items():
        if path is not None:
            arrays[name].flush()
            del arrays[name]
            os.replace(_partial(path)[0], path)
            _partial(path)[1].unlink(missing_ok=True)
            arrays[name] = np.load(path, mmap_mode="r")
    return arrays


def _partial(path: Path) -> tuple[Path, Path]:
    """The file a pass fills for store file `path`, and the one recording its finished rows."""
    partial = path.with_name(f"{path.name}{PARTIAL}{jax.process_index()}")
    return partial, partial.with_name(partial.name + ".rows-by-length")


def _record(arrays: dict[str, np.ndarray], paths: dict[str, Path | None], rows: int) -> None:
    """Flush the store files being filled and record that their first `rows` rows are done."""
    for name, path in paths.items():
        if path is not None:
            arrays[name].flush()
            write_atomic(_partial(path)[1], str(rows))
