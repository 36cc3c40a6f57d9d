"""Self-distillation data: the target answers each prompt with our own jitted batch generation.

    amphista-jax distill --model DIR --prompts FILE --out FILE [--batch-size 64] [--max-new-tokens 256] [--limit N]

Prompts come from JSONL (`prompt`, `turns` (first turn) or a ShareGPT/messages record (first user turn));
each record's `id` (or `question_id`, else its line number) identifies it. Prompts longer than `--prompt-len`
tokens (after the chat template) are skipped and counted, never cut: a cut chat prompt would lose its template's
header. The rest are answered shortest first, one power-of-two length bucket at a time, `--batch-size` rows on
device with in-flight batching: the jitted decode loop stops once a few rows have stopped, those are written and
their rows refilled with the next prompts (a prefill scattered into their cache rows), while the others go on with
their caches (`answer_in_flight`), so a batch never idles while one long answer finishes. `--no-refill` runs
static batches instead (each until its last row stops), for comparison.

Answers are appended to `--out` as ShareGPT JSONL, one line per finished prompt, with the answer's token ids
(`answer_ids`, a stop token included) and why it stopped (`stop`: "eos" or "length"), so a rerun skips what is
already answered and a later pass reads the target's own tokens without re-tokenizing its text.

`--out` must be a new file or an earlier distill output: any line that is not a distilled record is refused
and the file is left as it is. Only a torn last line (a run killed mid-write: no newline, the start of a
record) is cut before appending.
"""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
from tqdm import tqdm

from amphista_jax.engine.decode import advance, ar_idle, pad_prompts, refill
from amphista_jax.engine.decode_spec import DecodeSpec, bucket
from amphista_jax.infra.errors import OutputExistsError, UsageError, check_writable_dir
from amphista_jax.infra.output_lock import file_lock, lock_beside, write_atomic
from amphista_jax.models.hf import load_config, load_params
from amphista_jax.models.tokenizer import encode_prompt, load_tokenizer, stop_token_ids
from amphista_jax.train.data import DataError, DataReport, normalize_messages, read_records
from amphista_jax.trees.sampling import SamplingConfig


def read_prompts(path: str | Path) -> tuple[list[tuple[str, str]], DataReport]:
    """(id, prompt text) pairs; unusable records are skipped and counted."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"prompts file {path} does not exist")
    report = DataReport(str(path))
    prompts = []
    for line, record in _records(path, report):
        text = _prompt_text(record)
        if text is None:
            report.skip(line, "no prompt (expected `prompt`, `turns` or a conversation with a user turn)")
            continue
        if not text.strip():
            report.skip(line, "an empty prompt (nothing to answer; the evaluation refuses such records)")
            continue
        key = record.get("id", record.get("question_id", line)) if isinstance(record, dict) else line
        prompts.append((str(key), text))
        report.kept += 1
    if not prompts:
        first = report.problems[0] if report.problems else "the file is empty"
        raise DataError(f"{path} yields no prompt ({first}; {sum(report.skipped.values())} lines skipped): fix "
                        "the file or pass other --prompts")
    return prompts, report


def _records(path: Path, report: DataReport) -> Iterator[tuple[int, Any]]:
    """`read_records`, with unreadable files (not text, not gzip) as one-line `DataError`s."""
    try:
        yield from read_records(path, report)
    except (UnicodeDecodeError, EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DataError(f"{path} cannot be read as UTF-8 JSONL ({e}): pass a JSONL file of prompts") from None


def _prompt_text(record: Any) -> str | None:
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("prompt"), str):
        return record["prompt"]
    if isinstance(record.get("turns"), list) and record["turns"] and isinstance(record["turns"][0], str):
        return record["turns"][0]
    try:
        return next(m["content"] for m in normalize_messages(record, require_assistant=False) if m["role"] == "user")
    except (ValueError, StopIteration):
        return None


_RECORD_START = '{"id": '  # how every line distill writes begins (json.dumps of a dict with `id` first)


def _answered_ids(out: Path) -> tuple[set[str], int | None]:
    """(ids already answered in `out`, the byte length to cut it to before appending, or None to keep it).

    Only a torn last line (a run killed mid-write: no newline, the start of a distilled record) may be cut;
    any other line that is not a distilled record means `out` is not a distill output: refused, untouched."""
    if not out.exists():
        return set(), None
    if not out.is_file():
        raise OutputExistsError(f"--out {out} is a directory, not a JSONL file: pick a new --out file")
    data = out.read_bytes()
    lines = data.split(b"\n")
    torn = lines.pop()  # b"" when the file ends with a newline
    ids = set()
    for i, raw in enumerate(lines, start=1):
        key = _record_id(raw)
        if key is None:
            raise OutputExistsError(f"--out {out}:{i} is not a record written by distill (expected "
                                    '{"id": ..., "conversations": [...]}), so the file is not a distill output; '
                                    "pick a new --out (it was left as it is)")
        ids.add(key)
    if not torn:
        return ids, None
    if _record_id(torn) is not None:  # complete but for the newline
        return ids | {_record_id(torn)}, None
    if not torn.startswith(_RECORD_START.encode()):
        raise OutputExistsError(f"--out {out}:{len(lines) + 1} is not a record written by distill, so the file is "
                                "not a distill output; pick a new --out (it was left as it is)")
    return ids, len(data) - len(torn)


def _record_id(raw: bytes) -> str | None:
    """The id of one line written by distill, else None."""
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or "id" not in record or not isinstance(record.get("conversations"), list):
        return None
    return str(record["id"])


def check_distill_args(model: str, prompts_file: str, out_file: str, batch_size: int, max_new_tokens: int,
                       prompt_len: int, temperature: float, limit: int = 0) -> None:
    """UsageError (or the checkpoint's own error) for arguments that cannot work, before anything is loaded."""
    for name, value in (("batch_size", batch_size), ("max_new_tokens", max_new_tokens), ("prompt_len", prompt_len)):
        if value < 1:
            raise UsageError(f"--{name.replace('_', '-')} {value}: must be >= 1")
    if limit < 0:
        raise UsageError(f"--limit {limit}: must be >= 0 (0 = every prompt)")
    if temperature < 0:
        raise UsageError(f"--temperature {temperature}: must be >= 0 (0 = greedy)")
    if Path(prompts_file).resolve() == Path(out_file).resolve():
        raise UsageError(f"--out {out_file} is the --prompts file: answers go to a separate file; pick another --out")
    config = load_config(model)  # a checkpoint directory with a config.json
    if prompt_len + max_new_tokens > config.max_positions:  # a continued answer's context reaches both
        raise UsageError(f"--prompt-len {prompt_len} + --max-new-tokens {max_new_tokens} exceed the "
                         f"{config.max_positions} positions {model} was trained for: lower them")
    check_writable_dir(Path(out_file).parent, "--out directory")


def length_buckets(lengths: list[int], prompt_len: int) -> list[int]:
    """Each prompt's padded length: the Generator's length bucket (`decode_spec.bucket`), capped at `prompt_len`."""
    return [min(prompt_len, bucket(n)) for n in lengths]


@dataclasses.dataclass
class Answering:
    """A prompt being answered: its token ids and, once done, its answer."""

    key: str
    prompt: str
    ids: list[int]
    answer: list[int] = dataclasses.field(default_factory=list)


class Rows(Protocol):
    """`batch` decoding rows on device, as in-flight batching drives them (`InFlight`)."""

    batch: int

    def refill(self, slots: list[int], contexts: list[list[int]]) -> None:
        """Start `contexts` in the (done) rows `slots`."""

    def run(self, until_done: int) -> list[list[int] | None]:
        """Decode until at least `until_done` rows are done; per row, its answer if done, else None."""


def answer_in_flight(todo: list[Answering], rows: Rows, refill: bool, min_refill: int) -> Iterator[Answering]:
    """Answer `todo` in `rows` (shortest prompts first), yielding each prompt as its row stops. With `refill`
    (in-flight batching) the decode loop stops once `min_refill` more rows are done (fewer when fewer are live) and
    the next prompts take those rows, while the others go on with their caches; without it, batches run until
    their last row stops (static batching)."""
    queue = sorted(todo, key=lambda a: len(a.ids))
    held: list[Answering | None] = [None] * rows.batch
    while True:
        free = [i for i, a in enumerate(held) if a is None]
        if queue and (refill or len(free) == rows.batch):
            new, queue = queue[: len(free)], queue[len(free):]
            rows.refill(free[: len(new)], [a.ids for a in new])
            for i, a in zip(free[: len(new)], new, strict=True):
                held[i] = a
        live = rows.batch - held.count(None)
        if not live:
            return
        until = rows.batch - live + min(min_refill, live) if refill and queue else rows.batch
        for i, answer in enumerate(rows.run(until)):
            if answer is not None and held[i] is not None:
                held[i].answer = answer
                yield held[i]
                held[i] = None


class InFlight:
    """`Rows` on `decode`: an autoregressive state of `batch` rows with a cache of `prompt_len + max_new_tokens`
    slots, prompts right-padded to `prompt_len`. A refill prefills a power of two of rows, at least `min_refill`
    (padding rows dropped), so a few programs serve every refill; `run` is one program for any `until_done`."""

    def __init__(self, params: dict, spec: DecodeSpec, batch: int, prompt_len: int, key: jax.Array,
                 min_refill: int):
        self.params, self.spec, self.batch, self.prompt_len, self.min_refill = params, spec, batch, prompt_len, \
            min_refill
        steps_key, self.key = jax.random.split(key)  # the decode steps' draws, the refills'
        self.refills = itertools.count()
        dtype = jax.tree.leaves(params)[0].dtype
        self.state = ar_idle(spec.config, batch, prompt_len + spec.max_new_tokens, spec.max_new_tokens,
                             steps_key, dtype, spec.pad_id)
        self.row_steps = 0  # batch x decode steps run: the slots the answers' tokens could have used

    def refill(self, slots: list[int], contexts: list[list[int]]) -> None:
        r = min(self.batch, max(self.min_refill, 1 << (len(slots) - 1).bit_length()))
        tokens, lengths = pad_prompts(contexts + [contexts[0]] * (r - len(contexts)), length=self.prompt_len,
                                      pad_id=self.spec.pad_id)
        index = np.array(slots + [self.batch] * (r - len(slots)), np.int32)  # `batch`: a dropped padding row
        self.state = refill(self.params, self.state, index, tokens, lengths,
                            jax.random.fold_in(self.key, next(self.refills)), spec=self.spec)

    def run(self, until_done: int) -> list[list[int] | None]:
        before = int(self.state.steps)
        self.state = advance(self.params, None, self.state, until_done, spec=self.spec,
                             steps=self.spec.max_new_tokens)
        done, counts = np.asarray(self.state.done), np.asarray(self.state.num_tokens)
        self.row_steps += (int(self.state.steps) - before) * self.batch
        tokens = np.asarray(self.state.tokens)
        return [row[:n].tolist() if d else None for row, n, d in zip(tokens, counts, done, strict=True)]


MIN_REFILL = 4  # rows a refill waits for (at most half the batch) and prefills at least (padding dropped)


def refill_wait(batch: int) -> int:
    """How many rows in-flight batching waits to stop before it refills: `MIN_REFILL`, at most half the batch."""
    return max(1, min(MIN_REFILL, batch // 2))


def distill(model: str, prompts_file: str, out_file: str, batch_size: int = 64, max_new_tokens: int = 256,
            prompt_len: int = 256, chat: bool | None = None, temperature: float = 0.0, seed: int = 0,
            limit: int = 0, refill: bool = True, shard: tuple[int, int] = (0, 1)) -> int:
    """Answer every distinct prompt (the first `limit` that fit, with `limit`) not yet in `out_file`, one length
    bucket at a time, `batch_size` rows with in-flight refills (`answer_in_flight`; static batches without
    `refill`); with `shard` (i, n) only every n-th of them from the i-th, so n processes answer disjoint shards into
    their own files (`merge_answers` joins them). Returns how many were answered in this run."""
    check_distill_args(model, prompts_file, out_file, batch_size, max_new_tokens, prompt_len, temperature, limit)
    out = Path(out_file)
    with file_lock(lock_beside(out), "distill"):  # one run appends to a file at a time
        done, cut = _answered_ids(out)
        prompts, report = read_prompts(prompts_file)
        print(report.summary())
        tok = load_tokenizer(model)
        chat = bool(tok.chat_template) if chat is None else chat
        encoded, too_long, seen = [], 0, set()
        for key, prompt in prompts:
            ids = encode_prompt(tok, prompt, chat=chat)
            if len(ids) > prompt_len:
                too_long += 1
                continue
            if tuple(ids) in seen:  # ShareGPT repeats prompts: each is answered once
                continue
            seen.add(tuple(ids))
            encoded.append(Answering(key, prompt, ids))
            if limit and len(encoded) == limit:
                break
        encoded = encoded[shard[0]::shard[1]]
        todo = [a for a in encoded if a.key not in done]
        print(f"{'' if shard[1] == 1 else f'shard {shard[0]}/{shard[1]}: '}"
              f"{len(encoded)} distinct prompts of at most {prompt_len} tokens ({too_long} longer ones skipped"
              f"{'' if not limit else f' before the first {limit}'}); {len(encoded) - len(todo)} already answered "
              f"in {out}; {len(todo)} to go")
        if not todo:
            return 0
        params, config = load_params(model, layout="split")  # decoding's layout: no per-step weight or cache copies
        eos = stop_token_ids(model, tok, config)
        spec = DecodeSpec(config, None, None, max_new_tokens, SamplingConfig(temperature), eos_ids=eos,
                          pad_id=config.pad_token_id or 0)
        out.parent.mkdir(parents=True, exist_ok=True)
        if cut is not None:
            print(f"warning: cutting the torn last line of {out} (an interrupted run); that prompt is redone")
            with out.open("r+b") as f:
                f.truncate(cut)
        buckets = itertools.groupby(sorted(todo, key=lambda a: len(a.ids)),
                                    key=lambda a: length_buckets([len(a.ids)], prompt_len)[0])
        t0, new_tokens, row_steps = time.perf_counter(), 0, 0
        with out.open("a") as f, tqdm(total=len(todo), desc="distill", unit="prompt") as bar:
            for length, group in buckets:
                # each bucket and shard draws its own keys (at temperature > 0 no two share a sample's noise)
                keys = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), shard[0]), length)
                rows = InFlight(params, spec, batch_size, length, keys, MIN_REFILL)
                for a in answer_in_flight(list(group), rows, refill, refill_wait(batch_size)):
                    f.write(json.dumps({"id": a.key, "conversations": [
                        {"from": "human", "value": a.prompt},
                        {"from": "gpt", "value": tok.decode(a.answer, skip_special_tokens=True)}],
                        "answer_ids": a.answer, "stop": "eos" if a.answer[-1] in eos else "length"}) + "\n")
                    f.flush()
                    new_tokens += len(a.answer)
                    bar.set_postfix(tokens_per_s=f"{new_tokens / (time.perf_counter() - t0):.1f}")
                    bar.update(1)
                row_steps += rows.row_steps
        seconds = time.perf_counter() - t0
        print(f"answered {len(todo)} prompts, {new_tokens} tokens in {seconds:.0f} s ({new_tokens / seconds:.1f} "
              f"tokens/s, compiles included); {1 - (new_tokens - len(todo)) / max(row_steps, 1):.1%} of the decode "
              "row-steps idle")  # each answer's first token comes from its prefill
        return len(todo)


def process_shard(out_file: str, shard: tuple[int, int]) -> tuple[str, tuple[int, int]]:
    """(the file this process answers into, its shard). In a multi-process `jax.distributed` run with no shard given,
    process i of n answers every n-th prompt from the i-th into `<stem>.process<i><suffix>` beside `out_file`
    (each resumable on its own; `--merge` joins them); otherwise `out_file` and `shard` as given."""
    if shard != (0, 1) or jax.process_count() == 1:
        return out_file, shard
    out = Path(out_file)
    return str(out.with_name(f"{out.stem}.process{jax.process_index()}{out.suffix}")), (jax.process_index(),
                                                                                       jax.process_count())


def merge_answers(inputs: list[str], out_file: str) -> int:
    """Join distill outputs (the shards of one run, `distill(shard=...)`) into a new `out_file`, every complete answer
    once; refuses an input that is not a distill output, an id answered in two inputs, and an existing `out_file`.
    Returns how many answers it holds."""
    out = Path(out_file)
    if out.exists():
        raise OutputExistsError(f"--out {out} exists: merge writes a new file; pick another --out")
    lines, seen = [], {}
    for name in inputs:
        path = Path(name)
        if not path.is_file():
            raise UsageError(f"--merge {path} does not exist: pass the files distill --shard wrote")
        ids, cut = _answered_ids(path)
        data = path.read_bytes()
        for raw in (data if cut is None else data[:cut]).splitlines():
            key = _record_id(raw)
            if key in seen:
                raise UsageError(f"answer {key!r} is in both {seen[key]} and {path}: merge the shards of one run, "
                                 "each once")
            seen[key] = path
            lines.append(raw.decode() + "\n")
    check_writable_dir(out.parent, "--out directory")
    write_atomic(out, "".join(lines))
    return len(lines)
