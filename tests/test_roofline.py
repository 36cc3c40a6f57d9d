"""The roofline benchmark (`evals/benchmarks/roofline.py`): its cost figures are XLA's for the compiled steps,
checked against hand counts, and the script runs end to end on a tiny target from abstract shapes."""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import pytest

from amphista_jax.evals.benchmarks import roofline
from amphista_jax.models.config import tiny_llama_config
from amphista_jax.models.llama import param_shapes
from amphista_jax.models.param_layout import split_layers


def test_matmul_cost_matches_a_hand_count():
    b, d, v = 4, 256, 1024
    x, w = jax.ShapeDtypeStruct((b, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32)
    cost = roofline.compiled_cost(lambda x, w: x @ w, x, w)
    assert cost["flops"] == 2 * b * d * v
    assert cost["bytes"] == 4 * (b * d + d * v + b * v)  # both operands read once, the output written once


def test_roofline_prediction_is_the_slower_of_compute_and_memory():
    h100 = roofline.ACCELERATORS["H100-SXM"]
    assert h100.seconds(989e12, 0.0) == pytest.approx(1.0) and h100.bound(989e12, 0.0) == "compute"
    assert h100.seconds(1.0, 3.35e12) == pytest.approx(1.0) and h100.bound(1.0, 3.35e12) == "memory"


@pytest.mark.parametrize("layers", [2, 4])
def test_decode_steps_count_every_layer(layers):
    """A decode step reads all of the target's weights and multiplies by each: the cost analysis must count every
    layer (XLA counts a loop's body once: the roofline compiles the target one module per layer)."""
    config = tiny_llama_config(num_layers=layers, hidden_size=128, intermediate_size=512, vocab_size=1024)
    params = jax.eval_shape(split_layers, param_shapes(config, jnp.float32)[0])
    matmul_params = config.num_params - config.vocab_size * config.hidden_size  # a step gathers one embedding row
    ar = roofline.ar_cost(config, params, batch=1, context=64)
    spec, nodes = roofline.spec_cost(config, params, roofline.VARIANTS["medusa"], "chain-4", batch=1, context=64)
    assert nodes == 5
    assert 0.95 * 4 * matmul_params <= ar["bytes"] < 2 * 4 * matmul_params
    assert 2 * matmul_params * 0.95 <= ar["flops"] < 2 * matmul_params * 1.5  # 2 flops per weight, + attention
    assert spec["flops"] > 5 * 2 * matmul_params  # five tree nodes through the target, plus the heads


def test_roofline_script_writes_its_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["roofline", "--target", "tiny", "--runs", "medusa@chain-4", "eagle@dynamic",
                                      "--out", str(tmp_path), "--tau", "2", "3"])
    roofline.main()
    data = json.loads((tmp_path / "roofline.json").read_text())
    assert [(r["method"], r["tree"]) for r in data["rows"]] == [("ar", "-"), ("medusa", "chain-4"),
                                                                 ("eagle", "dynamic")]
    for row in data["rows"][1:]:
        ratio = row["step_ratio"]["H100-SXM"]
        assert row["speedup"]["H100-SXM"]["3.0"] == pytest.approx(3.0 / ratio)
    assert "predictions** (not measurements)" in (tmp_path / "roofline.md").read_text()
    assert "Predicted AR tokens/s" in capsys.readouterr().out


def test_a_draft_vocabulary_is_a_run_setting_and_cuts_the_drafts_bytes(tmp_path, monkeypatch, capsys):
    """`eagle3@dynamic#draft_vocab_size=N` costs EAGLE-3 drafting over N ids: each drafted depth reads N x D of its
    lm_head instead of V x D, so the step reads fewer bytes; the setting is kept in the row and its label."""
    config = tiny_llama_config(num_layers=2, hidden_size=128, intermediate_size=512, vocab_size=4096)
    params = jax.eval_shape(split_layers, param_shapes(config, jnp.float32)[0])
    full, reduced = (roofline.run_drafter(r) for r in ("eagle3@chain-3", "eagle3@chain-3#draft_vocab_size=256"))
    assert reduced[:3] == ("eagle3", "chain-3", "draft_vocab_size=256") and len(reduced[3].draft_vocab) == 256
    cost_full = roofline.spec_cost(config, params, full[3], "chain-3", batch=1, context=64)[0]
    cost_reduced = roofline.spec_cost(config, params, reduced[3], "chain-3", batch=1, context=64)[0]
    # three drafted depths, each reading (4096 - 256) x 128 fewer fp32 weights, at the least
    assert cost_full["bytes"] - cost_reduced["bytes"] > 3 * (4096 - 256) * 128 * 4 * 0.9
    assert roofline.run_label({"method": "eagle3", "tree": "dynamic", "settings": "draft_vocab_size=256"}) == \
        "eagle3@dynamic#draft_vocab_size=256"
    for bad, why in (("eagle3", "method@tree"), ("nope@chain-3", "method@tree"),
                     ("eagle3@chain-3#ttt_steps=x", "ttt_steps"), ("medusa@dynamic", "static tree")):
        monkeypatch.setattr(sys, "argv", ["roofline", "--target", "tiny", "--runs", bad, "--out", str(tmp_path)])
        with pytest.raises(SystemExit):
            roofline.main()
        assert why in capsys.readouterr().err
