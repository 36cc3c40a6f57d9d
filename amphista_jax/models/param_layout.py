"""The target's parameter trees in their two layouts, and the pieces read from either without running the model.

`stacked` (training's): the layers on one leading `layers` axis (`params["layers"]`, run by `nn.scan`), each
projection's `kernel [in, out]`. `split` (decoding's, `split_layers`): one tree per layer (`layer_0`, ...), each
projection out-major (`weight [out, in]`, `projections.OutMajorDense`). Drafters and the target view read a layer's
params, the input embeddings and the output projection here, whichever layout the params are in.
"""

from __future__ import annotations

import jax


def projection_kernel(projection: dict) -> jax.Array:
    """A target projection's `[in, out]` kernel from its params in either layout."""
    return projection["kernel"] if "kernel" in projection else projection["weight"].T


def out_major(tree: dict) -> dict:
    """`tree` with every projection's `kernel [in, out]` as its `weight [out, in]`."""
    return {("weight" if k == "kernel" else k): v.T if k == "kernel" else out_major(v) if isinstance(v, dict) else v
            for k, v in tree.items()}


def split_layers(params: dict) -> dict:
    """The stacked layers `params["layers"]` as one parameter tree per layer (`layer_0`, ...), each projection
    out-major (`OutMajorDense`), for `Transformer(split=True)`: the same model without a loop over layers.

    Decoding reads the target in this layout (`hf.load_params(layout="split")` reads it without a stacked copy):
    under XLA:CPU a scanned stack's per-layer slice is a copy of that layer's weights made on every decode step,
    which halved the decode speed (docs/ar_decode.md). Training keeps the stacked layout (one compiled body).
    """
    stacked = params["layers"]
    n = jax.tree.leaves(stacked)[0].shape[0]
    return out_major({k: v for k, v in params.items() if k != "layers"} | {
        f"layer_{i}": jax.tree.map(lambda p, i=i: p[i], stacked) for i in range(n)})


def has_split_layers(params: dict) -> bool:
    """Whether the target params are in the `split_layers` layout (else stacked on a `layers` axis)."""
    return "layers" not in params


def layer_params(params: dict, i: int) -> dict:
    """Layer `i`'s params (negative counts from the last) in either layout."""
    if not has_split_layers(params):
        return jax.tree.map(lambda p: p[i], params["layers"])
    n = sum(k.startswith("layer_") for k in params)
    return params[f"layer_{i % n}"]


def input_embeddings(params: dict, tokens: jax.Array) -> jax.Array:
    """`[..., D]` the input embeddings of `tokens [...]` (any shape), in the params' dtype."""
    return params["embed"]["embedding"][tokens]


def output_projection(params: dict) -> jax.Array:
    """The `[D, V]` vocabulary projection (the transposed input embedding when the two are tied)."""
    if "lm_head" in params:
        return projection_kernel(params["lm_head"])
    return params["embed"]["embedding"].T
