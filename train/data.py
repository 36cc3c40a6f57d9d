"""grain pipelines: packed fixed-length sequences (pre-training, plain text/code) and chat conversations
(ShareGPT / messages) with assistant-only loss masks. The JAX processes read one shuffled order together, each
its own rows of every global batch, so the batches do not depend on how many processes there are."""

from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
from transformers import PreTrainedTokenizerBase

from amphista_jax.infra.errors import UserError
from amphista_jax.models.tokenizer import encode_conversation


def pack_documents(docs: Sequence[Sequence[int]], eos_id: int, seq_len: int, pad_id: int | None = None
                   ) -> np.ndarray:
    """Concatenate `doc + [eos]` for every doc and cut into `[N, seq_len + 1]` windows; consecutive windows
    share one boundary token so every position is a target once. The last partial window is dropped, or, with
    `pad_id`, padded with it (so every token is kept)."""
    stream = np.concatenate([np.append(np.asarray(d, np.int32), eos_id) for d in docs])
    if pad_id is not None:
        stream = np.pad(stream, (0, (-(len(stream) - 1)) % seq_len), constant_values=pad_id)
    n = (len(stream) - 1) // seq_len
    if n == 0:
        raise DataError(f"{len(stream)} tokens are too few for one sequence of {seq_len=} + 1: add data or lower the "
                        "sequence length (data.max_len / seq_len)")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[idx]


def process_rows(ds: grain.MapDataset, batch_size: int, rows: slice = slice(None)) -> grain.MapDataset:
    """`ds` repeated and cut into global batches of `batch_size` rows, of which this process yields `rows` (those
    its devices hold: `sharding.process_batch_rows`). Every process reads the one shuffled order, so the batches do
    not depend on how many processes share them. The iterator's `get_state()` is JSON and resumes exactly."""
    return _own_rows(ds.repeat().batch(batch_size, drop_remainder=True), rows)


def _own_rows(batches: grain.MapDataset, rows: slice) -> grain.MapDataset:
    return batches if rows == slice(None) else batches.map(lambda batch: jax.tree.map(lambda x: x[rows], batch))


LENGTH_BUCKET = 64  # batches grouped by length are cut at their longest row rounded up to this many positions


def trained_lengths(examples: Sequence[dict[str, np.ndarray]]) -> np.ndarray:
    """`[N]`: each example up to its last trained (`loss_mask`) position (0 for one with none)."""
    masks = np.stack([e["loss_mask"] for e in examples]) > 0  # [N, T]
    return np.where(masks.any(-1), masks.shape[1] - np.argmax(masks[:, ::-1], -1), 0)


def bucket_cut(longest: int, max_len: int) -> int:
    """Where a batch whose longest row has `longest` positions is cut: rounded up to `LENGTH_BUCKET`, at most
    `max_len` (few distinct cuts: one compiled program each)."""
    return min(max_len, max(LENGTH_BUCKET, -(-longest // LENGTH_BUCKET) * LENGTH_BUCKET))


class _Flatten(grain.MapDataset):
    """Each element of `parent` (a sequence of `size` items) as `size` consecutive elements."""

    def __init__(self, parent: grain.MapDataset, size: int) -> None:
        super().__init__(parent)
        self.size = size

    def __len__(self) -> int:
        return len(self._parent) * self.size

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        group, i = divmod(index, self.size)
        return self._parent[group][i]


def length_grouped_dataset(examples: Sequence[dict[str, np.ndarray]], lengths: np.ndarray, max_len: int,
                           batch_size: int, seed: int, groups: int, rows: slice = slice(None)) -> grain.MapDataset:
    """Shuffled, repeated batches of `batch_size` `examples` (of `max_len` positions) of similar length, this
    process's `rows` of each: the shuffled order is taken `groups` batches at a time, sorted there by `lengths`
    (`trained_lengths`) and cut into batches, which come in an order drawn from `seed` and the group's index; each
    batch is cut at its longest row (`bucket_cut`: positions past it are padding no loss reads). Each step's loss
    is its batch's as before; over a run, batches of short rows weigh their fewer tokens more, as any batch does.
    The iterator's `get_state()` resumes exactly."""
    lengths = np.asarray(lengths)

    def sorted_batches(index: int, chunk: np.ndarray) -> np.ndarray:  # [groups, batch_size] example ids
        order = np.asarray(chunk)[np.argsort(lengths[chunk], kind="stable")].reshape(groups, batch_size)
        return order[np.random.default_rng([seed, index]).permutation(groups)]

    def collate(ids: np.ndarray) -> dict[str, np.ndarray]:  # the global batch's cut, this process's rows
        cut = bucket_cut(int(lengths[ids].max()), max_len)
        picked = [examples[int(i)] for i in ids[rows]]
        return {k: np.stack([e[k][:cut] for e in picked]) for k in picked[0]}

    chunks = grain.MapDataset.range(len(examples)).shuffle(seed=seed).repeat().batch(batch_size * groups,
                                                                                    drop_remainder=True)
    return _Flatten(chunks.map_with_index(sorted_batches), groups).map(collate)


def packed_dataset(windows: np.ndarray, batch_size: int, seed: int, skip: int = 0,
                   rows: slice = slice(None)) -> grain.MapDataset:
    """Shuffled, repeated `[batch_size, seq_len + 1]` batches of `windows`, this process's `rows` of each
    (`process_rows`); the first `skip` windows of the shuffled order (those an earlier stage read) come at the end
    of each epoch instead."""
    ds = grain.MapDataset.source(windows).shuffle(seed=seed)
    skip %= len(ds)
    if skip:
        ds = grain.MapDataset.concatenate([ds[skip:], ds[:skip]])
    return process_rows(ds, batch_size, rows)


# ---------------------------------------------------------------------------------------------------------------
# Conversations (ShareGPT / messages JSON or JSONL) -> chat-template tokens with assistant-only loss masks.

ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}


class DataError(UserError, ValueError):
    """A dataset that yields no usable example, or cannot be read at all."""


@dataclasses.dataclass
class DataReport:
    """What loading kept and skipped; `problems` holds the first few skipped records by line number."""

    source: str
    kept: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    problems: list[str] = dataclasses.field(default_factory=list)

    def skip(self, line: int, reason: str, max_problems: int = 5) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.problems) < max_problems:
            self.problems.append(f"{self.source}:{line}: {reason}")

    def summary(self) -> str:
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) or "none"
        lines = [f"{self.source}: kept {self.kept} records; skipped: {skipped}"] + [f"  {p}" for p in self.problems]
        return "\n".join(lines)


def read_records(path: Path, report: DataReport) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) for a JSONL file (gzipped when it ends in .gz) or a JSON list file; bad JSON
    lines are skipped and reported by line number."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            text = f.read()
    else:
        text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} is not valid JSON ({e}); use a JSON list or one JSON object per line") from e
        yield from ((i + 1, item) for i, item in enumerate(items))
        return
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield i, json.loads(line)
        except json.JSONDecodeError as e:
            report.skip(i, f"invalid JSON ({e.msg})")


def normalize_messages(record: Any, require_assistant: bool = True) -> list[dict[str, str]]:
    """`[{"role", "content"}]` from a ShareGPT (`conversations`/`from`/`value`) or `messages` record.

    Leading assistant turns (answers to no prompt) are dropped. Raises ValueError naming the problem (empty
    conversation, unknown role, missing text, no assistant turn).
    """
    if not isinstance(record, dict):
        raise ValueError("record is not a JSON object")
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list) or not turns:
        raise ValueError("empty conversation")
    out = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise ValueError("turn is not a JSON object")
        role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        if role not in ROLE_ALIASES:
            raise ValueError(f"unknown role {role!r}")
        if not isinstance(content, str):
            raise ValueError("turn has no text")
        out.append({"role": ROLE_ALIASES[role], "content": content})
    while out and out[0]["role"] == "assistant":  # an answer to nothing (ShareGPT has them): dropped, as FastChat does
        out.pop(0)
    if not out:
        raise ValueError("no turn before the assistant's")
    if require_assistant and not any(m["role"] == "assistant" for m in out):
        raise ValueError("no assistant turn")
    return out


def render_with_mask(tok: PreTrainedTokenizerBase, messages: list[dict[str, str]], max_len: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Chat-template tokens `[T]` (T <= max_len) and a loss mask `[T]` that is 1 exactly on the tokens of
    assistant turns (their text and the template's end-of-turn marker, not the headers before them)."""
    def render(msgs: list[dict[str, str]], prompt: bool) -> str:
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)

    text = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start = len(render(messages[:i], True))
            end = len(render(messages[: i + 1], False))
            spans.append((start, end))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True, truncation=True, max_length=max_len)
    ids = np.asarray(enc["input_ids"], np.int32)
    mask = np.zeros(len(ids), np.int32)
    for j, (a, b) in enumerate(enc["offset_mapping"]):
        mask[j] = any(s <= a < e for s, e in spans) and b > a
    return ids, mask


def answered_with_mask(tok: PreTrainedTokenizerBase, messages: list[dict[str, str]], answer_ids: Any, max_len: int
                       ) -> tuple[np.ndarray, np.ndarray]:
    """A regenerated record (`amphista-jax distill`): the prompt as distill encoded it (the turns before the last,
    through the chat template with the assistant's header; the first user turn as plain text for a tokenizer with
    none) followed by the target's own answer tokens `answer_ids` exactly as it generated them (its text would not
    always tokenise back to them), cut at `max_len`; the loss mask is 1 on the answer. Raises ValueError naming a
    record whose answer is not a list of token ids of this tokenizer, or whose last turn is not the assistant's."""
    if messages[-1]["role"] != "assistant":
        raise ValueError("answer_ids without the assistant's turn last")
    vocab = len(tok)
    if (not isinstance(answer_ids, list) or not answer_ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in answer_ids)):
        raise ValueError(f"answer_ids is not a non-empty list of token ids below {vocab}")
    prompt = messages[:-1]
    prompt_ids = (encode_conversation(tok, prompt) if tok.chat_template
                  else list(tok(prompt[0]["content"], add_special_tokens=True, verbose=False)["input_ids"]))
    ids = np.asarray(prompt_ids + answer_ids, np.int32)[:max_len]
    mask = (np.arange(len(ids)) >= len(prompt_ids)).astype(np.int32)
    return ids, mask


def conversation_examples(path: str | Path, tok: PreTrainedTokenizerBase, max_len: int, limit: int = 0
                          ) -> tuple[list[dict[str, np.ndarray]], DataReport]:
    """Padded examples `{"tokens": [max_len], "loss_mask": [max_len]}` from a conversations file: the first
    `limit` usable ones (0: all), each token sequence once. A record with `answer_ids` (regenerated by the target)
    trains on those tokens (`answered_with_mask`); any other, on its text through the chat template
    (`render_with_mask`)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dataset {path} does not exist")
    report = DataReport(str(path))
    examples, seen = [], set()  # digests of the examples kept
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    for line, record in read_records(path, report):
        try:
            messages = normalize_messages(record)
        except ValueError as e:
            report.skip(line, str(e))
            continue
        try:
            ids, mask = (answered_with_mask(tok, messages, record["answer_ids"], max_len) if "answer_ids" in record
                         else render_with_mask(tok, messages, max_len))
        except ValueError as e:
            report.skip(line, str(e))
            continue
        if mask.sum() == 0:
            report.skip(line, "no trainable token within max_len")
            continue
        # the same tokens twice (ShareGPT repeats prompts; the target answers a prompt the same way each time) would
        # weigh those answers double and could land in both the train and the held-out split
        digest = hashlib.sha256(np.asarray(ids, np.int32).tobytes() + np.asarray(mask, np.int8).tobytes()).digest()
        if digest in seen:
            report.skip(line, "the same tokens as an earlier record")
            continue
        seen.add(digest)
        tokens = np.full(max_len, pad, np.int32)
        loss_mask = np.zeros(max_len, np.int32)
        tokens[: len(ids)], loss_mask[: len(ids)] = ids, mask
        examples.append({"tokens": tokens, "loss_mask": loss_mask})
        report.kept += 1
        if len(examples) == limit:
            break
    if not examples:
        raise DataError(f"{path} yields no usable example:\n{report.summary()}")
    return examples, report


def packed_examples(texts: Sequence[str], tok: PreTrainedTokenizerBase, seq_len: int) -> list[dict[str, np.ndarray]]:
    """`{"tokens": [seq_len], "loss_mask": ones}` windows of the documents packed end to end."""
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    windows = pack_documents(tok(list(texts), add_special_tokens=True)["input_ids"], eos, seq_len - 1)
    return [{"tokens": w, "loss_mask": np.ones_like(w)} for w in windows]


def text_examples(pattern: str, tok: PreTrainedTokenizerBase, seq_len: int) -> tuple[list[dict[str, np.ndarray]],
                                                                                   DataReport]:
    """Packed examples from plain text/code files (a directory, read recursively, or a glob)."""
    base = Path(pattern)
    names = [str(p) for p in base.rglob("*")] if base.is_dir() else glob.glob(pattern, recursive=True)
    files = sorted(Path(n) for n in names if Path(n).is_file())
    report = DataReport(pattern)
    texts = []
    for i, f in enumerate(files, start=1):
        try:
            texts.append(f.read_text(encoding="utf-8"))
            report.kept += 1
        except (UnicodeDecodeError, OSError) as e:
            report.skip(i, f"{f}: unreadable ({type(e).__name__})")
    if not texts:
        raise DataError(f"{pattern} matches no readable text file")
    return packed_examples(texts, tok, seq_len), report


def example_dataset(examples: list[dict[str, np.ndarray]], batch_size: int, seed: int,
                    rows: slice = slice(None)) -> grain.MapDataset:
    """Shuffled, repeated batches of `batch_size` `examples` (dicts of equal-shape arrays), this process's `rows`
    of each (`process_rows`)."""
    return process_rows(grain.MapDataset.source(examples).shuffle(seed=seed), batch_size, rows)
