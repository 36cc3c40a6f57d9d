"""Tree attention: the Pallas kernel against its dense reference, and the reference against hand-computed values.

`TreeAttentionTest` runs the kernel in interpret mode (CPU); `TreeAttentionDeviceTest` runs the same tests compiled
on a GPU/TPU and is skipped on CPU. Cache slots past lengths + T are filled with NaN so any read past the mask shows.
On CPU the compiled paths are still lowered for a GPU (Triton) and a TPU (Mosaic) from abstract shapes.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels.kernel_settings import KernelSettings
from pallas_kernels.tree_attention import (
    _tree_attention_pallas,
    tree_attention,
    tree_attention_reference,
    validate_inputs,
)
from tests.helpers import default_cases

TOLERANCES = {
    jnp.dtype(jnp.float32): dict(atol=1e-5, rtol=1e-5),
    jnp.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2),
}
reference = jax.jit(tree_attention_reference)  # eager dispatch of the reference costs more than the kernel


@dataclass(frozen=True)
class Case:
    """One kernel-vs-reference configuration."""

    lengths: tuple[int, ...]  # committed tokens per batch row
    num_slots: int = 48  # S
    num_new: int = 8  # T
    q_heads: int = 2
    kv_heads: int = 2
    head_dim: int = 16
    window: int = 0
    block_k: int = 16
    k_splits: int = 1
    padded_nodes: int = 0  # trailing tree nodes that only see themselves and that no real node sees
    dtype: str = "float32"


CASES = {
    "len0": Case(lengths=(0,), num_slots=32, num_new=5),
    # S = 45 is no multiple of block_k = 16: the last committed block [32, 48) is read as [29, 45) and must not
    # count slots 29..31 twice.
    "cache_end": Case(lengths=(38,), num_slots=45, num_new=7, q_heads=4, kv_heads=2),
    "tail_block_overlap": Case(lengths=(35, 2), num_slots=40, num_new=4, q_heads=4, kv_heads=2, window=9),
    "ragged_tail_S_and_T": Case(lengths=(3, 29), num_slots=40, num_new=11, q_heads=4, kv_heads=1),
    "block_k_over_S": Case(lengths=(5, 0), num_slots=24, num_new=6, block_k=32),
    "gqa1_ragged_batch": Case(lengths=(0, 17, 55), num_slots=64, num_new=9, block_k=32),
    "gqa2": Case(lengths=(12, 30), num_slots=48, num_new=10, q_heads=4, kv_heads=2, head_dim=8),
    "gqa4": Case(lengths=(31, 7), num_slots=48, num_new=13, q_heads=8, kv_heads=2, head_dim=8),
    "padded_nodes": Case(lengths=(9, 26), num_slots=40, num_new=12, padded_nodes=4),
    "window": Case(lengths=(20, 37), num_slots=64, num_new=8, window=5),
    "window_wider_than_context": Case(lengths=(4, 0), num_slots=32, num_new=9, window=40, padded_nodes=2),
    "large": Case(lengths=(50, 76), num_slots=96, num_new=20, q_heads=8, kv_heads=2, head_dim=32, window=13,
                  block_k=32, padded_nodes=3),
    "bf16": Case(lengths=(14, 33), num_slots=48, num_new=9, q_heads=4, kv_heads=2, dtype="bfloat16"),
    "bf16_window": Case(lengths=(40, 2), num_slots=64, num_new=12, q_heads=4, kv_heads=1, window=7,
                        padded_nodes=2, dtype="bfloat16"),
    # Flash-decoding splits. 5 blocks in 3 splits of 2 (the last split holds one): 37 ends inside split 1, and
    # row 1 (length 5) has nothing in splits 1 and 2.
    "splits_ragged": Case(lengths=(37, 5), num_slots=80, num_new=7, q_heads=4, kv_heads=2, k_splits=3),
    "splits_past_every_length": Case(lengths=(3, 10), num_slots=128, num_new=6, k_splits=4),
    "splits_over_blocks": Case(lengths=(50,), num_slots=64, num_new=9, k_splits=9),  # clamped to 4 splits
    "splits_tail_block": Case(lengths=(33, 40), num_slots=45, num_new=5, k_splits=2),  # tail read as [29, 45)
    "splits_window": Case(lengths=(60, 33), num_slots=96, num_new=8, window=20, padded_nodes=2, k_splits=5),
    "splits_bf16_gqa4": Case(lengths=(70, 21), num_slots=96, num_new=10, q_heads=8, kv_heads=2, head_dim=16,
                             k_splits=3, dtype="bfloat16"),
}


def random_tree(rng: np.random.Generator, num_new: int, padded: int) -> tuple[np.ndarray, np.ndarray]:
    """(ancestor-or-self mask [T, T] bool, depth [T]) of a random tree; the last `padded` nodes see only
    themselves and are nobody's ancestor, like the padding of a fixed-size tree buffer."""
    real = num_new - padded
    parent = [-1] + [int(rng.integers(0, j)) for j in range(1, real)]
    mask = np.eye(num_new, dtype=bool)
    depth = np.zeros(num_new, np.int32)
    for node in range(1, real):
        mask[node] |= mask[parent[node]]
        depth[node] = depth[parent[node]] + 1
    return mask, depth


def make_inputs(case: Case, seed: int = 0) -> tuple[dict, dict]:
    """(kernel inputs with NaN in unused slots, the same inputs with those slots finite)."""
    rng = np.random.default_rng(seed)
    batch = len(case.lengths)
    lengths = np.asarray(case.lengths, np.int32)
    assert (lengths + case.num_new <= case.num_slots).all(), case
    dtype = jnp.dtype(case.dtype)
    cache_shape = (batch, case.num_slots, case.kv_heads, case.head_dim)
    q = rng.normal(size=(batch, case.num_new, case.q_heads, case.head_dim))
    k, v = rng.normal(size=cache_shape), rng.normal(size=cache_shape)
    trees = [random_tree(rng, case.num_new, case.padded_nodes) for _ in range(batch)]
    tree_mask = np.stack([mask for mask, _ in trees])
    q_positions = lengths[:, None] + np.stack([depth for _, depth in trees])
    clean = dict(q=jnp.asarray(q, dtype), k_cache=jnp.asarray(k, dtype), v_cache=jnp.asarray(v, dtype),
                 lengths=jnp.asarray(lengths), tree_mask=jnp.asarray(tree_mask),
                 q_positions=jnp.asarray(q_positions, jnp.int32), window=case.window)
    unused = np.arange(case.num_slots)[None, :] >= (lengths + case.num_new)[:, None]  # [B, S]
    poisoned = dict(clean)
    for name in ("k_cache", "v_cache"):
        poisoned[name] = jnp.where(unused[:, :, None, None], jnp.nan, clean[name]).astype(dtype)
    return poisoned, clean


class TreeAttentionTest:
    __test__ = True  # collected although the name does not start with "Test"
    INTERPRET = True

    def run_kernel(self, inputs: dict, **kwargs) -> jax.Array:
        return tree_attention(**inputs, interpret=self.INTERPRET, backend="pallas", **kwargs)

    @pytest.mark.parametrize("name", sorted(CASES))
    @default_cases('splits_bf16_gqa4', 'splits_window', 'cache_end', 'ragged_tail_S_and_T')
    def test_kernel_matches_reference(self, name: str):
        """Each kernel feature runs in one default case: splits in bf16 with GQA (splits_bf16_gqa4), a window with
        splits and padded nodes (splits_window), the cache's end inside the last block (cache_end), ragged S and T
        tails (ragged_tail_S_and_T); the other cases recombine them and run under -m slow."""
        case = CASES[name]
        poisoned, clean = make_inputs(case)
        out = self.run_kernel(poisoned, settings=KernelSettings(block_k=case.block_k, k_splits=case.k_splits))
        expected = reference(**clean)
        assert out.dtype == expected.dtype == jnp.dtype(case.dtype)
        assert np.isfinite(np.asarray(out, np.float32)).all(), "NaN from unused cache slots leaked"
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                                   **TOLERANCES[out.dtype])

    def test_reference_ignores_nan_in_unused_slots(self):
        poisoned, clean = make_inputs(CASES["padded_nodes"])
        np.testing.assert_array_equal(reference(**poisoned), reference(**clean))

    def test_traced_window_from_scan(self):
        """`window` is a traced int32 scalar scanned over layers; one compiled kernel serves every value."""
        case = CASES["window"]
        poisoned, clean = make_inputs(case)
        windows = jnp.asarray([0, 3, 9], jnp.int32)

        def layer(carry, window):
            out = self.run_kernel(poisoned | dict(window=window), settings=KernelSettings(block_k=case.block_k))
            return carry, out

        _, outs = jax.jit(lambda w: jax.lax.scan(layer, 0, w))(windows)
        for window, out in zip(windows.tolist(), outs, strict=True):
            expected = reference(**(clean | dict(window=window)))
            np.testing.assert_allclose(out, expected, **TOLERANCES[out.dtype])

    @pytest.mark.parametrize("k_splits", [1, 4])
    def test_fully_masked_row_is_zero(self, k_splits: int):
        """Not valid use (a node always sees itself), but the kernel must give 0, not NaN (with splits: every
        split's partial empty for that row)."""
        poisoned, clean = make_inputs(Case(lengths=(0,), num_slots=64, num_new=4))
        tree_mask = poisoned["tree_mask"].at[0, 2].set(False)
        out = self.run_kernel(poisoned | dict(tree_mask=tree_mask), settings=KernelSettings(block_k=16,
                                                                                            k_splits=k_splits))
        expected = reference(**(clean | dict(tree_mask=tree_mask)))
        np.testing.assert_array_equal(out[0, 2], 0.0)
        np.testing.assert_allclose(out, expected, **TOLERANCES[out.dtype])

    def test_xla_backend_is_reference(self):
        poisoned, clean = make_inputs(CASES["gqa2"])
        out = tree_attention(**poisoned, backend="xla")
        np.testing.assert_array_equal(out, tree_attention_reference(**clean))


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="compiled Pallas needs a GPU or TPU")
class TreeAttentionDeviceTest(TreeAttentionTest):
    INTERPRET = False


# ----------------------------------------------------------------------------------------------------------------
# The reference by hand: one row, lengths = 1, T = 2 chain nodes, S = 4 (slot 3 unused, NaN), Dh = 4 (scale 1/2).
# Slot keys are 2 * e_slot and values e_slot, so a query e_j scores 1 on slot j and 0 elsewhere.
# ----------------------------------------------------------------------------------------------------------------

E = math.e


def hand_example(window: int) -> jax.Array:
    eye = np.eye(4, dtype=np.float32)
    cache = np.where(np.arange(4)[:, None] < 3, eye, np.nan)  # slot 3 unused
    q = np.stack([eye[0], eye[2]])[None, :, None, :]  # [1, 2, 1, 4]: node 0 asks for slot 0, node 1 for slot 2
    k = (2 * cache)[None, :, None, :]  # [1, 4, 1, 4]
    v = cache[None, :, None, :]
    tree_mask = np.array([[[True, False], [True, True]]])
    out = tree_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray([1]),
                                   jnp.asarray(tree_mask), jnp.asarray([[1, 2]]), window)
    return out[0, :, 0, :]  # [T, Dh]


@pytest.mark.parametrize(
    "window, expected",
    [
        # node 0 sees slots 0, 1 with scores (1, 0); node 1 sees slots 0, 1, 2 with scores (0, 0, 1).
        (0, [[E / (E + 1), 1 / (E + 1), 0, 0], [1 / (E + 2), 1 / (E + 2), E / (E + 2), 0]]),
        # key positions 0, 1, 2 for slots 0, 1, 2: node 0 (position 1) keeps slot 1, node 1 (position 2) slot 2.
        (1, [[0, 1, 0, 0], [0, 0, 1, 0]]),
        # node 0 keeps slots 0, 1; node 1 keeps slots 1, 2 with scores (0, 1).
        (2, [[E / (E + 1), 1 / (E + 1), 0, 0], [0, 1 / (E + 1), E / (E + 1), 0]]),
    ],
)
def test_reference_by_hand(window: int, expected: list[list[float]]):
    np.testing.assert_allclose(hand_example(window), np.asarray(expected, np.float32), atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# validate_inputs
# ----------------------------------------------------------------------------------------------------------------


def valid_inputs() -> dict:
    _, clean = make_inputs(Case(lengths=(3, 5), num_slots=16, num_new=4, q_heads=4, kv_heads=2, head_dim=8))
    return clean


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda x: dict(q=x["q"][0]), "q must have rank 4"),
        (lambda x: dict(k_cache=x["k_cache"][..., 0]), "k_cache must have rank 4"),
        (lambda x: dict(v_cache=x["v_cache"][:, :8]), "k_cache and v_cache must have the same shape"),
        (lambda x: dict(q=x["q"][:, :, :3]), "num_q_heads=3 must be a positive multiple of num_kv_heads=2"),
        (lambda x: dict(q=x["q"][:1]), "k_cache batch must match q batch"),
        (lambda x: dict(q=x["q"][..., :4]), "k_cache head_dim must match q head_dim"),
        (lambda x: dict(k_cache=x["k_cache"][:, :3], v_cache=x["v_cache"][:, :3]), "num_new=4 new tokens"),
        (lambda x: dict(lengths=x["lengths"][:1]), r"lengths must have shape \(2,\)"),
        (lambda x: dict(lengths=x["lengths"].astype(jnp.float32)), "lengths must be an integer array"),
        (lambda x: dict(tree_mask=x["tree_mask"].astype(jnp.int32)), "tree_mask must be bool"),
        (lambda x: dict(tree_mask=x["tree_mask"][:, :3]), r"tree_mask must have shape \(2, 4, 4\)"),
        (lambda x: dict(q_positions=x["q_positions"][:, :3]), r"q_positions must have shape \(2, 4\)"),
        (lambda x: dict(q_positions=x["q_positions"].astype(jnp.float32)), "q_positions must be an integer"),
        (lambda x: dict(window=-1), "window=-1 must be >= 0"),
        (lambda x: dict(window=jnp.ones(2, jnp.int32)), "window must be an integer scalar"),
    ],
)
def test_validate_inputs_raises(change, message: str):
    inputs = valid_inputs()
    bad = inputs | change(inputs)
    with pytest.raises(ValueError, match=message):
        validate_inputs(**bad)
    with pytest.raises(ValueError, match=message):
        tree_attention(**bad)


def test_validate_inputs_accepts_valid():
    validate_inputs(**valid_inputs())


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(block_k=0), "block_k=0 must be a positive integer"),
        (dict(k_splits=-2), "k_splits=-2 must be a positive integer"),
        (dict(num_warps=2.0), "num_warps=2.0 must be a positive integer"),
        (dict(min_programs=True), "min_programs=True must be a positive integer"),
    ],
)
def test_kernel_settings_raise(settings: dict, message: str):
    with pytest.raises(ValueError, match=message):
        KernelSettings(**settings)


@pytest.mark.parametrize(
    "settings, num_slots, programs, platform, expected",
    [
        (dict(block_k=128), 4096, 8, "gpu", (16, 2)),  # 32 blocks, 17 splits wanted (8 * 17 >= 132): 16 of 2
        (dict(block_k=128), 4096, 8, "tpu", (1, 32)),
        (dict(block_k=128), 4096, 8, "cpu", (1, 32)),
        (dict(block_k=128), 4096, 256, "gpu", (1, 32)),  # enough programs already
        (dict(block_k=16, k_splits=3), 80, 2, "cpu", (3, 2)),
        (dict(block_k=16, k_splits=9), 64, 1, "gpu", (4, 1)),
        (dict(block_k=32), 24, 1, "cpu", (1, 1)),  # block_k over S: one block of S
        (dict(block_k=32), 24, 1, "gpu", (2, 1)),  # on GPU a power-of-two block within S: 16, two of them
    ],
)
def test_kernel_settings_splits(settings: dict, num_slots: int, programs: int, platform: str,
                                expected: tuple[int, int]):
    k_splits, per_split = KernelSettings(**settings).splits(num_slots, programs, platform)
    assert (k_splits, per_split) == expected


@pytest.mark.parametrize(("settings", "num_slots", "message"), [
    (dict(block_k=48), 512, "power of two >= 16"), (dict(block_k=8), 512, "power of two >= 16"),
    (dict(), 12, "use the xla backend")])
def test_gpu_block_sizes_are_checked(settings: dict, num_slots: int, message: str):
    with pytest.raises(ValueError, match=message):
        KernelSettings(**settings).splits(num_slots, 8, "gpu")


@pytest.mark.parametrize(("head_dim", "dtype", "refused"), [
    (8, jnp.bfloat16, True), (8, jnp.float16, True), (16, jnp.bfloat16, False), (8, jnp.float32, False)])
def test_gpu_refuses_16_bit_head_dims_below_16(head_dim: int, dtype, refused: bool):
    """Triton's 16-bit dot contracts over >= 16 elements: compiled on an H200 at head_dim 8 in bf16 the kernel gave
    wrong outputs (max abs error 1.3), so the GPU path refuses those shapes before compiling; the trace-time check
    is the one `_tree_attention_pallas` runs."""
    case = Case(lengths=(5,), num_slots=32, num_new=4, head_dim=head_dim, dtype=jnp.dtype(dtype).name)
    poisoned, _ = make_inputs(case)
    window = poisoned.pop("window")
    trace = functools.partial(_tree_attention_pallas.trace, **poisoned, window=jnp.int32(window),
                              settings=KernelSettings(block_k=16), platform="gpu")
    if refused:
        with pytest.raises(ValueError, match="use the xla backend"):
            trace()
    else:
        trace()


def lower_kernel(platform: str, lowering_platform: str, num_slots: int = 512, dtype=jnp.bfloat16) -> str:
    """StableHLO of the kernel lowered for another platform from abstract Vicuna-7B-like shapes (no device)."""
    batch, num_new, heads, head_dim = 2, 64, 8, 128
    abstract = jax.ShapeDtypeStruct
    args = (abstract((batch, num_new, heads, head_dim), dtype), abstract((batch, num_slots, heads, head_dim), dtype),
            abstract((batch, num_slots, heads, head_dim), dtype), abstract((batch,), jnp.int32),
            abstract((batch, num_new, num_new), jnp.bool_), abstract((batch, num_new), jnp.int32),
            abstract((), jnp.int32))
    traced = _tree_attention_pallas.trace(*args, settings=KernelSettings(), platform=platform)
    return traced.lower(lowering_platforms=(lowering_platform,)).as_text()


@pytest.mark.parametrize("num_slots", [512, 88, 4160])  # a multiple of block_k, under it (block 64), past it
def test_kernel_lowers_for_gpu_with_triton(num_slots: int):
    calls = set(re.findall(r"custom_call @([\w$.]+)", lower_kernel("gpu", "cuda", num_slots)))
    assert calls == {"__gpu$xla.gpu.triton"}


@pytest.mark.parametrize("device_kind", ["TPU v5p", "TPU v5 lite"])
def test_kernel_lowers_for_tpu_with_mosaic(device_kind: str):
    """Mosaic's lowering checks block shapes against the chip's tiling; the abstract mesh names the chip."""
    chip = AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=chip)):
        calls = set(re.findall(r"custom_call @([\w$.]+)", lower_kernel("tpu", "tpu")))
    assert calls == {"tpu_custom_call"}


def test_kernel_benchmark_smoke(tmp_path):
    """The GPU benchmark script runs end to end (interpreted, tiny) and its kernel agrees with the XLA path."""
    from amphista_jax.evals.benchmarks import tree_attention_kernel

    args = ["--interpret", "--nodes", "5", "--context", "20", "--batch", "2", "--q-heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--k-splits", "auto", "2", "--runs", "1", "--out", str(tmp_path)]
    tree_attention_kernel.main(args)
    rows = json.loads((tmp_path / "tree_attention_kernel.json").read_text())["rows"]
    assert [r["k_splits"] for r in rows] == ["auto", 2]
    assert all(r["max_abs_diff"] < 5e-2 for r in rows)  # bf16
    assert "not a speed measurement" in (tmp_path / "tree_attention_kernel.md").read_text()
    with pytest.raises(SystemExit, match="pass --interpret"):
        tree_attention_kernel.main(["--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="positive integers"):
        tree_attention_kernel.main(["--interpret", "--k-splits", "0", "--out", str(tmp_path)])


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="backend='cuda' must be one of"):
        tree_attention(**valid_inputs(), backend="cuda")
