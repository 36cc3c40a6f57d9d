"""`amphista-jax convert`: re-save a checkpoint in another dtype or shard size, draft heads in another dtype,
a llama.cpp GGUF as a HF directory, heads released in another project's layout (`drafters/published.py`) as
a heads directory, or our heads in such a layout (`drafters/exported.py`). The output must be new or empty: convert
never overwrites."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from amphista_jax.infra.errors import OutputExistsError, UsageError, check_writable_dir
from amphista_jax.infra.output_lock import staged_output
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.hf import DTYPES, load_config, load_params, save_params

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "tokenizer.model", "chat_template.jinja")


def convert(out: str, model: str, heads: str | None = None, gguf: str | None = None, dtype: str = "bfloat16",
            max_shard_mb: int = 0, heads_from: tuple[str, str] | None = None, heads_to: str | None = None,
            whole_vocab: bool = False) -> str:
    """Convert `gguf`, else `heads` (draft heads on the target `model`; with `heads_to`, into that reference
    layout, over the whole vocabulary where `whole_vocab`), else `heads_from` ((format, directory) of released heads
    for `model`), else `model` into `out` (files of at most `max_shard_mb` MB; 0: one file) in `dtype` ("checkpoint":
    as stored, or fp32 for `heads_to`). Returns what was saved, in a line."""
    from amphista_jax.drafters.exported import LAYOUTS
    from amphista_jax.drafters.published import READERS

    if heads_from and heads_from[0] not in READERS:
        raise UsageError(f"--heads-from {heads_from[0]}: unknown layout; known: {', '.join(READERS)}")
    if heads_to and heads_to not in LAYOUTS:
        raise UsageError(f"--heads-to {heads_to}: unknown layout; known: {', '.join(LAYOUTS)}")
    if heads_to and not heads:
        raise UsageError("--heads-to writes draft heads: name them with --heads DIR (and their target with --model)")
    if whole_vocab and not heads_to:
        raise UsageError("--whole-vocab widens heads written with --heads-to FORMAT: name the layout")
    if sum(x is not None for x in (gguf, heads, heads_from)) > 1:
        raise UsageError("give one of --gguf (a model), --heads (our heads) and --heads-from (released heads)")
    source, out_dir = gguf or heads or (heads_from[1] if heads_from else model), Path(out)
    if out_dir.resolve() == Path(source).resolve():
        raise UsageError("--out must differ from the source checkpoint: convert writes a new checkpoint and never "
                         "overwrites its source")
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())):
        raise OutputExistsError(f"--out {out} already exists and is not empty; convert never overwrites: pick "
                                "a new --out")
    if max_shard_mb < 0:
        raise UsageError(f"--max-shard-mb {max_shard_mb}: must be >= 0 (0 = one file)")
    # a whole-model convert needs room for the model (as stored, or 2/4 bytes a parameter); heads and GGUF are
    # checked by their writes, which fail whole (staged) and in one line
    need = (0 if gguf or heads or heads_from else
            sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) if dtype == "checkpoint" else
            load_config(model).num_params * jnp.dtype(DTYPES.get(dtype, jnp.float32)).itemsize)
    check_writable_dir(out_dir, "--out", need)
    with staged_output(out_dir, "convert") as staging:  # a killed or failed convert leaves no partial --out
        saved = _write(staging, model, heads, gguf, dtype, max_shard_mb, heads_from, heads_to, whole_vocab)
        return f"{saved} to {out_dir}"


def _write(out: Path, model: str, heads: str | None, gguf: str | None, dtype: str, max_shard_mb: int,
           heads_from: tuple[str, str] | None, heads_to: str | None, whole_vocab: bool) -> str:
    """`convert`'s work into the new directory `out`; returns what was saved (without where)."""
    if gguf:
        from amphista_jax.models.gguf import convert_gguf

        return f"saved {convert_gguf(gguf, out).num_params:,} parameters (fp32) and the tokenizer"
    params, config = load_params(model, dtype="float32" if heads or heads_from else dtype)
    if heads and heads_to:
        return _export_heads(heads, heads_to, out, model, params, config, dtype, whole_vocab)
    if heads:
        return _convert_heads(heads, out, params, config, dtype)
    if heads_from:
        return _convert_published(*heads_from, out, params, config, dtype)
    saved = save_params(params, config, out, dtype=dtype,
                        max_shard_bytes=max_shard_mb * 2**20 if max_shard_mb else None)
    for name in TOKENIZER_FILES:
        if (Path(model) / name).is_file():
            shutil.copy(Path(model) / name, saved / name)
    return f"saved {config.num_params:,} parameters"


def _convert_heads(heads: str, out: Path, target_params: dict, config: ModelConfig, dtype: str) -> str:
    from amphista_jax.drafters.io import load_draft, save_draft

    method, drafter, draft_params = load_draft(heads, config, target_params)
    if dtype == "checkpoint":
        draft_params = as_stored(heads, draft_params)
    save_draft(out, method, drafter, draft_params, config, dtype=None if dtype == "checkpoint" else dtype,
               target_params=target_params)
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(draft_params)}) if dtype == "checkpoint" else [dtype]
    return (f"saved {method} heads ({sum(x.size for x in jax.tree.leaves(draft_params)):,} parameters, "
            f"{'/'.join(dtypes)})")


def _export_heads(heads: str, fmt: str, out: Path, model: str, target_params: dict, config: ModelConfig,
                  dtype: str, whole_vocab: bool) -> str:
    from amphista_jax.drafters.exported import export_heads
    from amphista_jax.drafters.io import load_draft
    from amphista_jax.models.target import Target

    method, drafter, draft_params = load_draft(heads, config, target_params)
    cast = DTYPES[dtype] if dtype not in ("checkpoint", "float32") else None
    name = export_heads(fmt, drafter, draft_params, Target(config, target_params), out, str(Path(model).absolute()),
                        cast, whole_vocab)
    return (f"wrote the {method} heads of {heads} in {fmt}'s layout ({name}, config.json; "
            f"{'fp32' if cast is None else dtype}{'; the whole vocabulary' if whole_vocab else ''})")


def _convert_published(fmt: str, src: str, out: Path, target_params: dict, config: ModelConfig, dtype: str) -> str:
    from amphista_jax.drafters.io import save_draft
    from amphista_jax.drafters.published import READERS
    from amphista_jax.models.target import Target

    drafter, params = READERS[fmt](src, Target(config, target_params))
    save_draft(out, drafter.name, drafter, params, config, dtype=None if dtype == "checkpoint" else dtype,
               target_params=target_params)
    return (f"saved the released {fmt} heads of {src} as {drafter.name} heads "
            f"({sum(x.size for x in jax.tree.leaves(params)):,} parameters)")


def as_stored(heads: str, params: dict) -> dict:
    """`params` with each leaf in the dtype it is stored in under `heads` (`load_draft` restores fp32)."""
    with ocp.StandardCheckpointer() as ckpt:
        meta = ckpt.metadata(Path(heads).absolute() / "params")
    meta = getattr(meta, "item_metadata", meta)
    stored = {jax.tree_util.keystr(k): m.dtype for k, m in jax.tree_util.tree_flatten_with_path(meta)[0]}
    return jax.tree_util.tree_map_with_path(lambda k, x: x.astype(stored.get(jax.tree_util.keystr(k), x.dtype)),
                                            params)
