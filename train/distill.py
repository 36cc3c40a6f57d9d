"""Self-distillation data: the target answers each prompt with our own jitted batch generation.

    amphista-jax distill --model DIR --prompts FILE --out FILE [--batch-size 8] [--max-new-tokens 256]

Prompts come from JSONL (`prompt`, `turns` (first turn) or a ShareGPT/messages record (first user turn));
each record's `id` (or `question_id`, else its line number) identifies it. Answers are appended to `--out`
as ShareGPT JSONL, one line per finished prompt, so a rerun skips what is already answered.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from amphista_jax.decode import check_fits, generate, pad_prompts
from amphista_jax.models.hf import load_params
from amphista_jax.sampling import SamplingConfig
from amphista_jax.tokenizer import encode_prompt, load_tokenizer, stop_token_ids
from train.data import DataError, DataReport, normalize_messages, read_records


def read_prompts(path: str | Path) -> tuple[list[tuple[str, str]], DataReport]:
    """(id, prompt text) pairs; unusable records are skipped and counted."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"prompts file {path} does not exist")
    report = DataReport(str(path))
    prompts = []
    for line, record in read_records(path, report):
        text = _prompt_text(record)
        if text is None:
            report.skip(line, "no prompt (expected `prompt`, `turns` or a conversation with a user turn)")
            continue
        key = record.get("id", record.get("question_id", line)) if isinstance(record, dict) else line
        prompts.append((str(key), text))
        report.kept += 1
    if not prompts:
        raise DataError(f"{path} yields no prompt:\n{report.summary()}")
    return prompts, report


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


def _answered_ids(out: Path) -> set[str]:
    """Ids already answered in `out`. A torn last line (a run killed mid-write) is dropped from the file."""
    if not out.is_file():
        return set()
    lines = out.read_text().splitlines()
    ids = set()
    for i, line in enumerate(lines):
        try:
            ids.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError):
            if i != len(lines) - 1:
                raise DataError(f"{out}:{i + 1} is not a distilled record; fix or remove that line") from None
            print(f"warning: dropping the incomplete last line of {out} (an interrupted run); it is redone")
            out.write_text("".join(line + "\n" for line in lines[:-1]))
    return ids


def distill(model: str, prompts_file: str, out_file: str, batch_size: int = 8, max_new_tokens: int = 256,
            prompt_len: int = 256, chat: bool | None = None, temperature: float = 0.0, seed: int = 0) -> int:
    """Answer every prompt not yet in `out_file`; returns how many were answered in this run."""
    prompts, report = read_prompts(prompts_file)
    print(report.summary())
    out = Path(out_file)
    done = _answered_ids(out)
    todo = [(k, p) for k, p in prompts if k not in done]
    print(f"{len(done)} prompts already answered in {out}; {len(todo)} to go")
    if not todo:
        return 0
    params, config = load_params(model)
    tok = load_tokenizer(model)
    chat = bool(tok.chat_template) if chat is None else chat
    eos = stop_token_ids(model, tok, config)
    pad = config.pad_token_id or 0
    kw = dict(config=config, max_new_tokens=max_new_tokens, cache_size=prompt_len + max_new_tokens,
              sampling=SamplingConfig(temperature), eos_ids=eos, pad_id=pad)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f, tqdm(total=len(todo), desc="distill", unit="prompt") as bar:
        for i in range(0, len(todo), batch_size):
            chunk = todo[i: i + batch_size]
            ids = [encode_prompt(tok, p, chat=chat)[-prompt_len:] for _, p in chunk]
            ids += [ids[0]] * (batch_size - len(ids))  # fixed batch shape: one compile
            tokens, lengths = pad_prompts(ids, length=prompt_len, pad_id=pad)
            check_fits(lengths, max_new_tokens, prompt_len + max_new_tokens)
            result = generate(params, tokens, lengths, jax.random.fold_in(jax.random.key(seed), i), **kw)
            rows, counts = np.asarray(result.tokens), np.asarray(result.num_tokens)
            for (key, prompt), row, n in zip(chunk, rows, counts, strict=False):
                answer = tok.decode(row[:n], skip_special_tokens=True)
                f.write(json.dumps({"id": key, "conversations": [
                    {"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]}) + "\n")
            f.flush()
            bar.update(len(chunk))
    return len(todo)
