"""Our heads written in the layouts the reference repositories load (`amphista-jax convert --heads DIR --model
TARGET --heads-to FORMAT --out OUT`): the inverse of `published.py`, checked in tests against the reference
packages' own model code (`tests/test_exported.py`). Written without torch: `.pt` / `.bin` state dicts through
`models.torch_files.write_torch_file`, `.safetensors` through safetensors' numpy API.

`medusa` (medusa-llm, FasterDecoding/Medusa): `medusa_lm_head.pt` (keys `{i}.{j}.linear.{weight,bias}` and
`{i}.{L}.weight`, no prefix: the reference loads with `strict=False`, so a wrong name would be dropped silently) and
`config.json` (`medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path`).
`eagle` (eagle-llm, SafeAILab's EAGLE-1/2): `pytorch_model.bin` (`embed_tokens` — its strict load needs it —, `fc`
with bias, `layers.0` without an input norm) and the Llama `config.json` of its one layer.
`eagle3` (SafeAILab's EAGLE-3 and SpecForge): `pytorch_model.bin` (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`
offsets and the `t2d` mask) and its `config.json` (`draft_vocab_size`, the layer's RoPE base).
`dflash` (z-lab): `model.safetensors` (`fc`, `hidden_norm`, `norm`, `layers.{i}` Qwen3 layers) and a Qwen3
`config.json` with `num_target_layers` and `dflash_config` (`block_size`, `mask_token_id`, `target_layer_ids`).
`eagle3-speculators` and `dflash-speculators` (vLLM's speculators): `model.safetensors` (EAGLE-3's layer as
`layers.0`; DFlash's body as z-lab's) with the target's embedding (and DFlash's lm_head), which speculators would
otherwise fill from the verifier, and its `config.json` (`speculators_model_type`, the fused layers as the ids of the
layers whose inputs they are, the layer config, the verifier: the target's directory).

What a layout cannot express is refused in one line naming the difference, before anything is written; nothing is
written approximately. A draft vocabulary that only selects columns of the target's frozen lm_head (Medusa with
`shared_lm_head`, EAGLE, DFlash) is no parameter of the heads: `whole_vocab` (`convert --whole-vocab`) drops it, so
the same parameters draft over every column, the layouts' form.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

from amphista_jax.drafters.base import Drafter
from amphista_jax.drafters.dflash import DFlash
from amphista_jax.drafters.eagle import Eagle
from amphista_jax.drafters.eagle3 import Eagle3, reference_layers
from amphista_jax.drafters.medusa import Medusa
from amphista_jax.drafters.published import DFLASH_TENSORS
from amphista_jax.infra.errors import UserError
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.hf import LAYER_TENSORS
from amphista_jax.models.target import Target
from amphista_jax.models.torch_files import write_torch_file

EAGLE_ROPE_THETA = 10000.0  # eagle-llm's draft layer runs this base whatever its config says
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose layout is written (`tests/reference-packages.txt`)


Layout = tuple[str, dict[str, np.ndarray], dict]  # (the tensors' file name, its tensors, config.json)


_WIDEN = " (--whole-vocab reads the target's lm_head at every column)"


class ExportError(UserError, ValueError):
    """Heads that a reference layout cannot hold exactly."""


def _refuse(fmt: str, drafter: Drafter, what: str) -> ExportError:
    return ExportError(f"--heads-to {fmt}: these {drafter.name} heads {what}; nothing was written")


def _array(x: jax.Array) -> np.ndarray:
    return np.asarray(jax.device_get(x), np.float32)


def _llama_config(c: ModelConfig, **extra: object) -> dict:
    """The HF Llama config of draft layers of the target's shape."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
            "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_positions, "hidden_act": "silu",
            "tie_word_embeddings": False} | extra


def _layer_tensors(layer: dict, prefix: str) -> dict[str, np.ndarray]:
    """One decoder layer's params (ours, `LAYER_TENSORS` paths) under the reference's names at `prefix`."""
    out = {}
    for path, (name, transposed) in LAYER_TENSORS.items():
        node = layer
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            value = _array(node)
            out[f"{prefix}.{name}"] = value.T if transposed else value
    return out


def _count(tree: dict) -> int:
    return sum(x.size for x in jax.tree.leaves(tree))


def _checked(tensors: dict[str, np.ndarray], params: dict, covered: int) -> dict[str, np.ndarray]:
    """Every one of our parameters has a place in the layout (`covered` of them written once)."""
    if covered != _count(params):
        raise ExportError(f"the layout holds {covered:,} of the heads' {_count(params):,} parameters: a part of them "
                          "has no place in it; nothing was written")
    return tensors


def whole_vocab(fmt: str, drafter: Drafter) -> Drafter:
    """`drafter` drafting over the whole vocabulary, its parameters unchanged: where its draft vocabulary only selects
    columns of the target's frozen lm_head. Heads with a projection of their own over the draft vocabulary (EAGLE-3's
    `lm_head`, Medusa's per-head lm_head) are refused in one line."""
    if not drafter.draft_vocab:
        return drafter
    selects = (isinstance(drafter, Medusa) and drafter.shared_lm_head
               or isinstance(drafter, Eagle) and drafter.name == "eagle" or isinstance(drafter, DFlash))
    if not selects:
        raise _refuse(fmt, drafter, f"project onto their {len(drafter.draft_vocab)} draft tokens with weights of "
                      "their own, so --whole-vocab cannot widen them")
    return dataclasses.replace(drafter, draft_vocab=())


def medusa_layout(drafter: Drafter, params: dict, target: Target, model: str) -> Layout:
    if not isinstance(drafter, Medusa):
        raise _refuse("medusa", drafter, "are not Medusa heads (the layout holds only Medusa's ResBlock heads)")
    if drafter.draft_vocab:
        raise _refuse("medusa", drafter, f"score {len(drafter.draft_vocab)} draft tokens; Medusa's heads score the "
                      f"whole vocabulary{_WIDEN if drafter.shared_lm_head else ''}")
    k, n = drafter.num_heads, drafter.num_layers
    w, b = _array(params["w"]), _array(params["b"])
    if n > 1 and not all(np.array_equal(w[:, j], w[:, 0]) and np.array_equal(b[:, j], b[:, 0]) for j in range(n)):
        raise _refuse("medusa", drafter, f"have {n} distinct ResBlocks per head; medusa-llm builds a head's "
                      "ResBlocks as one module repeated (`[ResBlock] * L`), so it would load one of them for all")
    shared = _array(target.lm_head()) if drafter.shared_lm_head else None  # [D, V]: each head's copy
    lm_head = _array(params["lm_head"]) if shared is None else np.broadcast_to(shared, (k,) + shared.shape)
    tensors = {}
    for i in range(k):
        for j in range(n):
            tensors |= {f"{i}.{j}.linear.weight": w[i, j].T, f"{i}.{j}.linear.bias": b[i, j]}
        tensors[f"{i}.{n}.weight"] = lm_head[i].T
    _checked(tensors, params, w.size + b.size + (0 if drafter.shared_lm_head else lm_head.size))
    return "medusa_lm_head.pt", tensors, {"medusa_num_heads": k, "medusa_num_layers": n,
                                          "base_model_name_or_path": model}


def eagle_layout(drafter: Drafter, params: dict, target: Target, model: str) -> Layout:
    c = target.config
    if not isinstance(drafter, Eagle) or drafter.name != "eagle":
        raise _refuse("eagle", drafter, "are not EAGLE heads (the layout holds EAGLE-1/2's one-layer draft)")
    if drafter.num_layers != 1 or drafter.input_norm:
        raise _refuse("eagle", drafter, f"have {drafter.num_layers} draft layer(s) with input_norm="
                      f"{drafter.input_norm}; EAGLE's layout holds one layer without an input norm")
    if drafter.draft_vocab:
        raise _refuse("eagle", drafter, f"draft over {len(drafter.draft_vocab)} tokens; EAGLE-1/2 drafts over the "
                      f"whole vocabulary{_WIDEN}")
    if (theta := drafter.rope_theta or c.rope_theta) != EAGLE_ROPE_THETA:
        raise _refuse("eagle", drafter, f"run their draft layer at RoPE base {theta:g}; eagle-llm runs it at "
                      f"{EAGLE_ROPE_THETA:g} whatever its config says")
    if c.head_dim * c.num_heads != c.hidden_size:
        raise _refuse("eagle", drafter, f"have heads of {c.head_dim} x {c.num_heads} != hidden size {c.hidden_size}; "
                      "EAGLE's config derives the head size from the hidden size")
    layer = jax.tree.map(lambda x: x[0], params["layer"])  # the one layer of a stacked decoder_stack
    tensors = {"embed_tokens.weight": _array(target.embed(np.arange(c.vocab_size))),
               "fc.weight": _array(params["fc"]["kernel"]).T, "fc.bias": _array(params["fc"]["bias"])}
    tensors |= _layer_tensors(layer, "layers.0")
    _checked(tensors, params, sum(v.size for k, v in tensors.items() if k != "embed_tokens.weight"))
    return "pytorch_model.bin", tensors, _llama_config(c, num_hidden_layers=1, bias=True, rope_theta=EAGLE_ROPE_THETA,
                                                       base_model_name_or_path=model)


def _eagle3_tensors(drafter: Drafter, params: dict, target: Target, fmt: str, prefix: str) -> dict[str, np.ndarray]:
    """EAGLE-3's draft tensors with its layer under `prefix` (SafeAILab: `midlayer`; speculators: `layers.0`)."""
    if not isinstance(drafter, Eagle3):
        raise _refuse(fmt, drafter, "are not EAGLE-3 heads")
    layer = params["midlayer_0"]
    tensors = {"fc.weight": _array(params["fc"]["kernel"]).T,
               f"{prefix}.hidden_norm.weight": _array(layer["hidden_norm"]["scale"]),
               "norm.weight": _array(params["norm"]["scale"]), "lm_head.weight": _array(params["lm_head"]).T}
    tensors |= _layer_tensors(layer, prefix)
    return _checked(tensors, params, sum(v.size for v in tensors.values()))


def _vocab_maps(drafter: Drafter, vocab_size: int) -> dict[str, np.ndarray]:
    """`d2t` (draft index -> target id offsets) and `t2d` (the target ids drafted) of the draft vocabulary."""
    ids = np.asarray(drafter.draft_vocab or range(vocab_size), np.int64)
    t2d = np.zeros(vocab_size, bool)
    t2d[ids] = True
    return {"d2t": ids - np.arange(len(ids)), "t2d": t2d}


def eagle3_layout(drafter: Drafter, params: dict, target: Target, model: str) -> Layout:
    c = target.config
    tensors = _eagle3_tensors(drafter, params, target, "eagle3", "midlayer")
    if (layers := drafter.captured_layers(c)) != reference_layers(c.num_layers):
        raise _refuse("eagle3", drafter, f"fuse target layers {list(layers)}; SafeAILab's EAGLE-3 engine fuses "
                      f"{list(reference_layers(c.num_layers))} (2, L // 2, L - 3), which its layout does not name")
    maps = _vocab_maps(drafter, c.vocab_size)
    return "pytorch_model.bin", tensors | maps, _llama_config(c, num_hidden_layers=1, draft_vocab_size=len(maps["d2t"]),
                                                              rope_theta=drafter.rope_theta or c.rope_theta,
                                                              base_model_name_or_path=model)


def _speculators_config(algorithm: str, tokens: int, model: str, layer_config: dict, **fields: object) -> dict:
    """A speculators checkpoint's config.json: the draft's own fields, its layer config, the greedy proposal of
    `tokens` tokens and the verifier (the target directory)."""
    return {"architectures": [f"{'Eagle3' if algorithm == 'eagle3' else 'DFlash'}DraftModel"],
            "speculators_model_type": algorithm, "speculators_version": SPECULATORS_VERSION, "target_hidden_size": None,
            "transformer_layer_config": layer_config, "tie_word_embeddings": False, **fields,
            "speculators_config": {
                "algorithm": algorithm, "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens,
                                      "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                "verifier": {"name_or_path": model, "architectures": ["LlamaForCausalLM"]}}}


def _layer_config(c: ModelConfig, model_type: str, layers: int, rope_theta: float) -> dict:
    config = _llama_config(c, num_hidden_layers=layers, attention_bias=False, mlp_bias=False,
                           rope_parameters={"rope_theta": rope_theta, "rope_type": "default"})
    return {k: v for k, v in config.items() if k != "architectures"} | {"model_type": model_type}


def eagle3_speculators_layout(drafter: Drafter, params: dict, target: Target, model: str) -> Layout:
    c = target.config
    tensors = _eagle3_tensors(drafter, params, target, "eagle3-speculators", "layers.0")
    if len(set(layers := drafter.captured_layers(c))) != len(layers):
        raise _refuse("eagle3-speculators", drafter, f"fuse target layers {list(layers)}; speculators refuses a "
                      "layer named twice")
    tensors["embed_tokens.weight"] = _array(target.embed(np.arange(c.vocab_size)))  # else refilled from the target
    if drafter.draft_vocab:
        tensors |= _vocab_maps(drafter, c.vocab_size)
    return "model.safetensors", tensors, _speculators_config(
        "eagle3", 3, model, _layer_config(c, "llama", 1, drafter.rope_theta or c.rope_theta),
        draft_vocab_size=len(drafter.draft_vocab or range(c.vocab_size)), eagle_aux_hidden_state_layer_ids=list(layers),
        norm_before_residual=False, norm_before_fc=False, fc_norm=False, norm_output=False, embed_requires_grad=False)


def _dflash_tensors(drafter: Drafter, params: dict, target: Target, fmt: str) -> dict[str, np.ndarray]:
    """DFlash's draft body (`fc`, `hidden_norm`, `norm`, `layers.{i}` Qwen3 layers): z-lab's names, speculators'
    too."""
    if not isinstance(drafter, DFlash):
        raise _refuse(fmt, drafter, "are not DFlash heads")
    if not drafter.qk_norm:
        raise _refuse(fmt, drafter, "have no query/key norms (qk_norm=false); the reference's Qwen3 layers have them")
    if drafter.draft_vocab:
        raise _refuse(fmt, drafter, f"draft over {len(drafter.draft_vocab)} tokens; the layout's DFlash drafts over "
                      f"the whole vocabulary{_WIDEN}")
    mask = _array(params["mask_embedding"]) if drafter.learned_mask else np.zeros(0)
    if drafter.learned_mask and (drafter.mask_token_id < 0 or not np.array_equal(
            mask, _array(target.embed(drafter.mask_token_id)))):
        raise _refuse(fmt, drafter, "learned their own MASK embedding; the layout embeds MASK as the target's token "
                      "mask_token_id")
    tensors = {"fc.weight": _array(params["fc"]["kernel"]).T,
               "hidden_norm.weight": _array(params["hidden_norm"]["scale"]),
               "norm.weight": _array(params["norm"]["scale"])}
    for i in range(drafter.num_layers):
        layer = params[f"layers_{i}"]
        for ours, (theirs, _) in DFLASH_TENSORS.items():
            node = layer
            for key in ours.split("/"):
                node = node[key]
            value = _array(node.get("kernel", node.get("scale")))
            tensors[f"layers.{i}.{theirs}.weight"] = value.T if value.ndim == 2 else value
    return _checked(tensors, params, sum(v.size for v in tensors.values()) + mask.size)


def dflash_layout(drafter: Drafter, params: dict, target: Target, model: str) -> Layout:
    c = target.config
    tensors = _dflash_tensors(drafter, params, target, "dflash")
    config = _layer_config(c, "qwen3", drafter.num_layers, c.rope_theta) | {
        "architectures": ["DFlashDraftModel"], "num_target_layers": c.num_layers, "rope_theta": c.rope_theta,
        "block_size": drafter.block_size, "layer_types": ["full_attention"] * drafter.num_layers,
        "base_model_name_or_path": model,
        "dflash_config": {"block_size": drafter.block_size, "mask_token_id": drafter.mask_token_id,
                          "target_layer_ids": list(drafter.layer_ids(c))}}
    return "model.safetensors", tensors, config


def dflash_speculators_layout(drafter: Drafter, params: dict, target: Target, model: str) -> Layout:
    c = target.config
    tensors = _dflash_tensors(drafter, params, target, "dflash-speculators")
    tensors |= {"embed_tokens.weight": _array(target.embed(np.arange(c.vocab_size))),  # else refilled from the
                "lm_head.weight": _array(target.lm_head()).T}  # target where still unset
    layer_config = _layer_config(c, "qwen3", drafter.num_layers, c.rope_theta) | {
        "layer_types": ["full_attention"] * drafter.num_layers}
    return "model.safetensors", tensors, _speculators_config(
        "dflash", drafter.block_size - 1, model, layer_config, draft_vocab_size=c.vocab_size,
        block_size=drafter.block_size, mask_token_id=drafter.mask_token_id,
        aux_hidden_state_layer_ids=list(drafter.captured_layers(c)),  # speculators' id: the layer's input
        sample_from_anchor=False, sliding_window_non_causal=False)


LAYOUTS: dict[str, Callable[[Drafter, dict, Target, str], Layout]] = {
    "medusa": medusa_layout, "eagle": eagle_layout, "eagle3": eagle3_layout,
    "eagle3-speculators": eagle3_speculators_layout, "dflash": dflash_layout,
    "dflash-speculators": dflash_speculators_layout}


def export_heads(fmt: str, drafter: Drafter, params: dict, target: Target, out: Path, model: str,
                 dtype: np.dtype | None = None, widen: bool = False) -> str:
    """Write `drafter`'s heads (`params`, for `target` in directory `model`) into `out` in layout `fmt`, floating
    tensors in `dtype` (None: fp32); `widen`: over the whole vocabulary (`whole_vocab`). Returns the file of tensors
    written."""
    name, tensors, config = LAYOUTS[fmt](whole_vocab(fmt, drafter) if widen else drafter, params, target, model)
    if dtype is not None:
        tensors = {k: v.astype(dtype) if np.issubdtype(v.dtype, np.floating) else v for k, v in tensors.items()}
    if name.endswith(".safetensors"):
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out / name))
    else:
        write_torch_file(out / name, tensors)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return name
