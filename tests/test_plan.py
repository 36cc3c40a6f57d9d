"""Memory plans: a plan from abstract shapes is the program the run compiles (its per-device bytes equal the real
arrays' and the compiled step's), microbatches cut the activations, the 70B pod config plans on CPU and fits,
and a config that cannot be planned is one line."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from amphista_jax.assets import default_model_dir
from amphista_jax.cli import main
from amphista_jax.drafters import DRAFTERS, Eagle3, Medusa
from amphista_jax.engine.decode import decode
from amphista_jax.engine.decode_spec import DecodeSpec, scratch_slots
from amphista_jax.engine.memory_plan import compiled_cost, decode_plan, device_bytes
from amphista_jax.engine.sharding import batch_sharding, make_mesh, on_mesh, place_for_decoding
from amphista_jax.infra.config_io import load_config
from amphista_jax.models.hf import load_config as load_model_config
from amphista_jax.models.hf import load_params
from amphista_jax.models.target import Target
from amphista_jax.train.config import DataConfig, LossConfig, MeshConfig, TrainConfig
from amphista_jax.train.heads import plan_training, train_job
from amphista_jax.train.plan import plan_request
from amphista_jax.trees.names import get_tree
from tests.helpers import ROOT, default_cases, subprocess_env

MODEL = str(default_model_dir())
CONFIG = load_model_config(MODEL)
DATA = DataConfig(kind="stdlib", max_len=64, batch_size=8)


def _train_config(method: str = "medusa", microbatches: int = 1) -> TrainConfig:
    return TrainConfig(data=dataclasses.replace(DATA, microbatches=microbatches), drafter=DRAFTERS[method](),
                       mesh=MeshConfig(data=2, fsdp=2, tensor=2))


def _shard_bytes(tree) -> int:
    """Bytes device 0 holds of real arrays (measured from their shards)."""
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device.id == 0)


@pytest.mark.parametrize("method", ["medusa", "eagle", "bita"])  # BiTA's step runs the target with gradients
@default_cases('medusa')
def test_train_plan_is_the_compiled_step_of_the_real_run(method):
    cfg = _train_config(method)
    job = train_job(cfg, CONFIG)
    plan = plan_training(cfg, job, jnp.float32)
    # The run: real weights on their shards, the state made in place, a real batch split over the batch axes.
    params, _ = load_params(MODEL, dtype="float32", shardings=job.target_shardings)
    state = job.new_state(Target(CONFIG, params))
    tokens = np.asarray(jax.random.randint(jax.random.key(0), (8, 64), 0, CONFIG.vocab_size), np.int32)
    measured = {"target params": _shard_bytes(params), "draft params": _shard_bytes(state["params"]),
                "optimizer state": _shard_bytes((state["opt_state"], state["step"]))}
    assert {k: plan.inputs[k] for k in measured} == measured
    assert "layout padding" not in plan.inputs  # the named parts are every argument byte XLA counts
    assert plan.inputs["batch"] == 2 * 8 * 64 * 4 // 4  # tokens + loss_mask, rows over data x fsdp
    assert max(measured.values()) < 0.6 * device_bytes(jax.tree.map(  # really split: not whole copies
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, state["params"])))
    batch = {"tokens": tokens, "loss_mask": np.ones_like(tokens)}
    spec = jax.sharding.NamedSharding(job.mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    real = job.train_step.compile(state, params, jax.tree.map(lambda x: jax.device_put(x, spec), batch))
    stats = real.memory_analysis()
    assert stats.argument_size_in_bytes == sum(plan.inputs.values())
    assert (stats.temp_size_in_bytes, stats.output_size_in_bytes - stats.alias_size_in_bytes) == (plan.temp,
                                                                                                     plan.outputs)
    assert plan.flops is None  # the target's layers run as a scan in this step: XLA would count one
    new_state, metrics = job.train_step(state, params, batch)  # and it runs
    assert np.isfinite(float(metrics["loss"])) and int(new_state["step"]) == 1


def test_decode_plan_is_the_compiled_loop_of_a_sharded_generation():
    drafter = train_job(_train_config(), CONFIG).drafter
    tree, mesh = get_tree("small-8"), make_mesh(data=2, fsdp=2, tensor=2)
    plan = decode_plan(CONFIG, drafter, tree, mesh, jnp.float32, batch=2, prompt_len=16, max_new_tokens=8)
    params, _ = load_params(MODEL, dtype="float32", layout="split")
    params, draft = place_for_decoding(mesh, CONFIG, params, drafter,
                                       drafter.init(jax.random.key(0), Target(CONFIG, params)))
    assert (plan.inputs["target params"], plan.inputs["draft params"]) == (_shard_bytes(params), _shard_bytes(draft))
    rows = lambda x: jax.device_put(x, batch_sharding(mesh, x.shape))  # noqa: E731
    prompt, lengths = rows(np.full((2, 16), 5, np.int32)), rows(np.array([16, 9], np.int32))
    with on_mesh(mesh):
        real = decode.lower(
            params, draft, prompt, lengths, jax.device_put(jax.random.key(0), NamedSharding(mesh, PartitionSpec())),
            spec=DecodeSpec(CONFIG, drafter, tree, 8), cache_size=16 + 8 + scratch_slots(drafter, tree)).compile()
    assert real.memory_analysis().temp_size_in_bytes == plan.temp > 0


def test_microbatches_cut_the_train_steps_activations():
    temps = {}
    for k in (1, 8):  # 32 rows of 256 tokens: 8 rows, then 1, per batch shard at a time
        cfg = dataclasses.replace(_train_config("medusa", microbatches=k), data=dataclasses.replace(
            DATA, batch_size=32, max_len=256, microbatches=k))
        plan = plan_training(cfg, train_job(cfg, CONFIG), jnp.float32)
        temps[k] = plan.temp
        assert plan.flops is None  # the target's scanned layers, and for k = 8 the microbatch loop
    assert temps[8] < 0.3 * temps[1], temps


def test_a_target_label_plan_compiles_the_step_that_reads_the_label_store():
    """With stored hidden states and `loss.labels: target, kind: kl`, the step takes the store's top-k labels: the
    plan compiles that step, whose argument bytes and FLOPs are the real batch's. The step is loop-free (no target
    layers run), so its FLOPs are counted: at least the draft layer's products over every position."""
    data = dataclasses.replace(DATA, cache_target_hidden=True, hidden_store="unused")
    cfg = TrainConfig(data=data, drafter=Eagle3(), loss=LossConfig(labels="target", kind="kl", top_k=4))
    job = train_job(cfg, CONFIG)
    plan = plan_training(cfg, job, jnp.float32)
    params, _ = load_params(MODEL, dtype="float32")
    state = job.new_state(Target(CONFIG, params))
    rng, d, c = np.random.default_rng(0), CONFIG.hidden_size, len(job.drafter.captured_layers(CONFIG))
    logp = np.log(rng.dirichlet(np.ones(5), (8, 64))[..., :4]).astype(np.float32)
    batch = {"tokens": rng.integers(0, CONFIG.vocab_size, (8, 64), dtype=np.int32),
             "loss_mask": np.ones((8, 64), np.int32), "hidden": rng.standard_normal((8, 64, d)).astype(np.float16),
             "captured": rng.standard_normal((8, 64, c * d)).astype(np.float16),
             "label_ids": rng.integers(0, CONFIG.vocab_size, (8, 64, 4), dtype=np.int32), "label_logp": logp}
    real = job.train_step.compile(state, params, batch)
    assert plan.inputs["batch"] == device_bytes(batch)
    assert real.memory_analysis().argument_size_in_bytes == sum(plan.inputs.values())
    assert plan.flops == compiled_cost(real)["flops"]
    d, t = CONFIG.hidden_size, 8 * 64
    assert plan.flops > 2 * t * (job.drafter.ttt_steps * (4 * d * d + 2 * d * CONFIG.intermediate_size))


@pytest.mark.slow
def test_70b_pod_config_plans_on_cpu_and_fits(tmp_path):
    """The whole CLI on the Llama-3-70B config (32 emulated devices, no weights): both plans fit a TPU v5p (~3
    minutes on 2 cores; the default run plans Vicuna-7B's pod config through the CLI in tests/test_bad_inputs.py)."""
    out = tmp_path / "plan"
    result = subprocess.run([sys.executable, "-m", "amphista_jax.cli", "plan", "--config",
                             "configs/medusa/llama-3-70b.yaml", "--out", str(out)], cwd=ROOT, env=subprocess_env(),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((out / "plan.json").read_text())
    (setup, plans), = [(r["setup"], r["plans"]) for r in rows]
    assert setup["params"] > 70e9 and setup["devices"] == 32 and setup["processes"] == 8
    assert [p["job"] for p in plans] == ["train medusa", "decode"] and all(p["fits"] for p in plans)
    train = plans[0]
    # 70B bf16 over 32 devices, the heads and their Adam moments split too (replicated they would be 4 x larger)
    assert 70e9 * 2 / 32 <= train["inputs"]["target params"] < 1.05 * 70.6e9 * 2 / 32
    assert train["inputs"]["optimizer state"] == pytest.approx(2 * train["inputs"]["draft params"], rel=0.01)
    assert "fits:" in result.stdout and "TPU-v5p" in (out / "plan.md").read_text()


def test_plan_refuses_what_it_cannot_plan(tmp_path, capsys):
    assert jax.device_count() == 8  # JAX runs: `plan` in this process cannot emulate more devices
    base = ["plan", "--config", "configs/medusa/vicuna-7b.yaml"]
    cases = {("--set", "target_shape=''"): "has no config.json here: set target_shape",
             ("--set", "target_shape=llama-9b"): "target shape 'llama-9b' is not known",
             ("--accelerator", "TPU-v9"): "accelerator 'TPU-v9' is not known",
             ("--set", f"model={MODEL}"): "is not a vicuna-7b",
             ("--set", "data.microbatches=32"): "does not split over mesh data x fsdp = 4",
             ("--set", "mesh.fsdp=8"): "needs 16 devices but this process started JAX with 8"}
    for extra, message in cases.items():
        assert main(base + list(extra)) == 2, extra
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (extra, err)


def test_plan_takes_the_model_names_train_takes(tmp_path, monkeypatch):
    """`model: tiny` is the embedded model and a registry name (`smollm2`) its fetched directory, as for `train`:
    the plan reads that directory's config.json (here a fetched directory stood in by a copy of the tiny one)."""
    req = plan_request("tiny", TrainConfig(data=DATA, drafter=Medusa(), model="tiny"))
    assert req.source == f"{MODEL}/config.json" and req.target == CONFIG
    fetched = tmp_path / "smollm2"
    fetched.mkdir()
    (fetched / "config.json").write_text((default_model_dir() / "config.json").read_text())
    monkeypatch.setattr("amphista_jax.models.fetch.fetch", lambda name: fetched if name == "smollm2" else None)
    req = plan_request("smollm2", TrainConfig(data=DATA, drafter=Medusa(), model="smollm2"))
    assert req.source == f"{fetched}/config.json" and req.target == CONFIG


def _pod_configs() -> list[str]:
    """The shipped configs with a pod (a named target shape): every one must plan and fit."""
    paths = sorted((ROOT / "configs").glob("*/*.yaml"))
    return [str(p.relative_to(ROOT)) for p in paths if p.parent.name not in ("base", "target", "eval", "recipe")
            and load_config(TrainConfig, p).target_shape]


def test_every_pod_config_is_checked_without_compiling():
    """Each shipped pod config names a known target and accelerator, and its batch splits over its slice's
    processes and its mesh (what `plan` checks before compiling)."""
    configs = _pod_configs()
    assert len(configs) >= 25
    for path in configs:
        req = plan_request(path, load_config(TrainConfig, ROOT / path))
        assert req.accelerator is not None and req.target.num_params > 6e9, path


@pytest.mark.slow
def test_every_pod_config_fits(tmp_path):
    """The plan of every shipped pod config: each train step and decode loop fits its accelerator (~35 min)."""
    out = tmp_path / "plans"
    result = subprocess.run([sys.executable, "-m", "amphista_jax.cli", "plan", "--config", *_pod_configs(), "--out",
                             str(out)], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=5400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert all(p["fits"] for row in json.loads((out / "plan.json").read_text()) for p in row["plans"])
