"""Trees chosen on the machine that decodes: shipped acceptance statistics, step costs measured and cached here,
`auto`'s choice from both (margin included), and decoding that stays AR's whichever tree is chosen."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from amphista_jax.assets import shipped_heads_dir
from amphista_jax.choice import calibration
from amphista_jax.choice.acceptance import ACCEPTANCE_FILE, Acceptance, AcceptanceError, Candidate
from amphista_jax.choice.calibration import MIN_MARGIN, StepCosts, calibrate, choose, worth_timing
from amphista_jax.infra.machine import this_machine
from amphista_jax.trees.tree import TreeSpec, chain

PROMPTS = ["def add(a, b):", "import os\n"]
STATS = Acceptance("medusa", "synthetic", (
    Candidate("grown-1", chain(1), 1.5),
    Candidate("grown-3", TreeSpec(((0,), (1,), (0, 0))), 1.9),
    Candidate("grown-7", TreeSpec(((0,), (1,), (2,), (0, 0), (1, 0), (0, 1), (0, 0, 0))), 2.2)))


def _costs(batch: int, ar: float, steps: tuple, noise: float = 0.0) -> StepCosts:
    return StepCosts(batch, ar, steps, tuple(None if s is None else noise for s in steps), 0.0,
                     tuple(None if s is None else 3 for s in steps))


def _fake_measure(costs_at, measured: list | None = None):
    """A stand-in for the timing: `costs_at(batch)` for the candidates; the batch sizes measured recorded."""
    def measure(gen, stats, clock, progress=None):
        batch = int(clock.tokens.shape[0])
        if measured is not None:
            measured.append(batch)
        costs = costs_at(batch)
        n = len(stats.candidates)
        return dataclasses.replace(costs, step_ms=costs.step_ms[:n], noise=costs.noise[:n], pairs=costs.pairs[:n])

    return measure


def _patch(monkeypatch, costs_at, measured=None):
    monkeypatch.setattr(calibration, "measure", _fake_measure(costs_at, measured))


@pytest.mark.parametrize(("batch", "ar", "steps", "noise", "picked"), [
    (1, 10.0, (11.0, 13.0, 16.0), 0.01, 1),  # 1.36x, 1.46x, 1.38x: the middle tree
    (2, 10.0, (11.0, 12.0, 12.5), 0.01, 2),  # 1.36x, 1.58x, 1.76x: the largest
    (8, 12.0, (14.0, 19.0, 30.0), 0.01, 0),  # 1.29x, 1.20x, 0.88x: one node
    (16, 20.0, (27.0, 40.0, None), 0.01, 0),  # 1.11x (the largest not timed): one node
    (32, 30.0, (42.0, 60.0, 100.0), 0.02, 0),  # 1.07x > 1 + the 3% floor
    (64, 30.0, (42.0, 60.0, 100.0), 0.10, None),  # 1.07x but the calibration's noise is 10%: no speculation
    (64, 40.0, (62.0, 90.0, 150.0), 0.0, None),  # 0.97x: AR is faster
])
def test_choose_picks_the_fastest_tree_above_the_noise_margin(batch, ar, steps, noise, picked):
    d = choose(STATS, _costs(batch, ar, steps, noise))
    assert d.index == picked and d.batch == batch and d.margin == max(noise, MIN_MARGIN)
    assert d.best == max((i for i, s in enumerate(steps) if s is not None),
                         key=lambda i: STATS.candidates[i].tau * ar / steps[i])
    said = d.describe(STATS)
    assert ("no speculation" in said) == (picked is None) and STATS.candidates[d.best].name in said


def test_timing_stops_when_no_larger_tree_can_win():
    """Best tau 2.2: after a step of 2.5 AR steps nothing larger can reach 1 + margin; after 1.5 it still can."""
    assert worth_timing(STATS, 1.5, best=1.2, margin=0.03)
    assert not worth_timing(STATS, 2.5, best=0.0, margin=0.03)
    assert not worth_timing(STATS, 1.5, best=1.5, margin=0.03)  # 2.2 / 1.5 = 1.47 < the best so far


def test_each_candidate_is_decided_against_its_own_noise():
    """A noisy losing candidate does not raise the margin a quiet winner must beat (grown-3's 1.56x within its 2%,
    though grown-7's estimate is 20% noisy); a candidate inside its own noise is refused, and a quieter one chosen
    over it, or none."""
    costs = StepCosts(1, 10.0, (11.0, 12.2, 25.0), (0.01, 0.02, 0.20), 0.0, (3, 3, 12))
    d = choose(STATS, costs)
    assert d.index == 1 and d.margin == pytest.approx(0.03) and d.margins[2] == pytest.approx(0.20)
    noisy = dataclasses.replace(costs, step_ms=(14.0, 17.0, 25.0), noise=(0.01, 0.12, 0.20))
    d = choose(STATS, noisy)  # grown-1 1.07x within 3%; grown-3 1.12x but 12% noisy
    assert d.index == 0 and d.best == 1
    d = choose(STATS, dataclasses.replace(noisy, step_ms=(16.0, 17.0, 25.0)))  # grown-1 0.94x
    assert d.index is None and d.best == 1 and "its 12% noise margin" in d.describe(STATS)


def test_a_cache_of_an_earlier_layout_is_measured_again(tmp_path):
    """Entries of AR timed alone, or of whole decodes timed one program after another (one noise for all), are left
    out; today's are read."""
    path = tmp_path / "cache.json"
    costs = json.loads(json.dumps(_costs(1, 10.0, (11.0,)).to_json()))
    sequential = {"batch": 1, "ar_ms": 10.0, "step_ms": [11.0], "noise": 0.05, "seconds": 40.0}
    path.write_text(json.dumps({"entries": {"a": {"label": "AR", "ar": {"prefill_ms": 1, "step_ms": 9, "spread": 0}},
                                            "s": {"label": "medusa", "costs": sequential},
                                            "b": {"label": "medusa", "costs": costs}}}))
    assert calibration.read_cache(path) == {"b": {"label": "medusa", "costs": costs}}


def test_acceptance_file_round_trips_and_a_damaged_one_is_one_line(tmp_path):
    path = STATS.write(tmp_path / ACCEPTANCE_FILE)
    assert Acceptance.read(path) == STATS
    path.write_text('{"method": "medusa", "candidates": [')
    with pytest.raises(AcceptanceError, match="calibrate --acceptance") as e:
        Acceptance.read(path)
    assert "\n" not in str(e.value)


@pytest.fixture
def medusa_heads(tmp_path):
    """The shipped Medusa heads of the embedded model with the synthetic acceptance statistics."""
    heads = tmp_path / "medusa"
    shutil.copytree(shipped_heads_dir("medusa"), heads)
    STATS.write(heads / ACCEPTANCE_FILE)
    return heads


def test_costs_are_cached_per_machine_and_version_and_a_damaged_cache_recalibrates(medusa_heads, tmp_path,
                                                                                     monkeypatch, capsys):
    from amphista_jax import Generator

    monkeypatch.setenv("AMPHISTA_HOME", str(tmp_path / "home"))
    measured = []
    costs_at = lambda batch: _costs(batch, 10.0, (11.0, 13.0, 16.0))  # noqa: E731
    _patch(monkeypatch, costs_at, measured)
    gen = Generator.load(heads=medusa_heads)  # `auto`: calibrated at batch 1 on load
    assert measured == [1] and gen.tree == STATS.candidates[1].tree
    assert calibrate(gen, STATS, 1).step_ms == (11.0, 13.0, 16.0) and measured == [1]  # cached
    other_heads = medusa_heads.parent / "other"
    shutil.copytree(medusa_heads, other_heads)
    Acceptance("medusa", "synthetic", STATS.candidates[:2]).write(other_heads / ACCEPTANCE_FILE)
    Generator.load(heads=other_heads)
    assert measured == [1, 1]  # other candidates: timed again
    measured.pop()
    Generator.load(heads=medusa_heads)
    assert measured == [1]  # a new process on this machine reuses it
    gen.for_batch(4)
    assert measured == [1, 4]  # another batch size is calibrated on first use
    path = calibration.cache_file()
    assert path.parent == tmp_path / "home" / "calibration" and path.stem == this_machine().key()
    assert json.loads(path.read_text())["machine"] == json.loads(json.dumps(dataclasses.asdict(this_machine())))

    other = dataclasses.replace(this_machine(), library=this_machine().library + ".post1")
    assert other.key() != this_machine().key()
    monkeypatch.setattr(calibration, "this_machine", lambda: other)
    calibrate(gen, STATS, 1)
    assert measured == [1, 4, 1]  # another version (or CPU, or accelerator): measured again
    monkeypatch.undo()
    monkeypatch.setenv("AMPHISTA_HOME", str(tmp_path / "home"))
    _patch(monkeypatch, costs_at, measured)
    path.write_text("{not json")
    capsys.readouterr()
    calibrate(gen, STATS, 1)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert measured == [1, 4, 1, 1] and len(err) == 1 and "is damaged" in err[0] and "measuring again" in err[0]
    assert calibrate(gen, STATS, 1) and measured == [1, 4, 1, 1]  # and the rewritten cache is read again


def test_auto_decodes_autoregressively_where_calibration_says_ar_is_faster(medusa_heads, tmp_path, monkeypatch):
    """Costs that make AR faster at batch 1 and a tree faster at batch 2: `auto` decodes AR at batch 1 and says so
    (`Generation.tree`, the notes), drafts at batch 2, and both give AR's tokens; the evaluation resolves the same
    choice once the target has loaded."""
    from amphista_jax import Generator
    from amphista_jax.evals.methods import resolve_method

    monkeypatch.setenv("AMPHISTA_HOME", str(tmp_path / "home"))
    _patch(monkeypatch, lambda batch: _costs(batch, 10.0, (16.0, 21.0, 30.0) if batch == 1 else (11.0, 12.0, 12.5)))
    gen = Generator.load(heads=medusa_heads)
    assert gen.tree is None and any("no speculation at batch 1" in n for n in gen.notes)
    one, two = gen.generate(PROMPTS[0], max_new_tokens=12), gen.generate(PROMPTS, max_new_tokens=12)
    assert one.tree.startswith("auto: no speculation at batch 1 on this machine") and one.tau == [1.0]
    assert two.tree.startswith("auto: grown-7 (7 draft nodes, tau 2.20) at batch 2, predicted 1.76x")
    ar = gen.autoregressive().generate(PROMPTS, max_new_tokens=12)
    assert one.token_ids[0] == two.token_ids[0] == ar.token_ids[0] and two.token_ids == ar.token_ids
    assert "".join(gen.stream(PROMPTS[0], max_new_tokens=12)) == one.texts[0]
    method = resolve_method(str(medusa_heads), "auto", batch=2)
    assert method.choice is not None and method.tree is None and method.tree_name == "auto"
    attached = method.generator(gen.autoregressive())
    assert attached.for_batch(2).tree == method.chosen(attached, 2).tree == STATS.candidates[2].tree
    assert method.chosen(attached, 2).tree_name == "auto: grown-7" and method.chosen(attached, 2).choice is None
    assert attached.for_batch(1).drafter is None and method.chosen(attached, 1).drafter is None
    assert method.chosen(attached, 1).tree_name == "auto: none"


def test_real_calibration_times_steps_and_decodes_as_ar(medusa_heads, tmp_path, monkeypatch):
    """An unpatched calibration on this machine: AR and at least the smallest candidate are timed (positive costs,
    larger ones timed or skipped as unable to win), and whichever tree it picks, greedy output equals AR's."""
    from amphista_jax import Generator

    monkeypatch.setenv("AMPHISTA_HOME", str(tmp_path / "home"))
    gen = Generator.load(heads=medusa_heads)
    costs = calibrate(gen, STATS, 1)
    assert costs.ar_ms > 0 and costs.step_ms[0] > 0 and costs.seconds > 0 and costs.batch == 1
    for step, noise, pairs in zip(costs.step_ms, costs.noise, costs.pairs, strict=True):
        assert (step is None) == (noise is None) == (pairs is None)  # a candidate timed has its noise and pairs
        assert step is None or (step > 0 and noise >= 0 and calibration.MIN_PAIRS <= pairs <= calibration.MAX_PAIRS)
    assert gen.policy.decision(1) == choose(STATS, costs)
    for batch in (1, 2):
        out = gen.generate(PROMPTS[:batch], max_new_tokens=16)
        assert out.tree.startswith("auto: ")
        assert out.token_ids == gen.autoregressive().generate(PROMPTS[:batch], max_new_tokens=16).token_ids


def test_calibrate_command_shows_the_table_and_refuses_heads_without_statistics(medusa_heads, tmp_path, monkeypatch,
                                                                                 capsys):
    from amphista_jax.cli import main

    monkeypatch.setenv("AMPHISTA_HOME", str(tmp_path / "home"))
    _patch(monkeypatch, lambda batch: _costs(batch, 10.0, (11.0, 13.0, None)))
    assert main(["calibrate", "--model", "tiny", "--heads", str(medusa_heads), "--batch-sizes", "1,4"]) == 0
    out = capsys.readouterr().out
    assert "| grown-3 | 3 | 1.90 | 13.0, 1.46x *, noise 0.0% in 3 pairs | 13.0, 1.46x *, noise 0.0% in 3 pairs |" \
        in out and "not timed" in out
    assert f"machine: {this_machine().describe()}" in out
    (medusa_heads / ACCEPTANCE_FILE).unlink()
    assert main(["calibrate", "--model", "tiny", "--heads", str(medusa_heads)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no acceptance statistics" in err[0] and "calibrate --acceptance" in err[0]
    taken = tmp_path / "taken.json"
    taken.write_text("mine")
    assert main(["calibrate", "--model", "tiny", "--heads", "medusa", "--acceptance", "--out", str(taken)]) != 0
    assert "exists: pass --replace" in capsys.readouterr().err and taken.read_text() == "mine"  # not overwritten


def test_an_eval_records_the_tree_auto_chose_and_a_resume_that_chooses_another_is_refused(medusa_heads, tmp_path,
                                                                                          monkeypatch, capsys):
    from amphista_jax.cli import main
    from tests.helpers import ROOT

    monkeypatch.setenv("AMPHISTA_HOME", str(tmp_path / "home"))
    _patch(monkeypatch, lambda batch: _costs(batch, 10.0, (11.0, 13.0, 16.0)))  # grown-3 wins
    out = tmp_path / "out"
    argv = ["eval", "--config", str(ROOT / "configs/eval/humaneval-code.yaml"), "--methods", "ar",
            f"m={medusa_heads}", "--set", "dataset.limit=1", "--set", "max_new_tokens=4", "--set", f"out_dir={out}",
            "--set", "heldout_batches=0"]
    assert main(argv) == 0
    run = json.loads((out / "run.json").read_text())["methods"]["m"]
    assert run["tree"] == "auto: grown-3" and run["tree_choices"] == [list(p) for p in STATS.candidates[1].tree.choices]
    assert "| m | auto: grown-3 |" in (out / "report.md").read_text()
    calibration.cache_file().unlink()  # another machine's costs: AR wins there
    _patch(monkeypatch, lambda batch: _costs(batch, 10.0, (16.0, 21.0, 30.0)))
    capsys.readouterr()
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "holds results made with other settings" in err and "auto: grown-3" in err and "auto: none" in err


def test_acceptance_statistics_are_measured_on_held_out_prompts():
    """`measure_acceptance` (what `calibrate --acceptance` writes): candidates grown from the rates, ascending, the
    paper's tree among them, each tau measured by decoding the calibration prompts (HumanEval from task 100 for the
    embedded code model); `expect` is told the number of prompt decodes in all, which `progress` then counts."""
    from amphista_jax import Generator
    from amphista_jax.tree_search import calibration_prompts, measure_acceptance
    from amphista_jax.trees.names import get_tree

    gen = Generator.load(heads="medusa", tree="chain-1")
    prompts, where = calibration_prompts(gen, 2)
    assert len(prompts) == 2 and where == "HumanEval prompts from task 100"
    done, expected = [], []
    stats = measure_acceptance(gen, prompts, 8, where, ranks=3, progress=done.append, expect=expected.append)
    assert expected == [sum(done)] == [len(prompts) * (1 + len(stats.candidates))]  # the rates' pass, then each tree
    nodes = [c.nodes for c in stats.candidates]
    assert nodes == sorted(nodes) and stats.candidates[-1].tree == get_tree(gen.drafter.paper_tree)
    assert all(c.name.startswith("grown-") for c in stats.candidates[:-1]) and len(stats.rates) == 4
    assert all(1.0 <= c.tau <= 1 + c.tree.depth for c in stats.candidates) and stats.method == "medusa"


def _stand_in_pair(tmp_path, monkeypatch):
    """(target, draft): the embedded model and its shipped draft sibling, marked as complete fetches of the
    Qwen2.5-Coder entries (as test_demo does), with what is shipped for the pair read from `tmp_path/assets`."""
    from amphista_jax.assets import default_model_dir, draft_model_dir
    from amphista_jax.models.fetch import MARKER, REGISTRY, _marker

    target, draft = tmp_path / "target", tmp_path / "draft"
    for name, source, where in (("qwen2.5-coder-1.5b", default_model_dir(), target),
                                ("qwen2.5-coder-0.5b", draft_model_dir(), draft)):
        shutil.copytree(source, where)
        (where / MARKER).write_text(json.dumps(_marker(REGISTRY[name])))
    (draft / ACCEPTANCE_FILE).unlink()  # a fetch holds no statistics: the pair's are shipped
    (tmp_path / "assets" / "qwen2.5-coder-1.5b-heads" / "draft_model").mkdir(parents=True)
    monkeypatch.setattr("amphista_jax.assets.shipped_heads_root", lambda name: tmp_path / "assets" / f"{name}-heads")
    return target, draft


def test_a_fetched_pairs_shipped_statistics_let_auto_turn_drafting_off(tmp_path, monkeypatch):
    """The acceptance statistics shipped for a fetched target's paired draft model (`assets/<target>-heads/
    draft_model`) reach `auto`, for that pair only; where they say drafting loses on this machine (every candidate's
    tau near 1), `auto` decodes autoregressively, with AR's tokens, and the evaluation's `@auto` chooses the same.
    Stand-ins: the embedded model and its shipped
    draft sibling, marked as complete fetches of the Qwen2.5-Coder entries (as test_demo does)."""
    from amphista_jax import Generator
    from amphista_jax.assets import default_model_dir, draft_model_dir
    from amphista_jax.evals.methods import resolve_method
    from amphista_jax.facade.drafter_source import read_source

    monkeypatch.setenv("AMPHISTA_HOME", str(tmp_path / "home"))  # step costs measured and cached afresh
    target, draft = _stand_in_pair(tmp_path, monkeypatch)
    stats = tmp_path / "assets" / "qwen2.5-coder-1.5b-heads" / "draft_model" / ACCEPTANCE_FILE
    Acceptance("draft_model", "synthetic", (Candidate("chain-1", chain(1), 1.01),
                                            Candidate("chain-4", chain(4), 1.02))).write(stats)
    assert read_source(draft, target, None).acceptance == stats
    own = read_source(draft_model_dir(), target, None).acceptance  # not the pair's fetch: its own statistics
    assert own == draft_model_dir() / ACCEPTANCE_FILE
    assert read_source(draft, default_model_dir(), None).acceptance is None  # not the pair's target
    gen = Generator.load(target, draft_model=draft, tree="auto")
    assert gen.tree is None and gen.policy.chooses_here
    out = gen.generate(PROMPTS, max_new_tokens=12)
    assert out.tau == [1.0, 1.0] and "no speculation" in out.tree
    assert out.token_ids == gen.autoregressive().generate(PROMPTS, max_new_tokens=12).token_ids
    method = resolve_method(f"pair={draft}@auto", "auto", gen.config, str(target))  # the evaluation chooses alike
    assert method.chosen(method.generator(gen.autoregressive()), 1).tree_name == "auto: none"


def test_a_draft_models_settings_file_sets_its_draft_vocabulary_and_decoding_stays_ar(tmp_path, monkeypatch):
    """A draft model's `settings.json` (what `calibrate --draft-vocab` writes) sets its drafter's settings: the one
    beside it wins over the one shipped for its pair, the pair's reaches only that pair, and the user's settings win
    over both. Drafting over the draft vocabulary (its projection's columns cut once per generation) keeps greedy
    decoding AR's token for token; a malformed file is one line naming the fix."""
    from amphista_jax import Generator
    from amphista_jax.assets import default_model_dir
    from amphista_jax.facade.drafter_source import SETTINGS_FILE, read_source, write_model_settings
    from amphista_jax.infra.errors import GeneratorError

    target, draft = _stand_in_pair(tmp_path, monkeypatch)
    shipped = tmp_path / "assets" / "qwen2.5-coder-1.5b-heads" / "draft_model" / SETTINGS_FILE
    evens = list(range(0, 512, 2))
    shipped.write_text(json.dumps({"settings": {"draft_vocab": evens}, "chosen": "test"}))
    assert read_source(draft, target, None).drafter.draft_vocab == tuple(evens)
    assert read_source(draft, default_model_dir(), None).drafter.draft_vocab == ()  # not the pair's target
    assert read_source(draft, target, None, {"draft_vocab": [1, 2]}).drafter.draft_vocab == (1, 2)
    write_model_settings(draft / SETTINGS_FILE, {"draft_vocab": list(range(300))}, "the first 300 ids")
    assert read_source(draft, target, None).drafter.draft_vocab == tuple(range(300))
    gen = Generator.load(target, draft_model=draft, tree="chain-4")
    out = gen.generate(PROMPTS, max_new_tokens=16)
    assert out.token_ids == gen.autoregressive().generate(PROMPTS, max_new_tokens=16).token_ids
    assert max(out.tau) > 1.0  # it drafted, and some drafts were accepted
    (draft / SETTINGS_FILE).write_text(json.dumps({"settings": {"draft_vocab": [151645]}}))  # another model's
    with pytest.raises(GeneratorError, match="outside the target's 4096 tokens.*chosen for another model"):
        read_source(draft, target, None)
    (draft / SETTINGS_FILE).write_text(json.dumps({"draft_vocab": [1, 2]}))  # not under `settings`
    with pytest.raises(GeneratorError, match="not a draft model's settings file.*--draft-vocab N --replace"):
        read_source(draft, target, None)


def test_a_draft_vocabulary_is_the_most_frequent_answer_tokens(tmp_path):
    """`answer_vocabulary`: the n most frequent tokens of the first conversations' answers (assistant turns through
    the chat template; prompts and later conversations not counted), with the share of answer tokens it covers."""
    from amphista_jax.drafters.draft_vocab import most_frequent, token_counts
    from amphista_jax.train.corpus import train_tokenizer
    from amphista_jax.train.data import render_with_mask
    from amphista_jax.train.examples import answer_vocabulary

    tok = train_tokenizer(["def f(x):\n    return x + 1\n", "print('hello world')\n"] * 50, vocab_size=300)

    def chat(question: str, answer: str) -> dict:
        return {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}

    records = [chat("hello world", "def f(x):\n    return x + 1"), chat("print", "return x + 1"),
               chat("later", "print('hello world')")]
    data = tmp_path / "conversations.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records))
    counted = [render_with_mask(tok, [{"role": "user", "content": r["conversations"][0]["value"]},
                                      {"role": "assistant", "content": r["conversations"][1]["value"]}], 64)
               for r in records[:2]]
    counts = token_counts(np.concatenate([t for t, _ in counted]), np.concatenate([m for _, m in counted]), len(tok))
    vocab, covered = answer_vocabulary(data, tok, 3, conversations=2)
    assert vocab == most_frequent(counts, 3) and len(vocab) == 3
    assert covered == pytest.approx(counts[list(vocab)].sum() / counts.sum()) and 0 < covered < 1
    assert answer_vocabulary(data, tok, 10_000, conversations=2)[1] == 1.0  # every answer token kept


def test_choosing_a_draft_vocabulary_is_refused_in_one_line_before_any_counting(tmp_path, capsys):
    """`calibrate --draft-vocab`: heads (they choose theirs when they train), a count below 1, and an existing file
    without --replace (here one that is no settings file) are each one line naming the fix; nothing is
    overwritten."""
    from amphista_jax.assets import draft_model_dir
    from amphista_jax.cli import main
    from amphista_jax.facade.drafter_source import SETTINGS_FILE

    draft = tmp_path / "draft"
    shutil.copytree(draft_model_dir(), draft)
    (draft / SETTINGS_FILE).write_text("kept")
    for argv, says in ((["--heads", "medusa", "--draft-vocab", "8"], "is not a draft model"),
                       (["--heads", str(draft), "--draft-vocab", "0"], "must be >= 1"),
                       (["--heads", str(draft), "--draft-vocab", "8"], "pass --replace")):
        assert main(["calibrate", "--model", "tiny", *argv]) != 0
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert (draft / SETTINGS_FILE).read_text() == "kept"


def test_calibration_prompts_half_code_half_chat_need_a_chat_target():
    """`calibrate --prompt-set both` (ShareGPT and HumanEval halves) needs a chat target: on the embedded code model
    it is one line; its default stays HumanEval from task 100."""
    from amphista_jax import Generator
    from amphista_jax.infra.errors import UsageError
    from amphista_jax.tree_search import calibration_prompts

    gen = Generator.load()
    assert calibration_prompts(gen, 2, "humaneval")[1] == calibration_prompts(gen, 2)[1]
    for prompt_set in ("both", "sharegpt", "prose"):
        with pytest.raises(UsageError, match="choose one of sharegpt, humaneval, both"):
            calibration_prompts(gen, 2, prompt_set)
