"""z-lab's DFlash (dflash 0.1.0) as a peer engine: its own generation loop `dflash.model.dflash_generate` (the function
`DFlashDraftModel.spec_generate`, `dflash.benchmark` and `dflash.cli` all call), run on the plain transformers
`LlamaForCausalLM` target (SmolLM2) in fp32 on CPU, greedy (temperature 0).

What runs: `dflash.model.dflash_generate(draft, target, input_ids, max_new_tokens, stop_token_ids=[2],
temperature=0.0, block_size=B, return_stats=True)`, unmodified apart from the fixes below. It drives the target
through transformers itself (`target(ids, position_ids=..., past_key_values=DynamicCache, use_cache=True,
output_hidden_states=True)`, the cache rolled back with `DynamicCache.crop(-n)`), so there is no forked Llama: the
target is `transformers.LlamaForCausalLM` loaded with `attn_implementation` (default "sdpa", as dflash's benchmark
loads it; "eager" works too). The draft's attention is hard-wired to transformers' "sdpa" function (non-causal
over [context features ; block]), whatever `attn_implementation` the draft is loaded with.

Counting: `accept_lengths` is the loop's own `acceptance_lengths` list (`return_stats=True`): per verify step it
appends `produced = min(acceptance_length + 1, max_length - start - 1)`, cut after the first stop token, where
`acceptance_length` is the loop's own variable (longest prefix of the block's drafts equal to the target's argmax).
The loop never commits past `max_new_tokens` (the last step's `produced` is clipped to the budget, and the last
block is shortened to `min(B, max_length - start)`), so every step counted falls within the first
`max_new_tokens` tokens and `sum(accept_lengths) == len(ids) - 1` (checked). tau = (len(ids) - 1) /
len(accept_lengths) = mean(accept_lengths); the prefill's token is not counted.

Engine behaviour at temperature 0 (read from `dflash_generate`): each step drafts a chain of `verify_size - 1`
tokens (`verify_size = min(B, max_length - start)`, so B - 1 = 7 except in the last blocks) in ONE parallel,
non-causal draft forward over [anchor, MASK x (verify_size - 1)] (MASK = the target's embedding of mask_token_id;
drafts = argmax of the target's lm_head on draft slots 1..), then one target forward over the whole block
(anchor + drafts, causal). `acceptance_length = cumprod(drafts == argmax(target logits)[:-1]).sum()` (longest
prefix of drafts equal to the target's argmax), bonus = `argmax[acceptance_length]`; the step commits
anchor + accepted drafts, the bonus becomes the next anchor. The target cache is cropped to the committed
positions (the bonus is not cached) and the context features for the next draft are the capture layers' outputs
(`hidden_states[i + 1]`) at the committed positions only. No tree, one candidate chain.

Fixes (each a named function below):
1. `_cuda_time_on_cpu`: `dflash.model._cuda_time` calls `torch.cuda.synchronize()` unconditionally when
   `return_stats=True` (which is the only way to get `acceptance_lengths` out), and raises on a CPU-only torch.
   It synchronises only where CUDA is available; it reads the clock only, so nothing computed changes.
No other fix was needed under transformers 5.25 / torch 2.13 CPU (`DynamicCache.crop(-n)`, `crop(0)` a no-op,
`activate_past_recording`, `logits_to_keep`, `output_hidden_states` all behave as the loop expects; passing
`past_key_values=` only raises a FutureWarning, the argument being renamed `cache` in 5.40).
"""

from __future__ import annotations

import json
import os
import time

import dflash.model as dm
import torch
from transformers import LlamaForCausalLM

from amphista_jax.evals.peer_engines import side_result

EOS_ID = 2  # <|im_end|>


def _cuda_time_on_cpu() -> None:
    """Fix 1. `dflash.model._cuda_time()` (called around prefill and decode when `return_stats=True`) runs
    `torch.cuda.synchronize()`, which raises "Torch not compiled with CUDA enabled" on a CPU-only torch. Replace it
    with a version that synchronises only when CUDA is available and then reads `time.perf_counter()` as before.
    Timing-only: it changes nothing the target or the draft computes, nor any token."""
    if getattr(dm._cuda_time, "fixed", False):
        return

    def _cuda_time() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    _cuda_time.fixed = True
    dm._cuda_time = _cuda_time


def load_draft(heads_dir: str, dtype: torch.dtype = torch.float32) -> dm.DFlashDraftModel:
    """z-lab's draft, chosen as `dflash.benchmark.load_transformers_models` chooses it (DFlash2 where the config's
    architectures name it), loaded in `dtype` (fp32 here; the benchmark uses bf16 on CUDA)."""
    with open(os.path.join(heads_dir, "config.json")) as f:
        archs = json.load(f).get("architectures") or []
    cls = dm.DFlash2DraftModel if "DFlash2DraftModel" in archs else dm.DFlashDraftModel
    return cls.from_pretrained(heads_dir, attn_implementation="sdpa", dtype=dtype).eval()


class DFlashSide:
    def __init__(self, model_dir: str, heads_dir: str, block_size: int | None = None,
                 attn_implementation: str = "sdpa", stop_token_ids: tuple[int, ...] = (EOS_ID,)) -> None:
        _cuda_time_on_cpu()
        self.target = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                       attn_implementation=attn_implementation).eval()
        self.draft = load_draft(heads_dir)
        self.block_size = self.draft.block_size if block_size is None else int(block_size)
        self.stop_token_ids = list(stop_token_ids)

    def __call__(self, ids: list[int], max_new_tokens: int) -> dict:
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.target.device)
        start = time.perf_counter()
        out = dm.dflash_generate(self.draft, self.target, input_ids, max_new_tokens, self.stop_token_ids,
                                 temperature=0.0, block_size=self.block_size, return_stats=True)
        seconds = time.perf_counter() - start
        new = [int(t) for t in out.output_ids[0, out.num_input_tokens:].tolist()]
        accept = [int(a) for a in out.acceptance_lengths]
        if len(new) > max_new_tokens or sum(accept) != len(new) - 1:  # the prefill's token + each step's commits
            raise ValueError(f"dflash_generate's {len(accept)} steps commit {sum(accept)} + 1 of its {len(new)} "
                             f"tokens (at most {max_new_tokens})")
        return side_result(new, seconds, accept)
