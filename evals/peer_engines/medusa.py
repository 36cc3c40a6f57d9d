"""medusa-llm 0.1's own generation loop (`medusa.model.medusa_model.MedusaModel.medusa_generate`) on SmolLM2, as a
peer engine beside ours (`evals/benchmarks/peers.py`).

What runs: `MedusaModel.medusa_generate(input_ids, temperature=0.0, max_steps=..., medusa_choices=...)`, the
package's own generator (prefill `initialize_medusa`, then per step `generate_candidates` -> `tree_decoding` ->
`evaluate_posterior` -> `update_inference_inputs`), its forked Llama (`medusa.model.modeling_llama_kv`) as the target,
its `MedusaModel` heads (`ResBlock`s + a full-vocabulary linear), loaded from `medusa_lm_head.pt`.

Tree and acceptance (medusa-llm 0.1, read from `medusa.model.utils`): `medusa_choices=[1, 7, 6]` is a CARTESIAN
product tree: root = the target's argmax (the "1"), depth 1 = head 0's top-7, depth 2 = head 1's top-6 under EVERY
depth-1 node (7 x 6 = 42), 49 draft nodes + root = 50 tree tokens per verify forward; only len(choices) - 1 heads are
used. `medusa_tree(choices)` reads the node paths from the engine's own buffers (tree.json). Greedy acceptance
(`evaluate_posterior`, temperature 0): for each of the 42 root-to-leaf rows, the prefix of drafts equal to the target's
argmax at the previous node (cumprod); `accept_length` = the longest; `best_candidate` = the first row with it. Then
`update_inference_inputs` appends root + `accept_length` drafts (`new_token += accept_length + 1`) and keeps the
target's logits at the last accepted node, whose argmax becomes the next root (the bonus token, appended next step).

Fixes (each a named function below; none changes what the model computes unless it says so):

1-3. The forked Llama's (`llama_forks`): `fix_rope` (transformers 5's filled-in `rope_scaling` crashes `_init_rope`;
   the hard-coded RoPE base 10000 is replaced by the config's, 100000: this one CHANGES what the fork computes, to
   the target as trained; without it the logits are off by up to 9.96), `fix_tied_weights`, `rebuild_rotary`.
4. `_initialize_past_key_values_gqa`: `medusa.model.kv_cache.initialize_past_key_values` sizes the preallocated
   cache by `num_attention_heads` (9) and `hidden_size // num_attention_heads`; with grouped-query attention the fork's
   attention stores `num_key_value_heads` (3) heads per layer, so `KVCache.cat`'s copy fails to broadcast (crash).
   Sized by `num_key_value_heads` (same head size); the fork repeats the K/V heads after the cache as before. Same
   computation. (Also sized `max_position_embeddings` long, as released.)

Not fixes (configuration / instrumentation, engine code unchanged):
 - The tokenizer: `MedusaModel.__init__` calls `AutoTokenizer.from_pretrained(base_model_name_or_path)`; we pass the
   local model dir, so it loads SmolLM2's own tokenizer from disk (no hub). The loop uses it to decode each yield and
   for its EOS stop (`tokenizer.eos_token_id`: SmolLM2's `<|im_end|>`, 2).
 - Heads: built as `MedusaModel(base, num_heads=len(medusa_choices) - 1, num_layers)` because the loop's
   `generate_candidates` takes one top-k (`medusa_choices[1:]`) per head and fails with more heads than that; the
   engine's `load_state_dict(strict=False)` then loads the first heads of the file. We check that every tensor of the
   built heads equals the file's (`_load_heads`), since strict=False would silently skip mismatched names.
 - `_Recorder` wraps `update_inference_inputs` (the name `medusa_generate` calls) to read the engine's own
   `accept_length` (the variable `evaluate_posterior` returns, passed on to `update_inference_inputs`, which adds
   `accept_length + 1` to the loop's `new_token`) and the logits it keeps for the next step (whose argmax is the next
   step's root token). The original function runs unchanged.
 - The preallocated KV cache is made in `MedusaSide.__init__` by the loop's own (fixed) `initialize_past_key_values`
   and stored where `medusa_generate` looks for it (`self.past_key_values` etc.), so a first call does not time it.
 - Stopping: the loop stops only at `max_steps` or when EOS is among its appended tokens; we consume its generator and
   stop pulling once the tokens it has fixed reach `max_new_tokens` (see `__call__`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from medusa.model import kv_cache as _kv_cache
from medusa.model import medusa_model as _mm
from medusa.model import modeling_llama_kv as _kv
from medusa.model import utils as _utils
from transformers import AutoTokenizer

from amphista_jax.evals.peer_engines import count_steps, llama_forks, side_result


# --- fixes ------------------------------------------------------------------------------------------------------------
def _initialize_past_key_values_gqa(model: Any) -> tuple:
    """Fix 4. medusa-llm's `initialize_past_key_values` sizes the cache by `num_attention_heads`; the fork's
    attention caches `num_key_value_heads` heads (grouped-query attention), so `KVCache.cat` fails to broadcast. The
    same cache, sized by `num_key_value_heads`; no change to what is computed."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    data = torch.zeros(config.num_hidden_layers * 2, 1, config.num_key_value_heads, config.max_position_embeddings,
                       head_dim, device=model.device, dtype=model.dtype)
    current_length_data = torch.zeros(config.num_hidden_layers * 2, dtype=torch.long, device="cpu")
    past_key_values = [[_kv_cache.KVCache(data[i * 2 + j], current_length_data[i * 2 + j]) for j in range(2)]
                       for i in range(config.num_hidden_layers)]
    return past_key_values, data, current_length_data


def apply_fixes() -> None:
    """Patch the package in place (idempotent): the fork's RoPE and tied weights (`llama_forks`), and fix 4 under
    the name `medusa_generate` calls."""
    llama_forks.fix_rope(_kv)
    llama_forks.fix_tied_weights(_kv)
    _mm.initialize_past_key_values = _initialize_past_key_values_gqa


def load_target(model_dir: str) -> _kv.LlamaForCausalLM:
    """The fork's `LlamaForCausalLM.from_pretrained(model_dir)` in fp32, with fixes 1-4."""
    apply_fixes()
    model = _kv.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llama_forks.rebuild_rotary(model)
    return model


# --- heads --------------------------------------------------------------------------------------------------------
def _load_heads(model: _mm.MedusaModel, heads_dir: str) -> None:
    """As `MedusaModel.from_pretrained` loads them (`load_state_dict(..., strict=False)`), then every tensor of the
    built heads is checked equal to the file's (strict=False would skip a misnamed key silently)."""
    state = torch.load(os.path.join(heads_dir, "medusa_lm_head.pt"), map_location="cpu")
    model.medusa_head.load_state_dict(state, strict=False)
    own = model.medusa_head.state_dict()
    missing = [k for k in own if k not in state]
    if missing:
        raise ValueError(f"medusa_lm_head.pt lacks {missing}: medusa-llm would keep its initial values for them")
    bad = [k for k, v in own.items() if not torch.equal(v, state[k].to(v.dtype))]
    if bad:
        raise ValueError(f"heads not loaded as saved: {bad}")


def medusa_tree(medusa_choices: list[int]) -> list[list[int]]:
    """The tree the engine verifies, read from its own buffers (`generate_medusa_buffers`): node paths (per-depth
    candidate ranks; rank r at depth d = head d-1's top-(r+1) token), root excluded, in the engine's node order."""
    buffers = _utils.generate_medusa_buffers(medusa_choices, device="cpu")
    tree_indices = buffers["tree_indices"].tolist()
    mask = buffers["medusa_attn_mask"][0, 0]
    depth = buffers["medusa_position_ids"].tolist()
    offset = [0] + torch.cumsum(torch.tensor(medusa_choices), 0).tolist()  # candidates_flat offset per depth
    rank = [tree_indices[n] - offset[depth[n]] for n in range(len(tree_indices))]
    paths = []
    for n in range(1, len(tree_indices)):
        ancestors = [a for a in range(1, n + 1) if mask[n, a] > 0]  # itself included, root excluded
        assert [depth[a] for a in ancestors] == list(range(1, depth[n] + 1))
        paths.append([rank[a] for a in ancestors])
    return paths


class _Recorder:
    """Wraps the loop's `update_inference_inputs` (instrumentation): records its `accept_length` argument (the
    engine's acceptance variable; it commits `accept_length + 1` tokens) and the argmax of the logits it keeps (the
    next step's root token, i.e. the step's bonus token)."""

    def __init__(self) -> None:
        self.accept: list[int] = []
        self.bonus: list[int] = []
        self.original = _utils.update_inference_inputs

    def __call__(self, *args: Any, **kwargs: Any) -> tuple:
        out = self.original(*args, **kwargs)
        accept_length = args[3] if len(args) > 3 else kwargs["accept_length"]
        self.accept.append(int(accept_length))
        self.bonus.append(int(torch.argmax(out[1][0, -1])))
        self.input_ids = out[0]
        return out


class MedusaSide:
    def __init__(self, model_dir: str, heads_dir: str, medusa_choices: list[int] | None = None,
                 max_steps: int | None = None) -> None:
        self.medusa_choices = list(medusa_choices or [1, 7, 6])
        self.max_steps = max_steps
        with open(os.path.join(heads_dir, "config.json")) as f:
            config = json.load(f)
        num_heads = len(self.medusa_choices) - 1
        if config["medusa_num_heads"] < num_heads:
            raise ValueError(f"medusa_choices={self.medusa_choices} needs {num_heads} heads; the file has "
                             f"{config['medusa_num_heads']}")
        self.file_heads = config["medusa_num_heads"]
        base = load_target(model_dir)
        self.model = _mm.MedusaModel(base, num_heads, config["medusa_num_layers"], model_dir)
        self.model.eval()
        _load_heads(self.model, heads_dir)
        # The cache `medusa_generate` allocates on its first call (and reuses after), made here by the same (fixed)
        # function so that the first call's "seconds" do not include allocating it.
        (self.model.past_key_values, self.model.past_key_values_data,
         self.model.current_length_data) = _mm.initialize_past_key_values(base)
        self.model.tokenizer = AutoTokenizer.from_pretrained(model_dir)  # the target's own, whatever the module's
        self.eos_id = self.model.tokenizer.eos_token_id  # the loop's own stop token
        self.tree = medusa_tree(self.medusa_choices)

    @torch.inference_mode()
    def __call__(self, ids: list[int], max_new_tokens: int) -> dict:
        """Run `medusa_generate` and pull its steps until the tokens it has fixed (appended ones + the pending root
        of its next step) reach `max_new_tokens`, or an EOS is among them.

        Counting (our convention: the prefill's token, then each verify step commits its accepted drafts + a bonus):
        the engine's step i appends its root (the previous step's bonus, or the prefill's token) + `accept_length`
        drafts and keeps the bonus as the next root, so in our terms step i commits `accept_length_i + 1` tokens
        (the same sum). Only steps whose tokens fall within the first `max_new_tokens` (and up to EOS) count, the last
        one cut to what fits; tau = (new tokens - 1) / counted steps."""
        rec = _Recorder()
        _mm.update_inference_inputs = rec
        try:
            input_ids = torch.tensor([ids], dtype=torch.long)
            n = len(ids)
            max_steps = self.max_steps or max_new_tokens + 1
            start = time.perf_counter()
            gen = self.model.medusa_generate(input_ids, temperature=0.0, max_steps=max_steps,
                                             medusa_choices=self.medusa_choices)
            appended: list[int] = []
            for _ in gen:
                appended = rec.input_ids[0, n:].tolist()
                fixed = appended + [rec.bonus[-1]]
                if len(fixed) >= max_new_tokens or self.eos_id in fixed:
                    break
            gen.close()
            seconds = time.perf_counter() - start
        finally:
            _mm.update_inference_inputs = rec.original
        fixed = appended + [rec.bonus[-1]] if rec.bonus else appended
        out, accept_lengths = count_steps(fixed, rec.accept, max_new_tokens, self.eos_id)
        return side_result(out, seconds, accept_lengths, engine_accept_length=rec.accept)
