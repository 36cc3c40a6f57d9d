"""Draft heads people have already trained, read from the layouts their reference repositories release, into our
drafters' params (`amphista-jax convert --heads-from FORMAT DIR --model TARGET --out HEADS`).

`medusa` (FasterDecoding/Medusa): `config.json` (`medusa_num_heads`, `medusa_num_layers`) beside
`medusa_lm_head.safetensors` or `medusa_lm_head.pt` (read without torch: `models/torch_files.py`). Head `i` is
`nn.Sequential(ResBlock x n, Linear(D, V, bias=False))`: keys `{i}.{j}.linear.weight [D, D]` and
`{i}.{j}.linear.bias [D]` for its ResBlocks `j < n` (`x + SiLU(W x + b)`, torch's `[out, in]` layout) and
`{i}.{n}.weight [V, D]`, the head's own vocabulary projection: exactly our `Medusa` (its paper's form,
`shared_lm_head=False`), with `w = W^T`. A `medusa_head.` prefix (a whole model's state dict) is accepted.

`eagle` (SafeAILab/EAGLE, EAGLE-1/2 heads; `eagle/model/cnets1.py`): `config.json` (the target's Llama config
with `num_hidden_layers: 1`) beside `pytorch_model.bin` or `model.safetensors`: `fc.weight [D, 2D]` (+ `fc.bias`)
over `[E(token) ; feature]`, then `layers.0.{self_attn,mlp}.*` and `layers.0.post_attention_layernorm.weight` (the
first layer has no input norm: our `Eagle(input_norm=False)`); the target's own `lm_head` gives the logits.
`embed_tokens.weight`, a copy of the target's, is ignored. The draft layer's RoPE base is its config's, 10000 where it
names none (`draft_rope_theta`), whatever the target's.

`eagle3` (SafeAILab/EAGLE `eagle/model/cnets.py`, SpecForge; speculators' layout too, `read_eagle3`): `config.json`
(`draft_vocab_size`) beside the same files: `fc.weight [D, 3D]` (no bias), `midlayer.{self_attn,mlp}.*` (q/k/v read
`2D`), `midlayer.input_layernorm` (on the embedding), `midlayer.hidden_norm`, `midlayer.post_attention_layernorm`,
`norm.weight`, `lm_head.weight [V_d, D]`, and `d2t [V_d]` (draft index i is target token `i + d2t[i]`; `t2d`, its
inverse mask, is checked against it): our `Eagle3` with `draft_vocab = i + d2t[i]` and the reference's feature
layers.

`dflash` (z-lab/dflash, SpecForge, speculators): `config.json` and `model.safetensors` of a DFlash drafter
(`read_dflash`).

Every checkpoint is checked against the target (hidden size, vocabulary) before anything is written, one line
each.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from amphista_jax.drafters.base import Drafter
from amphista_jax.drafters.dflash import DFlash
from amphista_jax.drafters.eagle import Eagle
from amphista_jax.drafters.eagle3 import Eagle3
from amphista_jax.drafters.io import params_fit
from amphista_jax.drafters.medusa import Medusa
from amphista_jax.infra.errors import UserError
from amphista_jax.models.hf import LAYER_TENSORS
from amphista_jax.models.target import Target
from amphista_jax.models.torch_files import read_tensors

MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "medusa_lm_head.bin")
EAGLE_FILES = ("model.safetensors", "pytorch_model.bin")


class PublishedHeadsError(UserError, ValueError):
    """Released heads that cannot be read, or that belong to another target."""


def _first_file(src: Path, names: tuple[str, ...], fmt: str) -> Path:
    for name in names:
        if (src / name).is_file():
            return src / name
    raise PublishedHeadsError(f"{src} holds none of {', '.join(names)}: point --heads-from {fmt} at the directory "
                              "of the released heads")


def _check(what: str, got: tuple[int, ...], want: tuple[int, ...], target: Target) -> None:
    if got != want:
        raise PublishedHeadsError(f"{what} has shape {got}, but the target (hidden size {target.config.hidden_size}, "
                                  f"vocabulary {target.config.vocab_size}) needs {want}: these heads were trained "
                                  "for another model; pass that model as --model")


class _Tensors:
    """A released checkpoint's tensors, read by name with their shapes checked against the target."""

    def __init__(self, src: Path, tensors: dict[str, np.ndarray], target: Target, layout: str):
        self.src, self.tensors, self.target, self.layout = src, tensors, target, layout

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        if name not in self.tensors:
            raise PublishedHeadsError(f"{self.src} has no tensor {name}: the file is incomplete or not {self.layout}'s "
                                      "released layout")
        if shape is not None:
            _check(name, tuple(self.tensors[name].shape), shape, self.target)
        return np.asarray(self.tensors[name], np.float32)

    def layer(self, prefix: str, d_in: int) -> dict:
        """One released decoder layer (`{prefix}.self_attn.q_proj.weight`, ...) as our layer's params (q/k/v read
        `d_in`-wide inputs); tensors it does not hold are left out (the caller's form says which it needs)."""
        c = self.target.config
        shapes = {"q_proj": (c.num_heads * c.head_dim, d_in), "k_proj": (c.num_kv_heads * c.head_dim, d_in),
                  "v_proj": (c.num_kv_heads * c.head_dim, d_in), "o_proj": (c.hidden_size, c.num_heads * c.head_dim),
                  "gate_proj": (c.intermediate_size, c.hidden_size), "up_proj": (c.intermediate_size, c.hidden_size),
                  "down_proj": (c.hidden_size, c.intermediate_size)}
        out: dict = {}
        for path, (name, transposed) in LAYER_TENSORS.items():
            full = f"{prefix}.{name}"
            if full not in self.tensors:
                continue
            shape = shapes[path[1]] if transposed else ((c.hidden_size,) if path[-1] == "scale" else None)
            value = self.get(full, shape)
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = jnp.asarray(value.T if transposed else value)
        return out


def _read(src: str | Path, files: tuple[str, ...], layout: str, target: Target) -> tuple[Path, _Tensors, dict]:
    src = Path(src)
    tensors = read_tensors(_first_file(src, files, layout))
    config = json.loads((src / "config.json").read_text()) if (src / "config.json").is_file() else {}
    for key, ours in (("hidden_size", target.config.hidden_size), ("vocab_size", target.config.vocab_size)):
        if key in config and int(config[key]) != ours:
            raise PublishedHeadsError(f"{src / 'config.json'} has {key} {config[key]} but the target has {ours}: "
                                      "these heads were trained for another model; pass that model as --model")
    return src, _Tensors(src, tensors, target, layout), config


def draft_rope_theta(config: dict) -> float:
    """The RoPE base of a released draft layer: its own config's (`rope_theta`, or transformers 5's
    `rope_parameters.rope_theta`), 10000 where it names none, as the reference's draft layer reads it (never the
    target's)."""
    rope = config.get("rope_parameters") or {}
    return float(rope.get("rope_theta", config.get("rope_theta")) or 10000.0)


def _fitted(drafter: Drafter, params: dict, target: Target) -> tuple[Drafter, dict]:
    if not params_fit(drafter, params, target):
        raise PublishedHeadsError(f"the converted {drafter.name} params do not match the drafter's own layout")
    return drafter, params


def _require(layer: dict, names: tuple[tuple[str, ...], ...], src: Path, prefix: str, layout: str) -> None:
    for path in names:
        node = layer
        for key in path:
            if not isinstance(node, dict) or key not in node:
                raise PublishedHeadsError(f"{src} has no tensor {prefix}.{LAYER_TENSORS[path][0]}: the file is "
                                          f"incomplete or not {layout}'s released layout")
            node = node[key]


_LAYER_CORE = tuple(p for p in LAYER_TENSORS if p[-1] == "kernel") + (("post_attn_norm", "scale"),)


def read_medusa(src: str | Path, target: Target) -> tuple[Medusa, dict]:
    """(the drafter, its params) of FasterDecoding's released Medusa heads in `src`, checked against `target`."""
    src = Path(src)
    tensors = read_tensors(_first_file(src, MEDUSA_FILES, "medusa"))
    tensors = {k.removeprefix("medusa_head."): v for k, v in tensors.items()}
    config = json.loads((src / "config.json").read_text()) if (src / "config.json").is_file() else {}
    found = [tuple(int(x) for x in m.groups()) for k in tensors if (m := re.fullmatch(r"(\d+)\.(\d+)\.weight", k))]
    if not found:
        raise PublishedHeadsError(f"{src} has no `<head>.<layer>.weight` projection: not Medusa's released layout")
    k = int(config.get("medusa_num_heads", max(i for i, _ in found) + 1))
    n = int(config.get("medusa_num_layers", max(j for _, j in found)))
    d, v = target.config.hidden_size, target.config.vocab_size

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise PublishedHeadsError(f"{src} has no tensor {name} ({k} heads of {n} ResBlocks, from config.json or "
                                      "the file's keys): the file is incomplete or not Medusa's")
        _check(name, tuple(tensors[name].shape), shape, target)
        return np.asarray(tensors[name], np.float32)

    expected = {f"{i}.{j}.linear.{p}" for i in range(k) for j in range(n) for p in ("weight", "bias")}
    if extra := sorted(set(tensors) - expected - {f"{i}.{n}.weight" for i in range(k)}):
        raise PublishedHeadsError(f"{src} holds {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}: not Medusa's "
                                  f"released layout of {k} heads with {n} ResBlocks (the reference would ignore them)")
    w = [[get(f"{i}.{j}.linear.weight", (d, d)).T for j in range(n)] for i in range(k)]
    b = [[get(f"{i}.{j}.linear.bias", (d,)) for j in range(n)] for i in range(k)]
    lm_head = [get(f"{i}.{n}.weight", (v, d)).T for i in range(k)]
    drafter = Medusa(num_heads=k, num_layers=n)
    params = {"w": jnp.asarray(np.stack(w)), "b": jnp.asarray(np.stack(b)), "lm_head": jnp.asarray(np.stack(lm_head))}
    if not params_fit(drafter, params, target):
        raise PublishedHeadsError(f"the converted {drafter.name} params do not match the drafter's own layout")
    return drafter, params


def read_eagle(src: str | Path, target: Target) -> tuple[Eagle, dict]:
    """(the drafter, its params) of SafeAILab's released EAGLE (EAGLE-1/2) heads in `src`, checked against
    `target`."""
    src, t, config = _read(src, EAGLE_FILES, "eagle", target)
    d = target.config.hidden_size
    if int(config.get("num_hidden_layers", 1)) != 1 or "layers.1.self_attn.q_proj.weight" in t.tensors:
        raise PublishedHeadsError(f"{src} holds a draft stack of more than one layer: the released EAGLE heads have "
                                  "one, and only that form loads")
    layer = t.layer("layers.0", d)
    _require(layer, _LAYER_CORE, src, "layers.0", "eagle")
    fc = {"kernel": jnp.asarray(t.get("fc.weight", (d, 2 * d)).T),
          "bias": jnp.asarray(t.get("fc.bias", (d,)) if "fc.bias" in t.tensors else np.zeros(d, np.float32))}
    stacked = {"layer": {k: _stack(v) for k, v in layer.items()}}
    return _fitted(Eagle(input_norm=False, rope_theta=draft_rope_theta(config)), {"fc": fc} | stacked, target)


def _stack(tree: dict) -> dict:
    """One layer's params on the leading `layers` axis of a one-layer `decoder_stack`."""
    return {k: _stack(v) if isinstance(v, dict) else v[None] for k, v in tree.items()}


SPECULATORS_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")  # forms ours has not


def read_eagle3(src: str | Path, target: Target) -> tuple[Eagle3, dict]:
    """(the drafter, its params) of released EAGLE-3 heads in `src`, checked against `target`: SafeAILab's and
    SpecForge's layout (`midlayer.*`, the reference's fused layers) or speculators' (`speculators_model_type:
    eagle3`: `layers.0.*`, the fused layers named by `eagle_aux_hidden_state_layer_ids`, no `d2t` over the whole
    vocabulary)."""
    src, t, config = _read(src, EAGLE_FILES, "eagle3", target)
    c = target.config
    d = c.hidden_size
    speculators = config.get("speculators_model_type") == "eagle3"
    if speculators and (flags := [f for f in SPECULATORS_FLAGS if config.get(f)]):
        raise PublishedHeadsError(f"{src / 'config.json'} sets {', '.join(flags)}: a form of EAGLE-3's layer this "
                                  "library does not implement")
    if speculators and "d2t" not in t.tensors:
        d2t = np.zeros(int(config.get("draft_vocab_size", c.vocab_size)), np.int64)  # the whole vocabulary
    else:
        d2t = np.asarray(t.tensors["d2t"] if "d2t" in t.tensors else t.get("d2t")).astype(np.int64)
    ids = np.arange(len(d2t)) + d2t  # draft index -> target id
    if "draft_vocab_size" in config and int(config["draft_vocab_size"]) != len(ids):
        raise PublishedHeadsError(f"{src}: d2t has {len(ids)} entries but config.json's draft_vocab_size is "
                                  f"{config['draft_vocab_size']}: the files do not belong together")
    if ids.min() < 0 or ids.max() >= c.vocab_size or len(set(ids.tolist())) != len(ids):
        raise PublishedHeadsError(f"{src}: d2t maps to target ids outside [0, {c.vocab_size}) or to one twice: these "
                                  "heads were trained for another vocabulary; pass that model as --model")
    if "t2d" in t.tensors:
        t2d = np.asarray(t.tensors["t2d"]).astype(bool)
        if t2d.shape != (c.vocab_size,) or not np.array_equal(np.flatnonzero(t2d), np.sort(ids)):
            raise PublishedHeadsError(f"{src}: t2d ({t2d.shape[0]} entries) does not mark d2t's {len(ids)} target ids "
                                      f"of a {c.vocab_size}-token vocabulary: these heads were trained for another "
                                      "vocabulary; pass that model as --model")
    order = np.argsort(ids)  # our draft vocabulary is sorted; the released one normally is already
    prefix = "layers.0" if speculators else "midlayer"
    layer = t.layer(prefix, 2 * d)
    _require(layer, _LAYER_CORE + (("input_norm", "scale"),), src, prefix, "eagle3")
    layer["hidden_norm"] = {"scale": jnp.asarray(t.get(f"{prefix}.hidden_norm.weight", (d,)))}
    params = {"fc": {"kernel": jnp.asarray(t.get("fc.weight", (d, 3 * d)).T)}, "midlayer_0": layer,
              "norm": {"scale": jnp.asarray(t.get("norm.weight", (d,)))},
              "lm_head": jnp.asarray(t.get("lm_head.weight", (len(ids), d))[order].T)}
    vocab = () if len(ids) == c.vocab_size else tuple(int(i) for i in ids[order])  # (): the whole vocabulary
    layers = tuple(config.get("eagle_aux_hidden_state_layer_ids") or ()) if speculators else ()
    rope = draft_rope_theta(config["transformer_layer_config"] if speculators else config)
    try:
        drafter = Eagle3(draft_vocab=vocab, rope_theta=rope, feature_layers=layers)
        drafter.captured_layers(c)
    except ValueError as e:
        raise PublishedHeadsError(f"{src / 'config.json'}: {e}") from None
    return _fitted(drafter, params, target)


DFLASH_TENSORS = {  # our name: (the reference's, its torch shape from the target's config)
    "q_proj": ("self_attn.q_proj", lambda c: (c.num_heads * c.head_dim, c.hidden_size)),
    "k_proj": ("self_attn.k_proj", lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size)),
    "v_proj": ("self_attn.v_proj", lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size)),
    "o_proj": ("self_attn.o_proj", lambda c: (c.hidden_size, c.num_heads * c.head_dim)),
    "q_norm": ("self_attn.q_norm", lambda c: (c.head_dim,)),
    "k_norm": ("self_attn.k_norm", lambda c: (c.head_dim,)),
    "input_layernorm": ("input_layernorm", lambda c: (c.hidden_size,)),
    "post_attention_layernorm": ("post_attention_layernorm", lambda c: (c.hidden_size,)),
    "mlp/gate_proj": ("mlp.gate_proj", lambda c: (c.intermediate_size, c.hidden_size)),
    "mlp/up_proj": ("mlp.up_proj", lambda c: (c.intermediate_size, c.hidden_size)),
    "mlp/down_proj": ("mlp.down_proj", lambda c: (c.hidden_size, c.intermediate_size)),
}


def _zlab_config(config: dict, vocab_size: int, src: Path) -> dict:
    """A DFlash drafter's config.json in z-lab's form: speculators' (`speculators_model_type: dflash`, its layers'
    config under `transformer_layer_config`, the fused layers as the ids of the layers whose inputs they are) moved
    into it; z-lab's as it is."""
    if config.get("speculators_model_type") != "dflash":
        return config
    if int(config.get("draft_vocab_size", vocab_size)) != vocab_size:
        raise PublishedHeadsError(f"{src / 'config.json'} drafts over {config['draft_vocab_size']} of the target's "
                                  f"{vocab_size} tokens: a DFlash draft vocabulary is not read here")
    return config.get("transformer_layer_config", {}) | {k: config[k] for k in ("block_size",) if k in config} | {
        "dflash_config": {
            "mask_token_id": config.get("mask_token_id", -1),
            "target_layer_ids": [i - 1 for i in config.get("aux_hidden_state_layer_ids") or ()]}}


def read_dflash(src: str | Path, target: Target) -> tuple[DFlash, dict]:
    """(the drafter, its params) of released DFlash drafters (z-lab, SpecForge) in `src`, checked against `target`:
    `config.json` (`block_size`, `num_hidden_layers`, `dflash_config.target_layer_ids` and `mask_token_id`, the
    layers' shape, which must be the target's) beside `model.safetensors`: `fc.weight [D, C D]`, `hidden_norm`,
    `norm` and `layers.{i}.` Qwen3 decoder layers (`self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`, the two
    layer norms, `mlp.{gate,up,down}_proj`; no biases). MASK's embedding is the target's row `mask_token_id`."""
    src, t, config = _read(src, EAGLE_FILES, "dflash", target)
    c = target.config
    config = _zlab_config(config, c.vocab_size, src)
    dflash = config.get("dflash_config") or {}
    if "block_size" not in config or "num_hidden_layers" not in config:
        raise PublishedHeadsError(f"{src / 'config.json'} has no block_size or num_hidden_layers: not a DFlash "
                                  "drafter's config")
    config = config | {"rope_theta": draft_rope_theta(config)}  # its own, or transformers 5's rope_parameters
    for key, ours in (("num_attention_heads", c.num_heads), ("num_key_value_heads", c.num_kv_heads),
                      ("head_dim", c.head_dim), ("intermediate_size", c.intermediate_size),
                      ("rope_theta", c.rope_theta)):
        if key in config and config[key] is not None and float(config[key]) != float(ours):
            raise PublishedHeadsError(f"{src / 'config.json'} has {key} {config[key]} but the target's layers have "
                                      f"{ours}: the drafter's layers must be the target's shape; pass its target as "
                                      "--model")
    try:
        drafter = DFlash(block_size=int(config["block_size"]), num_layers=int(config["num_hidden_layers"]),
                         target_layer_ids=tuple(dflash.get("target_layer_ids", ())),
                         mask_token_id=int(dflash.get("mask_token_id", -1)))
        ids = drafter.layer_ids(c)
    except ValueError as e:
        raise PublishedHeadsError(f"{src / 'config.json'}: {e}") from None
    if not 0 <= drafter.mask_token_id < c.vocab_size:
        raise PublishedHeadsError(f"{src / 'config.json'}: dflash_config.mask_token_id {drafter.mask_token_id} is not "
                                  f"a token of the target's {c.vocab_size}: pass its target as --model")
    d = c.hidden_size
    params: dict = {"fc": {"kernel": jnp.asarray(t.get("fc.weight", (d, len(ids) * d)).T)},
                    "hidden_norm": {"scale": jnp.asarray(t.get("hidden_norm.weight", (d,)))},
                    "norm": {"scale": jnp.asarray(t.get("norm.weight", (d,)))},
                    "mask_embedding": target.embed(jnp.asarray(drafter.mask_token_id))}
    for i in range(drafter.num_layers):
        layer: dict = {}
        for ours, (theirs, shape) in DFLASH_TENSORS.items():
            value = t.get(f"layers.{i}.{theirs}.weight", shape(c))
            node = layer
            *parents, leaf = ours.split("/")
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = {"kernel": jnp.asarray(value.T)} if value.ndim == 2 else {"scale": jnp.asarray(value)}
        params[f"layers_{i}"] = layer
    return _fitted(drafter, params, target)


READERS = {"medusa": read_medusa, "eagle": read_eagle, "eagle3": read_eagle3, "dflash": read_dflash}
