"""The draft-head trainer: sharded step parity, exact resume after SIGTERM, data pipelines, distillation, CLI, and
two real `jax.distributed` processes training like one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax.assets import default_model_dir
from amphista_jax.cli import main
from amphista_jax.drafters import VARIANTS, Medusa
from amphista_jax.drafters.io import load_draft
from amphista_jax.engine.sharding import make_mesh, param_shardings, train_state_shardings
from amphista_jax.infra.errors import BAD_INPUT_EXIT
from amphista_jax.models.config import tiny_llama_config
from amphista_jax.models.hf import load_params
from amphista_jax.models.llama import Transformer, init_params
from amphista_jax.models.target import Target
from amphista_jax.models.tokenizer import encode_prompt, load_tokenizer
from amphista_jax.train.data import DataError, conversation_examples, example_dataset, render_with_mask
from amphista_jax.train.distill import distill
from amphista_jax.train.loop import LoopConfig, Preempted, read_metrics, run_loop
from amphista_jax.train.optim import OptimConfig, make_optimizer
from amphista_jax.train.step import make_steps
from tests.helpers import ROOT, default_cases, subprocess_env, write_code_files

CONFIG = tiny_llama_config(vocab_size=256)


def _setup(seed: int = 0):
    params = init_params(CONFIG, jax.random.key(seed))
    medusa = Medusa(num_heads=2)
    optimizer = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=1), 20, part_lrs={"lm_head": 1e-3})
    tokens = np.asarray(jax.random.randint(jax.random.key(7), (64, 16), 0, 256), np.int32)
    examples = [{"tokens": t, "loss_mask": np.ones_like(t)} for t in tokens]

    def init_state():
        heads = medusa.init(jax.random.key(1), Target(CONFIG, params))
        heads = heads | {"w": jax.random.normal(jax.random.key(2), heads["w"].shape) * 0.1}
        return {"params": heads, "opt_state": optimizer.init(heads), "step": jnp.zeros((), jnp.int32)}

    return params, medusa, optimizer, examples, init_state


MESHES = {"data2-fsdp2-tensor2": dict(data=2, fsdp=2, tensor=2), "fsdp8": dict(fsdp=8)}
# Default: Medusa (with per-part learning rates: a multi-transform optimizer state) on both meshes and the lighter
# drafters on the 3-axis one (their layers are the heavier ones' parts: MLP heads, a draft decoder layer, an LSTM,
# prompt tokens); the rest of the grid, the heaviest drafters among it, is slow (~1-2 minutes each on 2 cores).
HEAVY = {"amphista", "eagle3", "gumiho", "hydra++"}
SHARDED_CASES = [pytest.param(method, mesh, marks=() if method == "medusa" or (
                     mesh == "data2-fsdp2-tensor2" and method not in HEAVY) else (pytest.mark.slow,))
                 for method in VARIANTS for mesh in MESHES if VARIANTS[method].trainable]


def _non_replicated(tree) -> int:
    return sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(tree))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
@pytest.mark.parametrize("method,mesh_name", SHARDED_CASES)
# Every drafter's axes go through the one `init_boxed` + logical-rules path; the other methods run under -m slow.
@default_cases('medusa-fsdp8', 'eagle-data2-fsdp2-tensor2')
def test_sharded_train_step_matches_single_device(method, mesh_name):
    """One train step with the target, the draft params and their Adam state sharded over an emulated mesh ==
    the same step on one device; the draft params and their optimizer state really are split. Default: Medusa's
    per-part learning rates (a multi-transform optimizer state) on one mesh, EAGLE's draft decoder layer on the
    3-axis one; Hydra's MLP heads and the other drafters take the same `init_boxed` + logical-rules path and run
    under -m slow."""
    params = init_params(CONFIG, jax.random.key(0))
    drafter = VARIANTS[method]
    optimizer = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=1), 20,
                               part_lrs={"lm_head": 1e-3} if method == "medusa" else None)

    def state():  # a fresh one per step: the step donates it
        heads = drafter.init(jax.random.key(1), Target(CONFIG, params))
        return {"params": heads, "opt_state": optimizer.init(heads), "step": jnp.zeros((), jnp.int32)}

    tokens = np.asarray(jax.random.randint(jax.random.key(7), (8, 16), 0, 256), np.int32)
    batch = {"tokens": tokens, "loss_mask": np.ones_like(tokens)}
    model = Transformer(CONFIG)
    single_state, single_metrics = make_steps(model, drafter, optimizer)[0](state(), params, batch)

    mesh = make_mesh(**MESHES[mesh_name])
    shardings = param_shardings(CONFIG, mesh)
    sharded_params = jax.device_put(params, shardings)
    state_shardings = train_state_shardings(drafter, Target(CONFIG, sharded_params), optimizer, mesh)
    sharded_step, _ = make_steps(model, drafter, optimizer, mesh, shardings, state_shardings)
    sharded_state, sharded_metrics = sharded_step(jax.device_put(state(), state_shardings), sharded_params, batch)

    np.testing.assert_allclose(float(sharded_metrics["loss"]), float(single_metrics["loss"]), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5),
                 sharded_state["params"], single_state["params"])
    assert all(jax.tree.leaves(jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim), sharded_state,
                                            state_shardings)))
    largest = max(jax.tree.leaves(sharded_state["params"]), key=lambda x: x.size)
    assert not largest.sharding.is_fully_replicated
    moments = _non_replicated(sharded_state["opt_state"])
    assert moments >= 2 * _non_replicated(sharded_state["params"]) > 0  # Adam's mu and nu, like their params


class _KillAfter:
    """A grain iterator that sends this process SIGTERM when batch `n` is drawn."""

    def __init__(self, it, n: int):
        self.it, self.n, self.drawn = it, n, 0

    def __next__(self):
        self.drawn += 1
        if self.drawn == self.n:
            os.kill(os.getpid(), signal.SIGTERM)
        return next(self.it)

    def get_state(self):
        return self.it.get_state()

    def set_state(self, state):
        self.it.set_state(state)


def test_exact_resume_after_sigterm(tmp_path):
    params, medusa, optimizer, examples, init_state = _setup()
    step, _ = make_steps(Transformer(CONFIG), medusa, optimizer)

    def train(run_dir, data):
        return run_loop(run_dir=run_dir, cfg=LoopConfig(steps=6, checkpoint_every=100), init_state=init_state,
                        train_step=lambda s, b: step(s, params, b), data=data, tokens_per_batch=64)

    fresh = lambda: iter(example_dataset(examples, 4, seed=3))  # noqa: E731
    straight, _ = train(tmp_path / "a", fresh())
    with pytest.raises(Preempted) as stopped:
        train(tmp_path / "b", _KillAfter(fresh(), 3))
    assert stopped.value.step == 3 and stopped.value.code == 143
    resumed, extra = train(tmp_path / "b", fresh())
    assert extra["steps"] == 6 and extra["tokens_seen"] == 6 * 64
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 straight["params"], resumed["params"])


def test_nan_loss_stops_naming_the_step(tmp_path):
    params, medusa, optimizer, examples, init_state = _setup()
    step, _ = make_steps(Transformer(CONFIG), medusa, optimizer)

    def poisoned(s, b):
        s, m = step(s, params, b)
        return s, m | {"loss": m["loss"] * jnp.where(s["step"] == 2, jnp.nan, 1.0)}

    with pytest.raises(FloatingPointError, match="at step 2"):
        run_loop(run_dir=tmp_path, cfg=LoopConfig(steps=5, checkpoint_every=100), init_state=init_state,
                 train_step=poisoned, data=iter(example_dataset(examples, 4, 0)), tokens_per_batch=64)


def test_assistant_only_loss_mask_on_a_real_template(smoke_model):
    run_dir, _ = smoke_model
    tok = load_tokenizer(run_dir / "export")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add two numbers"},
                {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
                {"role": "user", "content": "and subtract"}, {"role": "assistant", "content": "a - b"}]
    ids, mask = render_with_mask(tok, messages, max_len=512)
    trained = tok.decode(ids[mask == 1])
    assert trained == "def add(a, b):\n    return a + b\na - b\n"  # both answers and their end-of-turn newline
    assert "add two numbers" not in trained and "# assistant" not in trained
    ids_short, mask_short = render_with_mask(tok, messages, max_len=10)
    assert len(ids_short) == 10


def test_bad_records_are_skipped_and_counted(smoke_model, tmp_path):
    run_dir, _ = smoke_model
    tok = load_tokenizer(run_dir / "export")
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]}
    lines = [json.dumps(good), "{not json", json.dumps({"conversations": []}),
             json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}]}),
             json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}),
             json.dumps({"conversations": [{"from": "human", "value": "only a question"}]}),
             json.dumps({"conversations": [{"from": "gpt", "value": "an answer to nothing"}]}),
             # ShareGPT has answers to nothing first: dropped (as FastChat does), the rest is kept
             json.dumps({"conversations": [{"from": "gpt", "value": "zzz"}, {"from": "human", "value": "hi"},
                                           {"from": "gpt", "value": "hello there"}]})]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    examples, report = conversation_examples(path, tok, max_len=64)
    assert report.kept == 2 and len(examples) == 2
    # the last record without its leading answer is the first one's tokens again: kept once
    assert report.skipped == {"invalid JSON (Expecting property name enclosed in double quotes)": 1,
                              "empty conversation": 1, "unknown role 'wizard'": 1, "no assistant turn": 1,
                              "no turn before the assistant's": 1, "the same tokens as an earlier record": 1}
    assert len(conversation_examples(path, tok, max_len=64, limit=2)[0]) == 2  # data.max_examples
    assert report.problems[0].endswith("data.jsonl:2: invalid JSON (Expecting property name enclosed in double quotes)")
    path.write_text("\n".join(lines[1:4]) + "\n")
    with pytest.raises(DataError, match="yields no usable example"):
        conversation_examples(path, tok, max_len=64)


def test_distill_is_resumable_and_feeds_training(smoke_model, tmp_path):
    run_dir, _ = smoke_model
    model = str(run_dir / "export")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join([json.dumps({"id": "a", "prompt": "def add(a, b):"}),
                                  json.dumps({"question_id": 7, "turns": ["write a loop", "now a class"]}),
                                  "oops"]) + "\n")
    out = tmp_path / "distilled.jsonl"
    assert distill(model, str(prompts), str(out), batch_size=4, max_new_tokens=8, prompt_len=32) == 2
    prompts.write_text(prompts.read_text() + json.dumps(
        {"messages": [{"role": "user", "content": "sort a list"}]}) + "\n")
    assert distill(model, str(prompts), str(out), batch_size=4, max_new_tokens=8, prompt_len=32) == 1
    rows = {(r := json.loads(line))["id"]: r for line in out.read_text().splitlines()}  # answered shortest first
    assert sorted(rows) == ["4", "7", "a"] and len(out.read_text().splitlines()) == 3
    assert rows["7"]["conversations"][0] == {"from": "human", "value": "write a loop"}
    tok = load_tokenizer(model)
    examples, report = conversation_examples(out, tok, max_len=64)
    assert report.kept == 3
    for example, line in zip(examples, out.read_text().splitlines(), strict=True):  # the target's own tokens
        record = json.loads(line)
        prompt = encode_prompt(tok, record["conversations"][0]["value"], chat=True)
        n = len(prompt) + len(record["answer_ids"])
        assert example["tokens"][:n].tolist() == prompt + record["answer_ids"]
        assert example["loss_mask"].tolist() == [0] * len(prompt) + [1] * len(record["answer_ids"]) + [0] * (64 - n)
    bad = {"id": "b", "conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]}
    out.write_text(out.read_text() + json.dumps(bad | {"answer_ids": [len(tok)]}) + "\n"
                   + json.dumps(bad | {"answer_ids": "y"}) + "\n")
    assert conversation_examples(out, tok, max_len=64)[1].skipped == {
        f"answer_ids is not a non-empty list of token ids below {len(tok)}": 2}


def test_train_cli_end_to_end(smoke_model, tmp_path, capsys):
    run_dir, _ = smoke_model
    code = write_code_files(tmp_path / "code")
    out = tmp_path / "run"
    args = ["train", "--config", "configs/medusa/code.yaml", "--set", f"model={run_dir / 'export'}",
            "--set", f"out_dir={out}", "--set", "data.kind=text", "--set", f"data.train={code}",
            "--set", "data.max_len=32", "--set", "data.batch_size=4", "--set", "loop.steps=4",
            "--set", "loop.eval_every=2", "--set", "loop.log_every=1", "--set", "drafter.num_heads=2",
            "--set", "data.cache_target_hidden=true", "--set", f"data.hidden_store={tmp_path / 'hidden'}"]
    assert main(args[:-4] + ["--store-only"]) == BAD_INPUT_EXIT  # no store to fill: one line
    assert "--store-only fills data.hidden_store: set data.cache_target_hidden=true" in capsys.readouterr().err
    assert main(args + ["--store-only"]) == 0  # the store's one command: fills it, trains nothing
    assert len(list((tmp_path / "hidden").glob("hidden-*.npy"))) == 2  # train and held-out; no temporary left
    assert not out.exists()
    assert "2 files" in capsys.readouterr().out
    assert main(args + ["--set", "data.length_groups=1000"]) == BAD_INPUT_EXIT
    err = capsys.readouterr().err
    assert "data.length_groups=1000 batches of 4 (4000 examples) exceed the" in err and len(err.splitlines()) == 1
    assert main(args) == 0
    assert capsys.readouterr().out.count("target hidden states: read from") == 2
    assert [p.name for p in (tmp_path / "hidden").iterdir() if not p.name.endswith(".npy")] == []
    assert main(args[:-2] + ["--set", f"data.hidden_store={tmp_path / 'hidden'}", "--set",
                             f"out_dir={tmp_path / 'run2'}"]) == 0  # another run on the same data and target
    assert capsys.readouterr().out.count("target hidden states: read from") == 2
    again = json.loads((tmp_path / "run2" / "summary.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert again["heldout_after"] == summary["heldout_after"]  # the same hidden states, the same training
    assert summary["steps"] == 4 and set(summary["heldout_after"]) >= {"loss", "head0/top1", "head1/top5"}
    assert (out / "training_curve.png").stat().st_size > 1000
    params, config = load_params(run_dir / "export", dtype="float32")
    method, drafter, heads = load_draft(out / "heads", config, params)
    assert method == "medusa" and drafter == Medusa(num_heads=2)


@pytest.mark.parametrize("mesh", ["data", pytest.param("tensor", marks=pytest.mark.slow)])  # ~1 minute each
def test_two_processes_train_like_one(tmp_path, mesh):
    """Two real `jax.distributed` processes (one CPU device each) train the embedded target's heads two steps as
    one process does, on mesh data=2 (each reads 2 rows of every 4-row batch) or on mesh tensor=2 (one batch shard
    held by both: each reads all 4): the same train and held-out metrics and the same heads, loadable on one
    device. Only process 0 writes the shared files."""
    train = [sys.executable, "-m", "amphista_jax.cli", "train", "--config", str(ROOT / "configs/medusa/code.yaml"),
             "--set", "data.kind=text", "--set", f"data.train={write_code_files(tmp_path / 'code')}",
             "--set", "data.max_len=16", "--set", "data.batch_size=4", "--set", "drafter.num_heads=2",
             "--set", "loop.steps=2", "--set", "loop.log_every=1", "--set", "loop.eval_every=0",
             "--set", "eval_batches=1"]
    launch = [sys.executable, "-m", "amphista_jax.evals.launch_local", "-n", "2", "--"]
    # "two": two processes on the mesh asked for (tensor=2: one shard over both processes, which then both feed all
    # 4 rows)
    runs = {"one": train, "two": launch + train + ["--set", f"mesh.{mesh}=2"]}
    for name, command in runs.items():
        result = subprocess.run(command + ["--set", f"out_dir={tmp_path / name}"], cwd=ROOT, env=subprocess_env(),
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        # the memory plan of the step each process compiles, printed before the first step
        devices = {"one": 1, "two": 2}[name]
        assert f"| train medusa | {devices} |" in result.stdout and "memory plan: no device capacity" in result.stdout

    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 2]  # no row written twice
    for a, b in zip(one, two, strict=True):
        assert set(a) == set(b)
        for key in set(a) - {"tokens_per_s"}:
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, err_msg=f"step {a['step']} {key}")
    summaries = {name: json.loads((tmp_path / name / "summary.json").read_text()) for name in runs}
    assert summaries["two"]["tokens_seen"] == summaries["one"]["tokens_seen"] == 2 * 4 * 16
    for key in ("heldout_before", "heldout_after"):
        assert summaries["two"][key].keys() == summaries["one"][key].keys()
        for metric, value in summaries["one"][key].items():
            np.testing.assert_allclose(summaries["two"][key][metric], value, rtol=1e-5, err_msg=f"{key} {metric}")
    params, config = load_params(default_model_dir(), dtype="float32")
    loaded = {name: load_draft(tmp_path / name / "heads", config, params) for name in runs}
    assert loaded["one"][:2] == loaded["two"][:2] == ("medusa", Medusa(num_heads=2))
    # 100x under what two steps move a weight (about 1e-4), 30x over the summation-order difference measured
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6),
                 loaded["one"][2], loaded["two"][2])
