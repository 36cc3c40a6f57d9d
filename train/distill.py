"""Self-distillation data: the target answers each prompt with our own jitted batch generation.

    amphista-jax distill --model DIR --prompts FILE --out FILE [--batch-size 64] [--max-new-tokens 256] [--limit N]

Prompts come from JSONL (`prompt`, `turns` (first turn) or a ShareGPT/messages record (first user turn));
each record's `id` (or `question_id`, else its line number) identifies it. Prompts longer than `--prompt-len`
tokens (after the chat template) are skipped and counted, never cut: a cut chat prompt would lose its template's
header. The rest are answered shortest first, `--batch-size` rows at a time and `--chunk` new tokens per pass: after
each pass the rows that stopped are written and their slots refilled with the next prompts, the others go on from
their prompt and answer so far (`answer_in_chunks`), so a batch never idles while one long answer finishes. Contexts
are padded to power-of-two length buckets (one compiled program per bucket).

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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from amphista_jax.decode import generate, pad_prompts
from amphista_jax.errors import OutputExistsError, UsageError, check_writable_dir
from amphista_jax.generator import bucket
from amphista_jax.models.hf import load_config, load_params
from amphista_jax.output_lock import file_lock, lock_beside, write_atomic
from amphista_jax.prompt_checks import check_fits
from amphista_jax.sampling import SamplingConfig
from amphista_jax.tokenizer import encode_prompt, load_tokenizer, stop_token_ids
from amphista_jax.train.data import DataError, DataReport, normalize_messages, read_records


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
                       prompt_len: int, temperature: float, limit: int = 0, chunk: int = 64) -> None:
    """UsageError (or the checkpoint's own error) for arguments that cannot work, before anything is loaded."""
    for name, value in (("batch_size", batch_size), ("max_new_tokens", max_new_tokens), ("prompt_len", prompt_len),
                        ("chunk", chunk)):
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
    """Each prompt's padded length: the Generator's length bucket (`generator.bucket`), capped at `prompt_len`."""
    return [min(prompt_len, bucket(n)) for n in lengths]


@dataclasses.dataclass
class Answering:
    """A prompt being answered: its token ids and the answer so far."""

    key: str
    prompt: str
    ids: list[int]
    answer: list[int] = dataclasses.field(default_factory=list)


def answer_in_chunks(todo: list[Answering], run: Callable[[list[list[int]], int], list[list[int]]],
                     batch_size: int, chunk: int, max_new_tokens: int, eos: tuple[int, ...]) -> Iterator[Answering]:
    """Answer `todo` (shortest prompts first) in batches of `batch_size` rows, `chunk` new tokens at a time: after each
    chunk the rows that stopped (a stop token, or `max_new_tokens` reached) are yielded and their slots refilled
    with the next prompts, while the others go on in the next batch from their prompt and answer so far (a new
    prefill). A batch then waits for its longest row for at most `chunk` steps, not `max_new_tokens`.
    `run(contexts, new_tokens)` continues each context greedily by up to `new_tokens` tokens."""
    fresh = iter(sorted(todo, key=lambda a: len(a.ids)))
    going: list[Answering] = []
    while True:
        batch = going + list(itertools.islice(fresh, batch_size - len(going)))
        if not batch:
            return
        going = []
        for row, new in zip(batch, run([a.ids + a.answer for a in batch], chunk), strict=True):
            row.answer = (row.answer + new)[:max_new_tokens]
            stopped = bool(row.answer) and row.answer[-1] in eos
            if stopped or len(row.answer) >= max_new_tokens:
                yield row
            else:
                going.append(row)


def distill(model: str, prompts_file: str, out_file: str, batch_size: int = 64, max_new_tokens: int = 256,
            prompt_len: int = 256, chat: bool | None = None, temperature: float = 0.0, seed: int = 0,
            limit: int = 0, chunk: int = 64, shard: tuple[int, int] = (0, 1)) -> int:
    """Answer every prompt (the first `limit` that fit, with `limit`) not yet in `out_file`, `chunk` new tokens per
    batch pass (`answer_in_chunks`); with `shard` (i, n) only every n-th of them from the i-th, so n processes
    answer disjoint shards into their own files (`merge_answers` joins them). Returns how many were answered in
    this run."""
    check_distill_args(model, prompts_file, out_file, batch_size, max_new_tokens, prompt_len, temperature, limit,
                       chunk)
    out = Path(out_file)
    with file_lock(lock_beside(out), "distill"):  # one run appends to a file at a time
        done, cut = _answered_ids(out)
        prompts, report = read_prompts(prompts_file)
        print(report.summary())
        tok = load_tokenizer(model)
        chat = bool(tok.chat_template) if chat is None else chat
        encoded, too_long = [], 0
        for key, prompt in prompts:
            ids = encode_prompt(tok, prompt, chat=chat)
            if len(ids) > prompt_len:
                too_long += 1
                continue
            encoded.append(Answering(key, prompt, ids))
            if limit and len(encoded) == limit:
                break
        encoded = encoded[shard[0]::shard[1]]
        todo = [a for a in encoded if a.key not in done]
        print(f"{'' if shard[1] == 1 else f'shard {shard[0]}/{shard[1]}: '}"
              f"{len(encoded)} prompts of at most {prompt_len} tokens ({too_long} longer ones skipped"
              f"{'' if not limit else f' before the first {limit}'}); {len(encoded) - len(todo)} already answered "
              f"in {out}; {len(todo)} to go")
        if not todo:
            return 0
        params, config = load_params(model, layout="split")  # decoding's layout: no per-step weight or cache copies
        eos = stop_token_ids(model, tok, config)
        pad = config.pad_token_id or 0
        sampling, passes = SamplingConfig(temperature), itertools.count()
        new_tokens = 0  # answered tokens, for the progress bar's tokens/s (compiles included)

        def run(contexts: list[list[int]], steps: int) -> list[list[int]]:
            nonlocal new_tokens
            length = length_buckets([max(map(len, contexts))], prompt_len + max_new_tokens)[0]
            rows = contexts + [contexts[0]] * (batch_size - len(contexts))  # fixed shape: one compile per bucket
            tokens, lengths = pad_prompts(rows, length=length, pad_id=pad)
            check_fits(lengths, steps, length + steps)
            result = generate(params, tokens, lengths, jax.random.fold_in(jax.random.key(seed), next(passes)),
                              config=config, max_new_tokens=steps, cache_size=length + steps, sampling=sampling,
                              eos_ids=eos, pad_id=pad)
            out_rows, counts = np.asarray(result.tokens), np.asarray(result.num_tokens)
            new_tokens += int(counts[: len(contexts)].sum())
            bar.set_postfix(tokens_per_s=f"{new_tokens / (time.perf_counter() - t0):.1f}")
            return [r[:n].tolist() for r, n in zip(out_rows[: len(contexts)], counts[: len(contexts)], strict=True)]

        out.parent.mkdir(parents=True, exist_ok=True)
        if cut is not None:
            print(f"warning: cutting the torn last line of {out} (an interrupted run); that prompt is redone")
            with out.open("r+b") as f:
                f.truncate(cut)
        t0 = time.perf_counter()
        with out.open("a") as f, tqdm(total=len(todo), desc="distill", unit="prompt") as bar:
            for a in answer_in_chunks(todo, run, batch_size, min(chunk, max_new_tokens), max_new_tokens, eos):
                f.write(json.dumps({"id": a.key, "conversations": [
                    {"from": "human", "value": a.prompt},
                    {"from": "gpt", "value": tok.decode(a.answer, skip_special_tokens=True)}],
                    "answer_ids": a.answer, "stop": "eos" if a.answer[-1] in eos else "length"}) + "\n")
                f.flush()
                bar.update(1)
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
