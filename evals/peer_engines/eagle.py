"""eagle-llm 1.2.1's own generation loop, `eagle.model.ea_model.EaModel.eagenerate` (EAGLE-1, static tree
`eagle.model.choices.mc_sim_7b_63`: the root + 25 nodes, top-10 per drafted node), run on SmolLM2-135M-Instruct in
fp32 on CPU, for comparison with amphista-jax.

The engine is loaded exactly as its README does: `EaModel.from_pretrained(base_model_path=MODEL,
ea_model_path=HEADS)` (the forked Llama `eagle.model.modeling_llama_kv.LlamaForCausalLM` for the target; the draft
`eagle.model.cnets.Model` built from HEADS/config.json (+ its `bias` key) and loaded from HEADS/pytorch_model.bin with
`strict=True`, so the file must hold `embed_tokens.weight`). The tokenizer is the model directory's own
(`AutoTokenizer.from_pretrained(MODEL)`, offline; eos `<|im_end|>` = 2): eagenerate stops on its `eos_token_id`.

Fixes (each a named function below; none changes the engine's loop, tree, draft or acceptance rule):
 1. `fix_draft_rope_scaling`: the draft's `cnets.LlamaAttention._init_rope` reads `config.rope_scaling["type"]`;
    transformers 5 fills `rope_scaling` with `{"rope_type": "default", "rope_theta": ...}` where transformers 4 left
    None. Such a default is put back to None (plain RoPE). The draft keeps eagle-llm's own RoPE base, 10000 (its
    `LlamaRotaryEmbedding` default; EConfig has no rope_theta): unchanged computation.
 2-4. The forked Llama's (`llama_forks`): `fix_rope` (the same `["type"]` crash, and the hard-coded RoPE base
    10000 replaced by the config's 100000: this CHANGES what the target computes, to the checkpoint's true RoPE;
    without it the logits are off by up to ~10), `fix_tied_weights`, `rebuild_rotary` (buffers transformers 5's
    loader leaves uninitialised). Its KV cache is already sized by KV heads.

Not a fix, instrumentation only: `ea_model.update_inference_inputs` (the function eagenerate calls once per verify
step with the engine's own `accept_length`, the number of accepted draft tokens from `evaluate_posterior`) is wrapped
to record `int(accept_length)`; its arguments and result pass through untouched.

Counting (amphista-jax's convention): the prefill gives the first new token; verify step i commits
`accept_length_i + 1` tokens (accepted drafts + the target's bonus token). eagenerate appends a step's bonus token
only at the next step (as that step's tree root), so its output is the prefill token + each step's tokens minus the
last bonus; and it runs until `new_token > max_new_tokens` (or eos appears). The ids are cut to `max_new_tokens`
(and after eos 2 inclusive); `accept_lengths` walks the steps in order over the cut ids, each step counting only its
tokens that fall within them (the last may be partial; steps wholly past the cut are dropped), so
`sum(accept_lengths) == len(ids) - 1` and `tau = (len(ids) - 1) / len(accept_lengths)`.
"""

from __future__ import annotations

import os
import time

import torch
from transformers import AutoTokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from eagle.model import cnets, ea_model, modeling_llama_kv  # noqa: E402
from eagle.model.choices import mc_sim_7b_63  # noqa: E402

from amphista_jax.evals.peer_engines import count_steps, llama_forks, side_result  # noqa: E402


def fix_draft_rope_scaling() -> None:
    """Fix 1: the draft's `_init_rope` crashes on transformers 5's default `rope_scaling` dict (no "type"); that
    default means plain RoPE, so it is set back to None. The draft's RoPE base stays eagle-llm's 10000."""
    if getattr(cnets.LlamaAttention._init_rope, "fixed", False):
        return
    init_rope = cnets.LlamaAttention._init_rope

    def _init_rope(self) -> None:
        scaling = self.config.rope_scaling
        if isinstance(scaling, dict) and "type" not in scaling:
            self.config.rope_scaling = None
        init_rope(self)

    _init_rope.fixed = True
    cnets.LlamaAttention._init_rope = _init_rope


def apply_fixes() -> None:
    fix_draft_rope_scaling()
    llama_forks.fix_rope(modeling_llama_kv)
    llama_forks.fix_tied_weights(modeling_llama_kv)


class _Recorder:
    """Wraps `ea_model.update_inference_inputs` (looked up by eagenerate as a module global) to record the engine's
    `accept_length` of each verify step; arguments and results pass through unchanged."""

    def __init__(self) -> None:
        self.accept = []
        self.best = []
        self.inner = getattr(ea_model.update_inference_inputs, "inner", ea_model.update_inference_inputs)

        def update_inference_inputs(input_ids, candidates, best_candidate, accept_length, *args, **kwargs):
            self.accept.append(int(accept_length))
            self.best.append(int(best_candidate))
            return self.inner(input_ids, candidates, best_candidate, accept_length, *args, **kwargs)

        update_inference_inputs.inner = self.inner
        ea_model.update_inference_inputs = update_inference_inputs


class EagleSide:
    def __init__(self, model_dir: str, heads_dir: str, max_length: int = 2048) -> None:
        apply_fixes()
        self.model = ea_model.EaModel.from_pretrained(base_model_path=model_dir, ea_model_path=heads_dir,
                                                      dtype=torch.float32).eval()
        llama_forks.rebuild_rotary(self.model.base_model)
        self.max_length = max_length
        self.model.tokenizer = AutoTokenizer.from_pretrained(model_dir)  # the target's own, whatever the module's
        self.eos_id = self.model.tokenizer.eos_token_id  # the loop's own stop token
        self.recorder = _Recorder()

    def __call__(self, ids: list[int], max_new_tokens: int) -> dict:
        input_ids = torch.as_tensor([ids], dtype=torch.long)
        self.recorder.accept, self.recorder.best = [], []
        start = time.perf_counter()
        out = self.model.eagenerate(input_ids, temperature=0.0, max_new_tokens=max_new_tokens,
                                    max_length=self.max_length)
        seconds = time.perf_counter() - start
        raw = out[0, len(ids):].tolist()
        new, lengths = count_steps(raw, self.recorder.accept, max_new_tokens, self.eos_id)
        return side_result(new, seconds, lengths, raw_ids=raw, raw_accept=list(self.recorder.accept),
                           accepted_paths=self._paths())

    def _paths(self) -> list[list[int]]:
        """Per verify step, the accepted tree node as its rank path (`[]`: only the root), read from the engine's
        `best_candidate` and its `retrieve_indices` (node i >= 1 of the verify input is sorted path i - 1)."""
        order = sorted(mc_sim_7b_63, key=lambda x: (len(x), x))
        retrieve = self.model.tree_buffers["retrieve_indices"].tolist()
        steps = zip(self.recorder.accept, self.recorder.best, strict=True)
        return [order[retrieve[b][a] - 1] if a else [] for a, b in steps]
