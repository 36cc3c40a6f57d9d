"""Tree attention over a KV cache: a Pallas kernel beside its dense jnp reference.

One decode step of tree speculative decoding scores T new tokens (the nodes of a draft tree) at once. Their
keys/values are already written into the cache at slots [lengths[b], lengths[b] + T); everything before
`lengths[b]` is committed context that every new token sees; among the new tokens `tree_mask[b, i, j]` says
whether query i sees node j (its ancestors and itself). Slots at or past lengths[b] + T are unused: never read
into the result (they may hold garbage, even NaN).

Example, lengths[b] = 3, S = 8, T = 3 nodes: n0 is the root, n1 and n2 are its two children
(q_positions = [3, 4, 4]).

                     committed   new: n0 n1 n2   unused
    slot:             0  1  2  |     3  4  5   |  6  7
    query n0 (t=0):   1  1  1  |     1  .  .   |  .  .
    query n1 (t=1):   1  1  1  |     1  1  .   |  .  .
    query n2 (t=2):   1  1  1  |     1  .  1   |  .  .

With a sliding window (HF semantics, `window > 0`), a key is also required to satisfy
q_positions[b, t] - key_pos < window, where key_pos is the slot index for committed slots and the node's
q_position for new-token slots. With window = 3 the row of n1 (position 4) keeps key positions 2, 3, 4:

    query n1 (t=1):   .  .  1  |     1  1  .   |  .  .

Shapes: q [B, T, Hq, Dh]; k_cache, v_cache [B, S, Hkv, Dh]; lengths [B]; tree_mask [B, T, T];
q_positions [B, T]; window a scalar (may be traced, 0 = no window). Query head h reads kv head h // (Hq // Hkv).
Scores are scaled by 1/sqrt(Dh); softmax and accumulation are fp32; the output has q's dtype. A query that sees
no key at all (never in valid use: a node always sees itself) gets a zero output, not NaN.

The kernel runs one program per (batch row, kv head, split) over the T * G query rows of that head's group
(G = Hq // Hkv, processed together so each cache block is loaded once per group). Flash-decoding: the committed
prefix's `block_k`-slot blocks are dealt out to `k_splits` programs in contiguous runs; each runs an online
softmax over its run, cut to cdiv(lengths[b], block_k) (a split past a row's length loads nothing) and, with a
window, to the blocks some query can still reach; split 0 also folds in the T new tokens. The splits' (max,
denominator, unnormalised output) partials are merged outside the kernel (`online_softmax.combine_splits`).
The wrapper slices the T new slots out of the cache (cheap: T is small), so their visibility is a plain
[T*G, T] mask with no gather inside the kernel. Query rows and new tokens are zero-padded to a power of two >= 16
(Triton tile sizes); S needs no padding: the last block overlaps its neighbour. `KernelSettings` holds the block
sizes and launch settings (`kernel_settings.py`).

One kernel body serves every platform, its compiler chosen by the backend: Triton on GPU (block_k a power of two
>= 16, cut to the largest such power within S; head_dim >= 16 in 16-bit dtypes, refused below), Mosaic on TPU
(where the last two dimensions of every block must tile by (8, 128): head_dim a multiple of 128, as in
Llama-family models, or a single kv head), the interpreter on CPU. On TPU each program's whole [S, Dh] row is
copied into VMEM before it runs, whatever `lengths[b]` is, so splits and the length cut save compute there but
not HBM traffic (`k_splits` defaults to 1 on TPU); a variant that DMAs only the visited blocks is not written.
The kernel tests compare it with the reference on every backend they run on; docs/gpu/README.md records the GPU
runs."""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.dense_attention import apply_window, dot_product_attention, key_visibility
from pallas_kernels.kernel_settings import KernelSettings, check_gpu_head_dim, compiler_params
from pallas_kernels.online_softmax import NEG_INF, combine_splits, dot_nt, online_softmax_step

Backend = Literal["auto", "pallas", "xla"]
BACKENDS: tuple[str, ...] = ("auto", "pallas", "xla")
_DEFAULT_SETTINGS = KernelSettings()


# ----------------------------------------------------------------------------------------------------------------
# Input validation, shared by the kernel and the reference.
# ----------------------------------------------------------------------------------------------------------------


def _check_rank(name: str, x: jax.Array, rank: int) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank}, got {x.shape=}")


def _check_shape(name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {expected}, got {tuple(shape)}")


def _check_integer(name: str, x: jax.Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array, got {x.dtype=}")


def validate_inputs(
    q: jax.Array,  # [B, T, Hq, Dh]
    k_cache: jax.Array,  # [B, S, Hkv, Dh]
    v_cache: jax.Array,  # [B, S, Hkv, Dh]
    lengths: jax.Array,  # [B] int
    tree_mask: jax.Array,  # [B, T, T] bool
    q_positions: jax.Array,  # [B, T] int
    window: int | jax.Array = 0,  # [] int, may be traced
) -> None:
    """Raise ValueError unless the inputs have the shapes and dtypes that tree attention expects.

    Checks only static facts (shapes, dtypes, a concrete `window`); `lengths + T <= S` is the caller's promise.
    """
    _check_rank("q", q, 4)
    _check_rank("k_cache", k_cache, 4)
    _check_rank("v_cache", v_cache, 4)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {k_cache.shape=} {v_cache.shape=}")
    batch, num_new, num_q_heads, head_dim = q.shape
    cache_batch, num_slots, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_batch != batch:
        raise ValueError(f"k_cache batch must match q batch, got {cache_batch=} {batch=}")
    if cache_head_dim != head_dim:
        raise ValueError(f"k_cache head_dim must match q head_dim, got {cache_head_dim=} {head_dim=}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be a positive multiple of {num_kv_heads=}")
    if num_new == 0:
        raise ValueError(f"q must hold at least one new token, got {q.shape=}")
    if num_new > num_slots:
        raise ValueError(f"{num_new=} new tokens must fit in the cache: need num_new <= {num_slots=}")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating array, got {x.dtype=}")
    _check_shape("lengths", lengths.shape, (batch,))
    _check_integer("lengths", lengths)
    _check_shape("tree_mask", tree_mask.shape, (batch, num_new, num_new))
    if tree_mask.dtype != jnp.bool_:
        raise ValueError(f"tree_mask must be bool, got {tree_mask.dtype=}")
    _check_shape("q_positions", q_positions.shape, (batch, num_new))
    _check_integer("q_positions", q_positions)
    _validate_window(window)


def _validate_window(window: int | jax.Array) -> None:
    if isinstance(window, bool):
        raise ValueError(f"window must be an integer scalar, got {window=}")
    if isinstance(window, int | np.integer):
        if window < 0:
            raise ValueError(f"{window=} must be >= 0 (0 = no sliding window)")
        return
    window = jnp.asarray(window)
    if window.ndim != 0 or not jnp.issubdtype(window.dtype, jnp.integer):
        raise ValueError(f"window must be an integer scalar, got {window.shape=} {window.dtype=}")


# ----------------------------------------------------------------------------------------------------------------
# Dense reference.
# ----------------------------------------------------------------------------------------------------------------


def tree_attention_reference(
    q: jax.Array,  # [B, T, Hq, Dh]
    k_cache: jax.Array,  # [B, S, Hkv, Dh]
    v_cache: jax.Array,  # [B, S, Hkv, Dh]
    lengths: jax.Array,  # [B]
    tree_mask: jax.Array,  # [B, T, T] bool
    q_positions: jax.Array,  # [B, T]
    window: int | jax.Array = 0,  # []
) -> jax.Array:  # [B, T, Hq, Dh]
    """Dense tree attention with fp32 scores, softmax and accumulation: the model's own XLA path (the same
    mask and attention functions), so kernel-vs-reference tests compare the kernel with what the model runs."""
    validate_inputs(q, k_cache, v_cache, lengths, tree_mask, q_positions, window)
    visible, distance = key_visibility(q_positions.astype(jnp.int32), tree_mask, lengths.astype(jnp.int32),
                                       k_cache.shape[1])
    return dot_product_attention(q, k_cache, v_cache, apply_window(visible, distance, jnp.asarray(window, jnp.int32)))


# ----------------------------------------------------------------------------------------------------------------
# Pallas kernel.
# ----------------------------------------------------------------------------------------------------------------


def _tree_attention_kernel(
    length_ref,  # [1] int32: lengths[b] (a [B] SMEM array on TPU: read at program_id(0))
    window_ref,  # [1] int32
    q_ref,  # [R, Dh]: the T * G query rows of one kv head (row t * G + g), zero-padded to R
    k_ref,  # [S, Dh]: the whole cache of one (row, kv head)
    v_ref,  # [S, Dh]
    k_new_ref,  # [Tp, Dh]: the T new tokens' keys (cache slots [lengths[b], lengths[b] + T)), zero-padded to Tp
    v_new_ref,  # [Tp, Dh]
    new_mask_ref,  # [R, Tp] int32: tree & window visibility among the new tokens, 0 in padding
    q_pos_ref,  # [R, 1] int32
    m_ref,  # [R, 1] fp32: this split's running max
    l_ref,  # [R, 1] fp32: its softmax denominator
    acc_ref,  # [R, Dh] fp32: its unnormalised output
    *,
    sm_scale: float,
    block_k: int,
    blocks_per_split: int,
    scalar_row: bool,
) -> None:
    length = length_ref[pl.program_id(0) if scalar_row else 0]
    window = window_ref[0]
    split = pl.program_id(2)
    q = q_ref[...]
    q_pos = q_pos_ref[...]  # [R, 1]
    num_rows, head_dim = q.shape
    num_slots = k_ref.shape[0]

    def committed_block(i, carry):
        nominal = i * block_k
        # The tail block is read as [S - bk, S) instead of past S; slots below `nominal` were counted already.
        start = jnp.minimum(nominal, num_slots - block_k)
        cols = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)  # [1, bk]
        rows = start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)  # [bk, 1]
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        v = jnp.where((rows >= nominal) & (rows < length), v, jnp.zeros_like(v))  # 0 * NaN = NaN otherwise
        in_window = (window <= 0) | (q_pos - cols < window)  # [R, bk]
        visible = (cols >= nominal) & (cols < length) & in_window
        return online_softmax_step(carry, dot_nt(q, k) * sm_scale, visible, v)

    # This split's blocks, cut to the committed prefix (blocks past it are never loaded) and, with a window, to
    # the blocks some row can still reach. A split past every row's length runs no block.
    first_visible = jnp.maximum(jnp.min(q_pos) - window + 1, 0)  # oldest committed slot any row may see
    lo = jnp.maximum(split * blocks_per_split, jnp.where(window > 0, first_visible // block_k, 0))
    hi = jnp.minimum((split + 1) * blocks_per_split, pl.cdiv(length, block_k))
    carry = (
        jnp.full((num_rows, 1), NEG_INF, jnp.float32),
        jnp.zeros((num_rows, 1), jnp.float32),
        jnp.zeros((num_rows, head_dim), jnp.float32),
    )
    carry = lax.fori_loop(lo, hi, committed_block, carry)

    # The new tokens belong to split 0 (every split computes the same small step; the others see none of it).
    k_new, v_new = k_new_ref[...], v_new_ref[...]
    new_visible = (new_mask_ref[...] != 0) & (split == 0)
    m_ref[...], l_ref[...], acc_ref[...] = online_softmax_step(carry, dot_nt(q, k_new) * sm_scale, new_visible,
                                                                v_new)


def _new_token_mask(
    tree_mask: jax.Array,  # [B, T, T] bool
    q_positions: jax.Array,  # [B, T] int32
    window: jax.Array,  # [] int32
) -> jax.Array:  # [B, T, T] bool
    """Visibility among the new tokens: the tree, cut by the sliding window."""
    distance = q_positions[:, :, None] - q_positions[:, None, :]
    return tree_mask & ((window <= 0) | (distance < window))


def _new_token_slots(cache: jax.Array, lengths: jax.Array, num_new: int) -> jax.Array:
    """The new tokens' entries of a cache: [B, S, K, Dh] -> [B, T, K, Dh], slots [lengths[b], lengths[b] + T)."""
    return jax.vmap(lambda c, n: lax.dynamic_slice_in_dim(c, n, num_new, axis=0))(cache, lengths)


def _tile_size(n: int) -> int:
    """Rows and new tokens are padded to a power of two >= 16, the smallest tile a Triton dot takes."""
    return max(16, pl.next_power_of_2(n))


def _pad_axis(x: jax.Array, axis: int, size: int, mode: str = "constant") -> jax.Array:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, mode=mode)


@functools.partial(jax.jit, static_argnames=("settings", "platform"))
def _tree_attention_pallas(
    q: jax.Array,  # [B, T, Hq, Dh]
    k_cache: jax.Array,  # [B, S, Hkv, Dh]
    v_cache: jax.Array,  # [B, S, Hkv, Dh]
    lengths: jax.Array,  # [B]
    tree_mask: jax.Array,  # [B, T, T] bool
    q_positions: jax.Array,  # [B, T]
    window: jax.Array,  # []
    *,
    settings: KernelSettings,
    platform: str,  # "gpu", "tpu", or "cpu" (interpret mode)
) -> jax.Array:  # [B, T, Hq, Dh]
    batch, num_new, num_q_heads, head_dim = q.shape
    num_slots, num_kv_heads = k_cache.shape[1:3]
    group = num_q_heads // num_kv_heads
    if platform == "gpu":
        check_gpu_head_dim(head_dim, q.dtype)
    rows, padded_rows, padded_new = num_new * group, _tile_size(num_new * group), _tile_size(num_new)
    block_k = settings.block_size(num_slots, platform)
    k_splits, blocks_per_split = settings.splits(num_slots, batch * num_kv_heads, platform)
    lengths = lengths.astype(jnp.int32)
    q_positions = q_positions.astype(jnp.int32)
    window = jnp.asarray(window, jnp.int32).reshape(1)

    # Query rows of one kv head side by side: [B, T, K, G, Dh] -> [B, K, T * G, Dh], row t * G + g.
    q_rows = q.reshape(batch, num_new, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    q_rows = _pad_axis(q_rows.reshape(batch, num_kv_heads, rows, head_dim), 2, padded_rows)
    new_mask = jnp.repeat(_new_token_mask(tree_mask, q_positions, window[0]), group, axis=1)  # [B, T * G, T]
    new_mask = _pad_axis(_pad_axis(new_mask.astype(jnp.int32), 1, padded_rows), 2, padded_new)  # [B, R, Tp]
    # Padded rows repeat the last position so they do not move the window's first block.
    q_pos_rows = _pad_axis(jnp.repeat(q_positions, group, axis=1), 1, padded_rows, mode="edge")[:, :, None]
    # Heads side by side on the last axis ([B, S, K * Dh], a free reshape): a kv head's block is [S, Dh], whose
    # last two dimensions Mosaic can tile (a squeezed head axis there it cannot).
    def flat(x: jax.Array) -> jax.Array:  # [B, N, K, Dh] -> [B, N, K * Dh]
        return x.reshape(*x.shape[:2], num_kv_heads * head_dim)

    k_new = _pad_axis(flat(_new_token_slots(k_cache, lengths, num_new)), 1, padded_new)  # [B, Tp, K * Dh]
    v_new = _pad_axis(flat(_new_token_slots(v_cache, lengths, num_new)), 1, padded_new)

    scalar_row = platform == "tpu"  # scalars live in SMEM there, whole
    if scalar_row:
        per_row = scalar = pl.BlockSpec(memory_space=pltpu.SMEM)
    else:
        per_row = pl.BlockSpec((1,), lambda b, h, s: (b,))
        scalar = pl.BlockSpec((1,), lambda b, h, s: (0,))
    rows_of_head = pl.BlockSpec((None, None, padded_rows, head_dim), lambda b, h, s: (b, h, 0, 0))
    cache = pl.BlockSpec((None, num_slots, head_dim), lambda b, h, s: (b, 0, h))
    new_slots = pl.BlockSpec((None, padded_new, head_dim), lambda b, h, s: (b, 0, h))
    kernel = functools.partial(_tree_attention_kernel, sm_scale=1.0 / math.sqrt(head_dim), block_k=block_k,
                               blocks_per_split=blocks_per_split, scalar_row=scalar_row)
    # Each split's (max, denominator, unnormalised output): [B, K, P, R, 1], [B, K, P, R, 1], [B, K, P, R, Dh].
    widths = (1, 1, head_dim)
    partials = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, k_splits),
        in_specs=[
            per_row,  # lengths
            scalar,  # window
            rows_of_head,  # q rows
            cache,  # k_cache
            cache,  # v_cache
            new_slots,  # k_new
            new_slots,  # v_new
            pl.BlockSpec((None, padded_rows, padded_new), lambda b, h, s: (b, 0, 0)),  # new-token mask
            pl.BlockSpec((None, padded_rows, 1), lambda b, h, s: (b, 0, 0)),  # query positions
        ],
        out_specs=[pl.BlockSpec((None, None, None, padded_rows, w), lambda b, h, s: (b, h, s, 0, 0)) for w in widths],
        out_shape=[jax.ShapeDtypeStruct((batch, num_kv_heads, k_splits, padded_rows, w), jnp.float32)
                   for w in widths],
        interpret=platform == "cpu",
        compiler_params=compiler_params(platform, settings),
        name="tree_attention",
    )(lengths, window, q_rows, flat(k_cache), flat(v_cache), k_new, v_new, new_mask, q_pos_rows)
    out = combine_splits(*partials)[:, :, :rows].astype(q.dtype)  # [B, K, T * G, Dh]
    out = out.reshape(batch, num_kv_heads, num_new, group, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(q.shape)


def _resolve_platform(backend: str, interpret: bool | None) -> str:
    """The platform whose kernel runs ("gpu", "tpu", or "cpu" for interpret mode), or "xla" for the reference."""
    if backend not in BACKENDS:
        raise ValueError(f"{backend=} must be one of {BACKENDS}")
    if backend == "xla":
        return "xla"
    device = jax.default_backend()
    on_cpu = device == "cpu"
    if interpret is None:
        interpret = on_cpu
    if on_cpu and not interpret:
        raise ValueError(f"{interpret=} needs a GPU or TPU; on CPU the Pallas kernel runs only with interpret=True")
    return "cpu" if interpret else ("tpu" if device == "tpu" else "gpu")


def tree_attention(
    q: jax.Array,  # [B, T, Hq, Dh]
    k_cache: jax.Array,  # [B, S, Hkv, Dh]
    v_cache: jax.Array,  # [B, S, Hkv, Dh]
    lengths: jax.Array,  # [B]
    tree_mask: jax.Array,  # [B, T, T] bool
    q_positions: jax.Array,  # [B, T]
    window: int | jax.Array = 0,  # [], may be traced
    *,
    settings: KernelSettings = _DEFAULT_SETTINGS,
    interpret: bool | None = None,
    backend: Backend = "auto",
) -> jax.Array:  # [B, T, Hq, Dh]
    """Tree attention of T new tokens over a KV cache that already holds their keys/values.

    backend: "xla" runs `tree_attention_reference`; "pallas" and "auto" run the Pallas kernel (on CPU in
    interpret mode). interpret: None means True on CPU and False on GPU/TPU.
    """
    validate_inputs(q, k_cache, v_cache, lengths, tree_mask, q_positions, window)
    platform = _resolve_platform(backend, interpret)
    if platform == "xla":
        return tree_attention_reference(q, k_cache, v_cache, lengths, tree_mask, q_positions, window)
    return _tree_attention_pallas(q, k_cache, v_cache, lengths, tree_mask, q_positions,
                                  jnp.asarray(window, jnp.int32), settings=settings, platform=platform)
