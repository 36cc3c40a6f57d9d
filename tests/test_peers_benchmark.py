"""The peers benchmark (`evals/benchmarks/peers.py`): its export matrix (each shipped head set in each reference
layout, written or the one-line reason it is not, on the embedded model's shipped heads), and each reference engine's
own loop (`evals/peer_engines`) decoding the same heads as ours on the same tree."""

from __future__ import annotations

import jax
import pytest

from amphista_jax import Generator
from amphista_jax.assets import default_model_dir, shipped_heads_dir
from amphista_jax.drafters import DFlash, Eagle
from amphista_jax.drafters.exported import LAYOUTS
from amphista_jax.drafters.io import save_draft
from amphista_jax.evals.benchmarks import peers
from amphista_jax.evals.benchmarks.peers import export_matrix
from amphista_jax.models.target import Target
from tests import reference_code


def test_the_export_matrix_says_what_each_layout_holds():
    matrix = export_matrix(Generator.load(), ["medusa", "eagle", "hydra"])
    assert set(matrix) == {"medusa", "eagle", "hydra"} and all(set(row) == set(LAYOUTS) for row in matrix.values())
    assert matrix["medusa"]["medusa"] == "written"  # one ResBlock, its own lm_head, the whole vocabulary
    assert "input_norm=True" in matrix["eagle"]["eagle"]  # trained here with an input norm: not EAGLE's layer 0
    assert matrix["hydra"]["medusa"].startswith("are not Medusa heads")
    assert all(cell == "written" or not cell.startswith("these") for row in matrix.values() for cell in row.values())


@pytest.mark.parametrize("engine", ["medusa", "dflash", "eagle"])
def test_a_reference_engine_decodes_our_heads_as_we_do(tmp_path, engine):
    """The heads written in the engine's layout and read back as ours: the reference engine's own loop and ours, on
    the same tree, give greedy AR's tokens and commit the same number of tokens at every verify step."""
    reference_code._installed(peers.ENGINES[engine].module)
    model_dir = str(default_model_dir())
    ar = Generator.load(model_dir)
    heads = shipped_heads_dir("medusa") if engine == "medusa" else tmp_path / "heads"  # Medusa's: trained, in form
    if engine != "medusa":  # untrained heads in the reference's form
        drafter = {"dflash": DFlash(num_layers=1, block_size=4, mask_token_id=3, learned_mask=False),
                   "eagle": Eagle(input_norm=False, rope_theta=10000.0)}[engine]
        save_draft(heads, drafter.name, drafter, drafter.init(jax.random.key(0), Target(ar.config, ar.params)),
                   ar.config, target_params=ar.params)
    theirs, drafter, params = peers.heads_pair(engine, str(heads), ar, tmp_path)
    tree = "chain-3" if engine == "dflash" else peers.ENGINES[engine].tree
    side = peers.engine_side(engine, model_dir, theirs)
    our_side = peers.OurSide(ar.with_drafter(drafter, tree, draft_params=params))
    accepted = []
    for text in ("def add(a, b):", "import os\n"):
        ids = ar.encode(text)
        greedy = ar.generate(ids, max_new_tokens=24).token_ids[0]
        a, b = side(ids, 24), our_side(ids, 24)
        assert a["ids"] == b["ids"] == greedy
        assert a["accept_lengths"] == b["accept_lengths"] and sum(a["accept_lengths"]) == len(greedy) - 1
        accepted += a["accept_lengths"]
    assert engine != "medusa" or max(accepted) > 1  # trained heads: the equal counts include accepted drafts


def test_the_torch_sides_sample_alike_and_assisted_greedy_is_greedy(hf_model):
    """transformers' sides on one shared model: assisted by a draft model (here the model itself), greedy decoding
    gives plain greedy's tokens; sampled sides are seeded alike for every call."""
    model, _ = hf_model
    ids = [3, 17, 29, 4, 88, 9, 12]
    plain, assisted = peers.TorchSide(model, 0.0)(ids, 16), peers.TorchSide(model, 0.0, assistant=model)(ids, 16)
    assert plain["ids"] == assisted["ids"] and plain["ids"]
    sampled = [peers.TorchSide(model, 1.0)(ids, 16)["ids"] for _ in range(2)]
    assert sampled[0] == sampled[1] and sampled[0] != plain["ids"]


def test_engines_are_refused_for_another_target_in_one_line(tmp_path):
    """The reference engines decode SmolLM2's heads: named for another `--model`, one line before anything loads;
    by default they and the shipped methods are left out there."""
    import argparse

    args = argparse.Namespace(model="qwen2.5-coder-1.5b", engines=["medusa"], methods=None,
                              **{f"{name}_heads": engine.heads for name, engine in peers.ENGINES.items()})
    with pytest.raises(SystemExit, match="the engines decode SmolLM2's heads; with --model qwen2.5-coder-1.5b leave"):
        peers.check_sides(args, str(tmp_path / "qwen2.5-coder-1.5b"))
    assert peers.check_sides(argparse.Namespace(**vars(args) | {"engines": None}),
                             str(tmp_path / "qwen2.5-coder-1.5b")) == ([], [])
