"""`distill` answers prompts with the target's own greedy tokens: in length-bucketed batches where each row's answer is
the one its prompt gets alone in a program of that shape (ragged prompts, other rows stopping early), shortest first,
skipping (never cutting) prompts too long, and resuming after a kill without losing or repeating an answer.

Alone means the prompt repeated over the batch, not batch 1: XLA:CPU sums a product of one row in another order than
one of several, so at a near-tie between two logits a batch-1 program can pick the other token (the embedded model's
"import os" flips at its 9th token). Such flips are float rounding, not one row seeing another."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from amphista_jax.assets import default_model_dir
from amphista_jax.engine.decode import generate, pad_prompts
from amphista_jax.models.hf import load_params
from amphista_jax.models.tokenizer import encode_prompt, load_tokenizer, stop_token_ids
from amphista_jax.train.distill import Answering, InFlight, answer_in_flight, distill, length_buckets

MODEL = str(default_model_dir())
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n    def __init__(self):", "x = [",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "# " + "word " * 40]


def _write_prompts(path) -> None:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))


def _answers(path) -> dict[str, list[int]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), "an answer was written twice"
    return {r["id"]: r["answer_ids"] for r in records}


class FakeRows:
    """`Rows` on the host: a prompt `[n]` stops after n tokens (all 1s, then the stop id 9); `log` records each
    refill's slots and each run's `until_done`."""

    def __init__(self, batch):
        self.batch, self.log = batch, []
        self.left, self.answer = [0] * batch, [None] * batch  # tokens still to come per row (0: done)

    def refill(self, slots, contexts):
        self.log.append(("refill", slots))
        for i, c in zip(slots, contexts, strict=True):
            self.left[i], self.answer[i] = c[0], []

    def run(self, until_done):
        self.log.append(("run", until_done))
        while sum(n == 0 for n in self.left) < until_done:
            for i, n in enumerate(self.left):
                if n:
                    self.left[i] -= 1
                    self.answer[i].append(9 if n == 1 else 1)
        return [list(a) if n == 0 and a is not None else None for a, n in zip(self.answer, self.left, strict=True)]


def test_in_flight_batching_refills_stopped_rows_while_the_others_go_on():
    """Shortest prompts first; the decode stops once `min_refill` rows are done, the next prompts take those rows
    and the others go on; once the queue is empty the last rows run out. Static batching waits for the last row."""
    assert length_buckets([1, 16, 17, 40, 300], 256) == [16, 16, 32, 64, 256]
    # (key, tokens until its stop); the prompt's length sets the order: e, a, b, c, d
    todo = [Answering(k, k, [n] * (1 + "eabcd".index(k))) for k, n in (("d", 9), ("a", 2), ("c", 5), ("b", 3),
                                                                         ("e", 1))]
    rows = FakeRows(2)
    done = list(answer_in_flight(todo, rows, refill=True, min_refill=1))
    assert [(a.key, len(a.answer)) for a in done] == [("e", 1), ("a", 2), ("b", 3), ("d", 9), ("c", 5)]
    assert all(a.answer[-1] == 9 for a in done)
    # e stops; b takes its row beside a; a stops, c takes its row; b stops, d takes its row; the queue is empty,
    # so c and d run out together
    assert rows.log == [("refill", [0, 1]), ("run", 1), ("refill", [0]), ("run", 1), ("refill", [1]), ("run", 1),
                        ("refill", [0]), ("run", 2)]
    static = FakeRows(2)
    assert [a.key for a in answer_in_flight(todo, static, refill=False, min_refill=1)] == ["e", "a", "b", "c", "d"]
    assert static.log == [("refill", [0, 1]), ("run", 2), ("refill", [0, 1]), ("run", 2), ("refill", [0]),
                          ("run", 2)]


def test_batched_answers_equal_each_prompt_answered_alone(tmp_path, monkeypatch):
    """Batch 2 over ragged prompts in two length buckets, with a stop token ending some rows early (here the first
    line break also stops, so rows stop at different steps) and stopped rows refilled while the other goes on: each
    row equals its prompt answered alone by `generate` at its bucket's shape; the 40-word prompt is over
    --prompt-len and is skipped, not cut."""
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    _write_prompts(prompts)
    tok = load_tokenizer(MODEL)
    eos = (*stop_token_ids(MODEL, tok, load_params(MODEL)[1]), *tok.encode("\n", add_special_tokens=False))
    monkeypatch.setattr("amphista_jax.train.distill.stop_token_ids", lambda *_: eos)
    going_on = []  # per refill: how many rows were still decoding beside the refilled ones
    refill = InFlight.refill

    def spy(rows, slots, contexts):
        going_on.append(int((~np.asarray(rows.state.done)).sum()))
        refill(rows, slots, contexts)

    monkeypatch.setattr(InFlight, "refill", spy)
    assert distill(MODEL, str(prompts), str(out), batch_size=2, max_new_tokens=12, prompt_len=32,
                   chat=False) == 5
    assert max(going_on) == 1  # a row was refilled while the other went on with its cache
    answers = _answers(out)
    assert set(answers) == {f"p{i}" for i in range(5)}
    params, config = load_params(MODEL)
    stopped_early = 0
    for i, prompt in enumerate(PROMPTS[:5]):
        ids = encode_prompt(tok, prompt, chat=False)
        tokens, lengths = pad_prompts([ids] * 2, length=length_buckets([len(ids)], 32)[0])
        alone = generate(params, tokens, lengths, jax.random.key(0), config=config, max_new_tokens=12,
                         cache_size=tokens.shape[1] + 12, eos_ids=eos, pad_id=config.pad_token_id or 0)
        stopped_early += int(alone.num_tokens[0]) < 12
        assert answers[f"p{i}"] == np.asarray(alone.tokens)[0, : int(alone.num_tokens[0])].tolist(), prompt
    assert 0 < stopped_early < 5  # some rows stopped while others went on


def test_a_killed_run_resumes_without_losing_or_repeating_an_answer(tmp_path):
    """A run stopped after two answers (`limit`) and a torn line of a third (a kill mid-write), then rerun whole,
    ends with each prompt answered once, as one uninterrupted run answers it."""
    prompts, out, whole = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl", tmp_path / "whole.jsonl"
    _write_prompts(prompts)
    kw = dict(batch_size=2, max_new_tokens=6, prompt_len=64, chat=False)
    assert distill(MODEL, str(prompts), str(out), limit=2, **kw) == 2
    with out.open("a") as f:
        f.write('{"id": "p3", "conversa')
    assert distill(MODEL, str(prompts), str(out), **kw) == 3  # the 40-word prompt is over --prompt-len
    assert distill(MODEL, str(prompts), str(whole), **kw) == 5
    assert _answers(out) == _answers(whole)


def test_a_repeated_prompt_is_answered_once(tmp_path, capsys):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n"
                               for i, p in enumerate(["x = [", "def f():", "x = ["])))
    assert distill(MODEL, str(prompts), str(out), batch_size=2, max_new_tokens=4, prompt_len=32, chat=False) == 2
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == ["p0", "p1"]
    assert "2 distinct prompts of at most 32 tokens" in capsys.readouterr().out


def test_in_flight_answers_equal_static_batches(tmp_path, capsys):
    """Rows refilled while the others go on (their caches kept) answer what static batches answer, and the run
    reports its idle row-steps."""
    prompts, flight, static = tmp_path / "prompts.jsonl", tmp_path / "flight.jsonl", tmp_path / "static.jsonl"
    _write_prompts(prompts)
    kw = dict(batch_size=2, max_new_tokens=12, prompt_len=32, chat=False)
    assert distill(MODEL, str(prompts), str(flight), refill=True, **kw) == 5
    assert distill(MODEL, str(prompts), str(static), refill=False, **kw) == 5
    assert _answers(flight) == _answers(static)
    assert "of the decode row-steps idle" in capsys.readouterr().out


def test_two_shards_merge_to_one_runs_answers(tmp_path, capsys):
    """Two processes answer disjoint shards (`--shard 0/2`, `1/2`) into their own files; `--merge` joins them into
    what one process answers. Merging an answer twice, onto an existing file, or a bad shard is one line."""
    from amphista_jax.cli import main

    prompts = tmp_path / "prompts.jsonl"
    _write_prompts(prompts)
    common = ["distill", "--model", MODEL, "--prompts", str(prompts), "--no-chat", "--batch-size", "2",
              "--max-new-tokens", "6", "--prompt-len", "64"]
    for i in (0, 1):
        assert main([*common, "--shard", f"{i}/2", "--out", str(tmp_path / f"shard{i}.jsonl")]) == 0
    assert main([*common, "--out", str(tmp_path / "one.jsonl")]) == 0
    shards = [str(tmp_path / f"shard{i}.jsonl") for i in (0, 1)]
    assert not set(_answers(tmp_path / "shard0.jsonl")) & set(_answers(tmp_path / "shard1.jsonl"))
    assert main(["distill", "--merge", *shards, "--out", str(tmp_path / "merged.jsonl")]) == 0
    assert _answers(tmp_path / "merged.jsonl") == _answers(tmp_path / "one.jsonl")
    capsys.readouterr()
    for args, needle in (([shards[0], shards[0]], "is in both"), (shards, "exists: merge writes a new file")):
        out = tmp_path / ("merged.jsonl" if "exists" in needle else "again.jsonl")
        assert main(["distill", "--merge", *args, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err
    with pytest.raises(SystemExit):
        main([*common, "--shard", "2/2", "--out", str(tmp_path / "x.jsonl")])
    assert "expected I/N with 0 <= I < N" in capsys.readouterr().err


@pytest.mark.slow
def test_two_jax_distributed_processes_answer_their_own_shards(tmp_path):
    """Two real `jax.distributed` processes (`launch_local -n 2`) each answer their own shard into
    `<stem>.process<i>.jsonl`; `--merge` joins them into what one process answers. The default test that covers the
    shard mechanism itself: `test_two_shards_merge_to_one_runs_answers`."""
    import subprocess
    import sys

    from amphista_jax.cli import main
    from tests.helpers import ROOT, subprocess_env

    prompts = tmp_path / "prompts.jsonl"
    _write_prompts(prompts)
    common = ["distill", "--model", MODEL, "--prompts", str(prompts), "--no-chat", "--batch-size", "2",
              "--max-new-tokens", "6", "--prompt-len", "64"]
    launch = [sys.executable, "-m", "amphista_jax.evals.launch_local", "-n", "2", "--", sys.executable, "-m",
              "amphista_jax.cli"]
    result = subprocess.run(launch + common + ["--out", str(tmp_path / "run.jsonl")], cwd=ROOT,
                            env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    shards = [tmp_path / f"run.process{i}.jsonl" for i in (0, 1)]
    assert all(s.is_file() for s in shards) and not (tmp_path / "run.jsonl").exists()
    assert not set(_answers(shards[0])) & set(_answers(shards[1]))
    assert main([*common, "--out", str(tmp_path / "one.jsonl")]) == 0
    assert main(["distill", "--merge", *map(str, shards), "--out", str(tmp_path / "merged.jsonl")]) == 0
    assert _answers(tmp_path / "merged.jsonl") == _answers(tmp_path / "one.jsonl")
