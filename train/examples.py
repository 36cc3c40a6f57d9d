"""Training examples: tokenised, split into train and held-out, batched, with the target's hidden states
attached where cached, and the data's identity for resumes."""

from __future__ import annotations

import abc
import dataclasses
import functools
import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from amphista_jax import config_io
from amphista_jax.drafters.draft_vocab import DraftVocab, most_frequent, token_counts
from amphista_jax.fetch import resolve_data
from amphista_jax.identity import files_digest, json_digest, matching_files
from amphista_jax.models.llama import Transformer
from amphista_jax.train.config import DataConfig, TrainConfig, TrainConfigError
from amphista_jax.train.corpus import build_corpus, package_version
from amphista_jax.train.data import DataError, conversation_examples, packed_examples, text_examples
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
        return conversation_examples(path, tok, self.cfg.max_len, self.cfg.max_examples)


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


def with_hidden(examples: list[dict], model: Transformer, target_params: dict, batch: int,
                store: str | Path = "", target: Any = None, captures: tuple[int, ...] = (), label_top_k: int = 0
                ) -> list[dict]:
    """Attach the target's hidden states `[T, D]` (fp16 on host) to every example, with `captures` the inputs of
    those layers `[T, C * D]` (`captured`, EAGLE-3's features), and with `label_top_k` its labels: the top-k
    next-token log-probabilities at each position (`label_ids [T, k]` int32, `label_logp [T, k]` fp32, from its
    fp32 logits; the rest of the mass is what they leave). With a `store` directory each is kept there
    (`hidden-<key>.npy`, `captured-<key>-<layers>.npy`, `label_ids-<key>-top<k>.npy`, ...; key: a digest of the
    target's identity `target`, its params' dtype and every example's tokens) and read back, memory-mapped, by
    any later run over the same examples and target, so the methods trained on one data set compute them once; a
    file is written under a temporary name and renamed when complete (a killed run leaves nothing a later one
    trusts)."""
    tokens = np.stack([e["tokens"] for e in examples])  # [N, T]
    d = model.config.hidden_size
    wanted = {"hidden": ("", d, np.float16)}  # name: (file name suffix, width, dtype)
    if captures:
        wanted["captured"] = ("-" + "-".join(map(str, captures)), len(captures) * d, np.float16)
    if label_top_k:
        wanted |= {"label_ids": (f"-top{label_top_k}", label_top_k, np.int32),
                   "label_logp": (f"-top{label_top_k}", label_top_k, np.float32)}
    paths: dict[str, Path | None] = dict.fromkeys(wanted)
    if store:
        dtype = str(jax.tree.leaves(target_params)[0].dtype)
        key = json_digest([target, dtype, list(tokens.shape), hashlib.sha256(tokens.tobytes()).hexdigest()])[:24]
        paths = {name: Path(store) / f"{name}-{key}{suffix}.npy" for name, (suffix, _, _) in wanted.items()}
    arrays = {name: np.load(path, mmap_mode="r") for name, path in paths.items() if path and path.is_file()}
    for name in arrays:
        print(f"target {name} states: read from {paths[name]}")
    missing = [name for name in wanted if name not in arrays]
    if missing:
        arrays |= _compute_states(tokens, model, target_params, batch, {n: wanted[n][1:] for n in missing},
                                  {n: paths[n] for n in missing}, captures)
    return [e | {name: a[i] for name, a in arrays.items()} for i, e in enumerate(examples)]


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


def _compute_states(tokens: np.ndarray, model: Transformer, target_params: dict, batch: int,
                    names: dict[str, tuple[int, Any]], paths: dict[str, Path | None], captures: tuple[int, ...]
                    ) -> dict[str, np.ndarray]:
    """One pass of the target over `tokens [N, T]` filling the named states (`target_states`; name: (width,
    dtype)), each into its file's temporary name (renamed when complete) or into memory."""
    forward = jax.jit(functools.partial(target_states, model, names=names, captures=captures))
    arrays, temps = {}, {}
    for name, (width, dtype) in names.items():
        shape = tokens.shape + (width,)
        if (path := paths[name]) is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            temps[name] = path.with_name(f"{path.name}.tmp{os.getpid()}")
            arrays[name] = np.lib.format.open_memmap(temps[name], "w+", dtype, shape)
        else:
            arrays[name] = np.empty(shape, dtype)
    for i in tqdm(range(0, len(tokens), batch), desc=f"target {' and '.join(names)}", unit="batch"):
        for name, value in forward(target_params, jnp.asarray(tokens[i: i + batch])).items():
            arrays[name][i: i + batch] = np.asarray(value)
    for name, tmp in temps.items():
        arrays[name].flush()
        del arrays[name]
        os.replace(tmp, paths[name])
        arrays[name] = np.load(paths[name], mmap_mode="r")
    return arrays
