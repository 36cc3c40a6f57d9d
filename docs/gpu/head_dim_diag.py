"""Which input breaks the compiled GPU kernel in the case `splits_bf16_gqa4` failed on (H200, 2026-11-26):
head_dim 8 in a 16-bit dtype, or the splits? Run on a GPU from the repository root, bypassing the kernel's own
refusal of those shapes (`check_gpu_head_dim`) by calling the jitted body with the check's dtype test failed."""

import dataclasses
import sys

import jax.numpy as jnp

sys.path.insert(0, ".")
from pallas_kernels import tree_attention as ta  # noqa: E402
from tests.test_tree_attention import CASES, make_inputs  # noqa: E402

ta.check_gpu_head_dim = lambda head_dim, dtype: None  # measure what the refused shapes would compute
base = CASES["splits_bf16_gqa4"]
for name, change in [("hd8 bf16 splits3", dict(head_dim=8)), ("hd8 bf16 splits1", dict(head_dim=8, k_splits=1)),
                     ("hd8 fp32 splits3", dict(head_dim=8, dtype="float32")), ("hd16 bf16 splits3", dict(head_dim=16)),
                     ("hd32 bf16 splits3", dict(head_dim=32))]:
    case = dataclasses.replace(base, **change)
    poisoned, clean = make_inputs(case)
    window = clean.pop("window")
    poisoned.pop("window")
    out = ta._tree_attention_pallas(**poisoned, window=jnp.int32(window), platform="gpu",
                                    settings=ta.KernelSettings(block_k=16, k_splits=case.k_splits))
    ref = ta.tree_attention_reference(**clean, window=window)
    diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    print(f"{name:20s} max abs diff {diff:.4f}")
