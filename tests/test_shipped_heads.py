"""The heads shipped for the embedded model: they load, decode losslessly with long accepted paths on their
searched CPU tree and on the papers' 63-node tree, the demo reports what it measured, and Amphista's heads beat
Medusa's on held-out code (Amphista Figure 1)."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from amphista_jax.assets import default_model_dir, draft_model_dir, shipped_heads, shipped_heads_dir
from amphista_jax.choice.acceptance import ACCEPTANCE_FILE, Acceptance
from amphista_jax.drafters.draft_model import DraftModel
from amphista_jax.drafters.io import load_draft
from amphista_jax.engine.decode import generate, pad_prompts, speculative_generate
from amphista_jax.engine.decode_spec import scratch_slots
from amphista_jax.models.hf import load_params
from amphista_jax.models.tokenizer import encode_prompt, load_tokenizer
from amphista_jax.prompts import humaneval_prompt
from amphista_jax.trees.names import PRESETS, get_tree, searched_tree_path
from tests.helpers import default_cases

MODEL = default_model_dir()
# Fill static trees; each has a CPU tree searched for it.
METHODS = ("medusa", "amphista", "hydra", "hydra-plus", "sar", "sar-lstm")
VARIANT_OF = {"hydra-plus": "hydra", "sar-lstm": "sar"}  # shipped name -> registered method
# Their own trees: EAGLE's and Gumiho's (feature-level drafters), BiTA's (mask tokens: depth <= 3) searched one and
# its paper's efficient tree.
OWN_TREES = {"eagle": ("mc_sim_7b_63", "dynamic"), "gumiho": ("dynamic-63x7x35",),
             "bita": ("searched", "efficient-3x5")}
SEARCHED = METHODS + ("bita",)
SHIPPED = sorted(METHODS + tuple(OWN_TREES))


@pytest.fixture(scope="module")
def target():
    params, config = load_params(MODEL, dtype="float32")
    return params, config, load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def heads(target):
    params, config, _ = target
    return {m: load_draft(shipped_heads_dir(m), config, params)[1:] for m in SHIPPED}


def test_shipped_heads_files(target, heads):
    _, config, _ = target
    assert shipped_heads() == SHIPPED
    for name in SHIPPED:
        path = shipped_heads_dir(name)
        meta = json.loads((path / "draft.json").read_text())
        assert meta["method"] == VARIANT_OF.get(name, name) and meta["target"]["vocab_size"] == config.vocab_size
        assert sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) < 8 * 2**20  # bf16 on disk
        stats = Acceptance.read(path / ACCEPTANCE_FILE)  # what `auto` chooses from on the machine that decodes
        assert stats.method == meta["method"] and [c.nodes for c in stats.candidates] == sorted(
            c.nodes for c in stats.candidates) and all(c.tau >= 1 for c in stats.candidates)
        for c in stats.candidates:
            heads[name][0].check_tree(c.tree, config.vocab_size)
        if name not in SEARCHED:
            continue
        tree = get_tree(str(searched_tree_path(path, "cpu")))  # the CPU tree searched for these heads
        assert 1 <= tree.num_nodes - 1 <= 63 and tree.depth <= heads[name][0].max_depth
    with pytest.raises(FileNotFoundError, match="train them"):
        shipped_heads_dir("no-such-method")


@pytest.mark.parametrize(("method", "tree_name"), [
    pytest.param(m, t, marks=pytest.mark.slow if m.startswith("sar") and t != "searched" else ())
    for m in METHODS for t in ("searched", "mc_sim_7b_63")] + [(m, t) for m, trees in OWN_TREES.items() for t in trees])
# One case per drafter family (static heads, dynamic tree, beam + FTA, in-target masks, sequential heads); the
# papers' 63-node tree for each is under -m slow (test_speculative's mc_sim_7b_63 cases cover deep static trees).
@default_cases('medusa-searched', 'eagle-dynamic', 'gumiho-dynamic-63x7x35', 'bita-searched', 'hydra-searched')
def test_shipped_heads_decode_losslessly_with_long_paths(target, heads, method, tree_name):
    """Greedy speculative decoding with the trained heads == AR, batch 3 (three HumanEval prompts of
    different lengths), on the tree searched for the heads and on the papers' 63-node tree (EAGLE: also its
    dynamic tree; Gumiho: its dynamic budget; BiTA: its searched tree and its paper's efficient tree); trained
    heads commit clearly more than 1 token/forward (more than 1.5 on the large trees; a searched one-node tree
    drafts less)."""
    params, config, tok = target
    drafter, draft_params = heads[method]
    prompts = [encode_prompt(tok, humaneval_prompt(f"HumanEval/{i}")) for i in (2, 4, 7)]
    tokens, lengths = pad_prompts(prompts, pad_id=config.pad_token_id or 0)
    path = shipped_heads_dir(method)
    tree = get_tree(str(searched_tree_path(path, "cpu")) if tree_name == "searched" else tree_name, path,
                    drafter.paper_tree)
    settings = dict(config=config, max_new_tokens=48,
                    cache_size=tokens.shape[1] + 48 + scratch_slots(drafter, tree))  # BiTA: nodes + mask groups
    ar = generate(params, tokens, lengths, jax.random.key(0), **settings)
    spec = speculative_generate(params, draft_params, tokens, lengths, jax.random.key(0), drafter=drafter,
                                tree=tree, **settings)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    np.testing.assert_array_equal(np.asarray(spec.num_tokens), np.asarray(ar.num_tokens))
    tau = float((np.asarray(spec.num_tokens) - 1).sum() / np.asarray(spec.accept_lengths > 0).sum())
    assert tau > (1.5 if tree.num_nodes > 8 else 1.0), tau  # a searched CPU tree may hold a single draft node


@pytest.mark.slow
def test_shipped_draft_model_decodes_losslessly(target):
    """The embedded target's shipped sibling (`configs/target/code-draft.yaml`) drafts chains for it: greedy
    output equals AR's (batch 3) and more than two tokens are committed per target forward (3.06 on the
    evaluation's 20 prompts, docs/results/code-llama). Under -m slow: test_draft_model.py's
    test_greedy_draft_model_equals_ar[chain-4] and
    test_from_pretrained_loads_a_checkpoint_and_refuses_another_vocabulary cover a draft model loaded from its
    directory drafting chains losslessly."""
    params, config, tok = target
    drafter, draft_params = DraftModel.from_pretrained(draft_model_dir(), config, MODEL)
    prompts = [encode_prompt(tok, humaneval_prompt(f"HumanEval/{i}")) for i in (2, 4, 7)]
    tokens, lengths = pad_prompts(prompts, pad_id=config.pad_token_id or 0)
    settings = dict(config=config, max_new_tokens=48, cache_size=tokens.shape[1] + 48 + 5)
    ar = generate(params, tokens, lengths, jax.random.key(0), **settings)
    spec = speculative_generate(params, draft_params, tokens, lengths, jax.random.key(0), drafter=drafter,
                                tree=PRESETS["chain-4"], **settings)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    tau = float((np.asarray(spec.num_tokens) - 1).sum() / np.asarray(spec.accept_lengths > 0).sum())
    assert tau > 2.0, tau


def test_demo_runs_without_torch_and_checks_losslessness():
    """The README's main job (`amphista-jax demo`, runtime dependencies only): torch cannot be imported."""
    block_torch = ("import sys; sys.modules['torch'] = None; from amphista_jax.cli import main; "
                   "raise SystemExit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", block_torch, "demo", "--task", "HumanEval/2", "--max-new-tokens",
                           "32", "--runs", "1"], capture_output=True, text=True, timeout=900)  # --tree auto
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert humaneval_prompt("HumanEval/2") in out and "\033[32m" in out  # drafted tokens are coloured
    assert "output identical to autoregressive greedy decoding: yes" in out and "| hydra |" in out
    backend = jax.default_backend().upper()
    assert "target: code-llama (the embedded model), 2.1M parameters" in out and "drafter: hydra; tree: " in out
    assert f"faster on {backend}" in out or f"NO SPEED-UP on {backend}" in out


def test_tree_presets_fit_the_shipped_heads(heads):
    for drafter, _ in (heads[m] for m in METHODS):
        assert all(get_tree(name).depth <= drafter.num_heads for name in PRESETS)


@pytest.mark.slow
def test_amphista_beats_medusa_on_later_heads(target, heads):
    """Amphista Figure 1 on our model: trained with the same data and budget (configs/*/code.yaml), the
    shipped Amphista heads are more accurate than the shipped Medusa heads on held-out stdlib code for heads
    2..K (teacher-forced top-1 over 8 x 8 x 256 held-out tokens). Under -m slow: test_head_accuracy's
    test_every_registered_drafter_reports_per_head_accuracy covers the per-head accuracy it compares, and
    test_shipped_heads_files that both shipped heads load (the ranking itself changes only when heads are
    re-shipped)."""
    from amphista_jax.evals.head_accuracy import head_accuracy, heldout_batches
    from amphista_jax.models.target import Target

    params, config, tok = target
    batches = heldout_batches(tok, n_batches=8)
    acc = {m: head_accuracy(Target(config, params), *heads[m], batches) for m in ("medusa", "amphista")}
    k = heads["amphista"][0].num_heads
    assert k == heads["medusa"][0].num_heads
    for head in range(1, k):
        assert acc["amphista"][head]["top1"] > acc["medusa"][head]["top1"], (head, acc)


@pytest.mark.slow  # its parts (growth, pick, calibration) run by default in test_tree_search; this is the CLI
def test_tree_search_cli_writes_a_tree_report_and_plot(tmp_path, capsys):
    """`amphista-jax tree-search` end to end on shipped heads (a small budget): statistics on calibration
    prompts, growth, timing on this device; the tree, report and plot are written, `generate` decodes with the
    tree, and a second search refuses to replace the tree."""
    from amphista_jax.cli import main
    from amphista_jax.infra.errors import BAD_INPUT_EXIT
    from amphista_jax.trees.names import load_tree

    out = tmp_path / "cpu.json"
    args = ["tree-search", "--heads", str(shipped_heads_dir("medusa")), "--tasks", "100:102", "--max-nodes", "3",
            "--max-new-tokens", "64", "--runs", "3", "--batch-sizes", "1,2", "--out", str(out)]  # decode >> prefill
    assert main(args) == 0
    assert "predicted speed-up" in capsys.readouterr().out
    tree = load_tree(out)
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert [t["draft_nodes"] for t in report["trees"]] == [1, 2, 3]
    assert report["picked"] == [list(p) for p in tree.choices]
    assert [t["choices"] for t in report["trees"]][report["trees"].index(max(
        report["trees"], key=lambda t: t["predicted_tokens_per_s"]))] == report["picked"]  # the fastest is picked
    assert all(t["step_ms"] > 0 for t in report["trees"]) and out.with_suffix(".png").stat().st_size > 1000
    assert [b["batch"] for b in report["batches"]] == [1, 2]
    assert all(b["measured_speedup"] > 0 for b in report["batches"])
    assert json.loads(out.with_suffix(".batch.json").read_text()) == report["policy"]
    assert out.with_suffix(".batch.png").stat().st_size > 1000
    assert main(["generate", "--heads", str(shipped_heads_dir("medusa")), "--tree", str(out), "--prompt",
                 "def f(x):", "--max-new-tokens", "6"]) == 0
    before = out.read_bytes()
    capsys.readouterr()
    assert main(args) == BAD_INPUT_EXIT and "--replace" in capsys.readouterr().err
    assert out.read_bytes() == before
