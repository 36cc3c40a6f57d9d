"""Recipe for the embedded default target: a small Llama trained on offline Python source.

    amphista-jax pretrain-target --config configs/target/code.yaml [key=value ...]

Builds the corpus (`train/corpus.py`: the standard library and the installed sources of named packages, tests
and duplicates optionally dropped, held out by a stable hash of the path), trains a byte-level BPE tokenizer,
trains the model with our own model code + optax + a grain pipeline of packed sequences,
checkpoints with orbax every `checkpoint_every` steps (an interrupted run, SIGTERM included, resumes where
it stopped), then exports a Hugging Face directory (bf16 safetensors, tokenizer, generation config) and
prints the held-out loss, bits per byte on a package that is in no training source, and a few greedy
continuations.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from amphista_jax.engine.decode import generate, pad_prompts
from amphista_jax.engine.prompt_checks import check_fits
from amphista_jax.infra.errors import OutputExistsError, check_writable_dir
from amphista_jax.infra.output_lock import output_lock, staged_output, write_atomic
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.hf import load_params, save_params
from amphista_jax.models.llama import Transformer, init_params
from amphista_jax.train.corpus import CorpusError, build_corpus, package_texts, package_version, train_tokenizer
from amphista_jax.train.data import pack_documents, packed_dataset
from amphista_jax.train.loop import LoopConfig, check_no_foreign_log, run_loop
from amphista_jax.train.optim import OptimConfig, make_optimizer


@dataclasses.dataclass(frozen=True)
class TargetArch:
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 2
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads} "
                             "(each head gets hidden_size / num_heads dimensions)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    run_dir: str = "runs/target"  # tokenizer, orbax checkpoints
    export_dir: str = "runs/target/export"  # the Hugging Face directory written at the end
    vocab_size: int = 4096
    heldout_fraction: float = 0.05
    max_files: int = 0  # 0 = every corpus file; >0 = the first N (smoke tests)
    stdlib: bool = True  # the interpreter's standard library
    packages: tuple[str, ...] = ()  # installed distributions whose .py sources join the corpus
    exclude_tests: bool = False  # drop test suites and vendored packages from every source
    max_source_mb: float = 0.0  # cap on each source's bytes (a stable random subset); 0 = no cap
    bpb_package: str = ""  # held-out bits/byte on this distribution's code ("" = skip); must be in no source
    bpb_max_mb: float = 0.5
    arch: TargetArch = TargetArch()
    seq_len: int = 256
    batch_size: int = 32
    steps: int = 640
    optim: OptimConfig = OptimConfig(lr=3e-3, warmup_steps=50, b2=0.95, weight_decay=0.1)
    checkpoint_every: int = 40
    keep_checkpoints: int = 2
    eval_windows: int = 64
    heldout_sample_chars: int = 24000
    sample_prompts: tuple[str, ...] = (
        "def fibonacci(n):\n",
        "class Stack:\n    def __init__(self):\n",
        "import os\n\n\ndef list_python_files(path):\n",
    )
    sample_tokens: int = 48
    seed: int = 0
    # A second stage: start from this exported model (its tokenizer and weights; `arch` must match) with a fresh
    # schedule of `steps`, continuing its data stream (same seed: the windows it saw come last).
    init_from: str = ""
    # A sibling of an exported model (e.g. a draft model for it): its tokenizer, fresh weights of this `arch`.
    tokenizer_from: str = ""

    def __post_init__(self) -> None:
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"{self.heldout_fraction=} must be in (0, 1)")
        if self.vocab_size < 260:
            raise ValueError(f"{self.vocab_size=} must be >= 260 (256 bytes + special tokens)")
        if self.bpb_package and self.bpb_package in self.packages:
            raise ValueError(f"{self.bpb_package=} is a training source: pick a package that is not in `packages`")
        LoopConfig(steps=self.steps, checkpoint_every=self.checkpoint_every, keep_checkpoints=self.keep_checkpoints)
        for name, low in (("batch_size", 1), ("seq_len", 1), ("eval_windows", 1), ("sample_tokens", 1),
                          ("max_files", 0), ("max_source_mb", 0), ("heldout_sample_chars", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"{name}={getattr(self, name)} must be >= {low}")
        if not self.bpb_max_mb > 0:
            raise ValueError(f"bpb_max_mb={self.bpb_max_mb} must be > 0")
        if self.seq_len > self.arch.max_position_embeddings:
            raise ValueError(f"seq_len={self.seq_len} exceeds arch.max_position_embeddings="
                             f"{self.arch.max_position_embeddings}: lower seq_len or raise the positions")
        if not self.stdlib and not self.packages:
            raise ValueError("stdlib is false and packages is empty: the corpus would be empty; name a source")
        if self.init_from and self.tokenizer_from:
            raise ValueError("init_from already brings its tokenizer: drop tokenizer_from")
        if self.tokenizer_from and not (Path(self.tokenizer_from) / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer_from {self.tokenizer_from} holds no tokenizer.json: point it at an exported "
                             "model directory")
        if self.init_from and Path(self.init_from).resolve() == Path(self.export_dir).resolve():
            raise ValueError(f"export_dir {self.export_dir} is init_from: the export would overwrite the model this "
                             "stage starts from; pick another export_dir")
        export, run = Path(self.export_dir).resolve(), Path(self.run_dir).resolve()
        if export == run or export in run.parents:
            raise ValueError(f"export_dir {self.export_dir} holds run_dir {self.run_dir}: an export replaces its "
                             "directory whole; pick an export_dir inside or beside run_dir, e.g. run_dir/export")


def token_nll(model: Transformer, params: Any, windows: jax.Array, ignore: tuple[int, ...] = ()
              ) -> tuple[jax.Array, jax.Array]:
    """(summed next-token cross-entropy in nats, number of targets) over `windows [B, T + 1]`, not counting
    targets in `ignore` (e.g. padding)."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    b, t = inputs.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits = model.apply({"params": params}, inputs, positions).logits  # [B, T, V] fp32
    keep = ~jnp.isin(targets, jnp.asarray(ignore, targets.dtype)) if ignore else jnp.ones(targets.shape, bool)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # [B, T]
    return jnp.where(keep, ce, 0.0).sum(), keep.sum()


def next_token_loss(model: Transformer, params: Any, windows: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats/token) over `windows [B, T + 1]`."""
    total, count = token_nll(model, params, windows)
    return total / count


def bits_per_byte(model: Transformer, params: Any, tok: PreTrainedTokenizerBase, texts: list[str], seq_len: int,
                  batch_size: int) -> float:
    """Tokenizer-independent held-out bits per UTF-8 byte: the summed next-token NLL of every token of every
    text (each framed by BOS/EOS, the BOS targets not counted; the context restarts every `seq_len` tokens)
    divided by ln 2 and by the texts' byte count."""
    windows = pack_documents(_encode(tok, texts), tok.eos_token_id, seq_len, pad_id=tok.pad_token_id)
    windows = np.pad(windows, ((0, (-len(windows)) % batch_size), (0, 0)), constant_values=tok.pad_token_id)
    nll = jax.jit(lambda p, w: token_nll(model, p, w, ignore=(tok.pad_token_id, tok.bos_token_id))[0])
    total = sum(float(nll(params, windows[i: i + batch_size])) for i in range(0, len(windows), batch_size))
    return total / math.log(2) / sum(len(t.encode()) for t in texts)


def heldout_loss(model: Transformer, params: Any, windows: np.ndarray, batch_size: int) -> float:
    loss_fn = jax.jit(lambda p, w: next_token_loss(model, p, w))
    losses = [float(loss_fn(params, windows[i: i + batch_size])) * len(windows[i: i + batch_size])
              for i in range(0, len(windows), batch_size)]
    return sum(losses) / len(windows)


def _tokenizer(cfg: PretrainConfig, train_texts: list[str]) -> PreTrainedTokenizerBase:
    path = Path(cfg.run_dir) / "tokenizer"
    if (path / "tokenizer.json").is_file():  # resume: never retrain, the checkpoints depend on it
        return AutoTokenizer.from_pretrained(path)
    source = cfg.init_from or cfg.tokenizer_from
    tok = AutoTokenizer.from_pretrained(source) if source else train_tokenizer(train_texts, cfg.vocab_size)
    tok.save_pretrained(path)
    return tok


def _encode(tok: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    return tok(texts, add_special_tokens=True)["input_ids"]


def model_config(cfg: PretrainConfig, tok: PreTrainedTokenizerBase) -> ModelConfig:
    a = cfg.arch
    return ModelConfig(
        vocab_size=len(tok), hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_layers=a.num_layers, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
        head_dim=a.hidden_size // a.num_heads, rope_theta=a.rope_theta,
        max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id)


def _init_stage(cfg: PretrainConfig) -> tuple[dict[str, Any] | None, int]:
    """(the summary of the model a second stage starts from, the number of its windows to skip), checked
    against this config before any slow work."""
    if not cfg.init_from:
        return None, 0
    path = Path(cfg.init_from)
    if not (path / "config.json").is_file() or not (path / "training_summary.json").is_file():
        raise CorpusError(f"init_from {path} is not a model exported by pretrain-target (no config.json or "
                          "training_summary.json): point it at the first stage's export_dir")
    summary = json.loads((path / "training_summary.json").read_text())
    first = summary["config"]
    if first["arch"] != dataclasses.asdict(cfg.arch) or first["seq_len"] != cfg.seq_len:
        raise CorpusError(f"init_from {path} was trained with arch {first['arch']} and seq_len {first['seq_len']}: "
                          "set the same arch and seq_len in this stage")
    skip = summary["steps"] * first["batch_size"] if first["seed"] == cfg.seed else 0
    return summary, skip


def _check_outputs(cfg: PretrainConfig) -> None:
    """Before any slow work: run_dir and export_dir writable with room to spare, and export_dir holding nothing
    but this run's own export (it is rewritten at the end)."""
    a = cfg.arch
    n = ModelConfig(vocab_size=cfg.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                    num_layers=a.num_layers, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
                    head_dim=a.hidden_size // a.num_heads).num_params
    # fp32 params + Adam's two moments per checkpoint (one more while the oldest is replaced); a bf16 export
    check_writable_dir(cfg.run_dir, "run_dir", 12 * n * (cfg.keep_checkpoints + 1))
    check_writable_dir(cfg.export_dir, "export_dir", 2 * n)
    check_no_foreign_log(cfg.run_dir)
    export, run_dir = Path(cfg.export_dir).resolve(), Path(cfg.run_dir).resolve()
    if export.is_dir() and any(export.iterdir()) and run_dir not in export.parents:
        summary = export / "training_summary.json"
        made_by = json.loads(summary.read_text()).get("config", {}).get("run_dir") if summary.is_file() else None
        if made_by is None or Path(made_by).resolve() != run_dir:
            raise OutputExistsError(f"export_dir {cfg.export_dir} already holds files that this run did not make: "
                                    "they would be overwritten; pick another export_dir")


def run(cfg: PretrainConfig) -> dict[str, Any]:
    """Train (or resume) and export. Returns the summary written to `export_dir/training_summary.json`."""
    if cfg.bpb_package:  # before any slow work: the held-out package must be installed
        package_version(cfg.bpb_package)
    first_stage, skip = _init_stage(cfg)
    _check_outputs(cfg)
    with output_lock(cfg.run_dir, "pretrain-target"):  # one run per run_dir (and so per export of it)
        return _train_and_export(cfg, first_stage, skip)


def _train_and_export(cfg: PretrainConfig, first_stage: dict[str, Any] | None, skip: int) -> dict[str, Any]:
    """`run` under `run_dir`'s lock."""
    run_dir = Path(cfg.run_dir)
    corpus = build_corpus(cfg.stdlib, cfg.packages, cfg.exclude_tests, cfg.heldout_fraction, cfg.max_source_mb,
                          cfg.max_files)
    train_texts, heldout_texts = corpus.train, corpus.heldout
    if not train_texts or not heldout_texts:
        raise CorpusError(f"corpus split left {len(train_texts)} train / {len(heldout_texts)} held-out files: "
                          "raise max_files or heldout_fraction")
    tok = _tokenizer(cfg, train_texts)
    eos = tok.eos_token_id
    train_windows = pack_documents(_encode(tok, train_texts), eos, cfg.seq_len)
    heldout_windows = pack_documents(_encode(tok, heldout_texts), eos, cfg.seq_len)[: cfg.eval_windows]
    print(f"corpus: {len(train_texts) + len(heldout_texts)} files ({len(train_texts)} train, {len(heldout_texts)} "
          f"held out) from {', '.join(corpus.manifest['sources'])}; "
          f"{train_windows.size:,} train tokens in {len(train_windows)} windows of {cfg.seq_len + 1}")

    mcfg = model_config(cfg, tok)
    model = Transformer(mcfg)
    optimizer = make_optimizer(cfg.optim, cfg.steps)

    def init_state() -> dict[str, Any]:
        if first_stage is not None:
            params = load_params(cfg.init_from, mcfg, dtype="float32")[0]
        else:
            params = init_params(mcfg, jax.random.key(cfg.seed))
        return {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}

    @jax.jit
    def train_step(state: dict[str, Any], batch: jax.Array) -> tuple[dict[str, Any], jax.Array]:
        loss, grads = jax.value_and_grad(lambda p: next_token_loss(model, p, batch))(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, loss

    def step_fn(state: dict[str, Any], batch: np.ndarray) -> tuple[dict[str, Any], dict[str, jax.Array]]:
        state, loss = train_step(state, jnp.asarray(batch))
        return state, {"loss": loss}

    print(f"model: {mcfg.num_params:,} parameters; {cfg.steps} steps of {cfg.batch_size}x{cfg.seq_len} tokens")
    loop = LoopConfig(steps=cfg.steps, checkpoint_every=cfg.checkpoint_every, keep_checkpoints=cfg.keep_checkpoints,
                      log_every=1)
    state, extra = run_loop(run_dir=run_dir, cfg=loop, init_state=init_state, train_step=step_fn,
                            data=iter(packed_dataset(train_windows, cfg.batch_size, cfg.seed, skip)),
                            tokens_per_batch=cfg.batch_size * cfg.seq_len, desc="pretrain")
    extra = extra | {"corpus": corpus.manifest}
    if first_stage is not None:
        extra |= {"first_stage": {k: first_stage[k] for k in ("tokens_seen", "steps", "train_seconds")}
                  | {"init_from": cfg.init_from, "windows_skipped": skip}}
    return export(cfg, mcfg, tok, state["params"], heldout_windows, heldout_texts, extra)


def export(cfg: PretrainConfig, mcfg: ModelConfig, tok: PreTrainedTokenizerBase, params: Any,
           heldout_windows: np.ndarray, heldout_texts: list[str], extra: dict[str, Any]) -> dict[str, Any]:
    """Write, evaluate and sample the export whole in a staging directory, then swap it for `export_dir` (an
    earlier export of this run stays readable until then; a killed export leaves it as it was)."""
    with staged_output(cfg.export_dir, "pretrain-target", replace=True) as staging:
        summary = _export(cfg, mcfg, tok, params, heldout_windows, heldout_texts, extra, staging)
    print(f"exported to {cfg.export_dir}")
    return summary


def _export(cfg: PretrainConfig, mcfg: ModelConfig, tok: PreTrainedTokenizerBase, params: Any,
            heldout_windows: np.ndarray, heldout_texts: list[str], extra: dict[str, Any], out: Path
            ) -> dict[str, Any]:
    save_params(params, mcfg, out, dtype="bfloat16")
    tok.save_pretrained(out)
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
           "do_sample": False}
    write_atomic(out / "generation_config.json", json.dumps(gen, indent=2) + "\n")
    write_atomic(out / "heldout_sample.txt", "\n".join(heldout_texts)[: cfg.heldout_sample_chars])

    # Evaluate what was shipped: the bf16 weights, computed in fp32.
    shipped = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
    model = Transformer(mcfg)
    loss = heldout_loss(model, shipped, heldout_windows, cfg.batch_size)
    bpb = None
    if cfg.bpb_package:
        bpb = {"package": cfg.bpb_package, "version": package_version(cfg.bpb_package),
               "bits_per_byte": round(bits_per_byte(model, shipped, tok, package_texts(
                   cfg.bpb_package, int(cfg.bpb_max_mb * 2**20)), cfg.seq_len, cfg.batch_size), 4)}
    prompts = [_encode(tok, [p])[0] for p in cfg.sample_prompts]
    tokens, lengths = pad_prompts(prompts, pad_id=tok.pad_token_id)
    cache = tokens.shape[1] + cfg.sample_tokens
    check_fits(lengths, cfg.sample_tokens, cache)
    result = generate(shipped, tokens, lengths, jax.random.key(0), config=mcfg, max_new_tokens=cfg.sample_tokens,
                      cache_size=cache, eos_ids=mcfg.eos_token_ids, pad_id=tok.pad_token_id)
    samples = {}
    for p, row, n in zip(cfg.sample_prompts, np.asarray(result.tokens), np.asarray(result.num_tokens),
                         strict=True):
        samples[p] = tok.decode(row[:n], skip_special_tokens=True)
        print(f"--- {p!r}\n{p}{samples[p]}")
    summary = {
        "parameters": mcfg.num_params,
        "tokens_seen": extra["tokens_seen"],
        "steps": extra["steps"],
        "train_seconds": round(extra["train_seconds"], 1),
        "first_stage": extra.get("first_stage"),
        "total_tokens_seen": extra["tokens_seen"] + (extra["first_stage"]["tokens_seen"] if "first_stage" in extra
                                                     else 0),
        "heldout_loss_nats_per_token": round(loss, 4),
        "heldout_windows": int(len(heldout_windows)),
        "heldout_package_bpb": bpb,
        "corpus": extra.get("corpus"),
        "final_train_loss": extra["last_metrics"].get("loss"),
        "config": dataclasses.asdict(cfg),
        "greedy_samples": samples,
    }
    write_atomic(out / "training_summary.json", json.dumps(summary, indent=2) + "\n")
    print(f"held-out loss: {loss:.4f} nats/token over {len(heldout_windows)} windows"
          + (f"; {bpb['bits_per_byte']} bits/byte on {cfg.bpb_package}" if bpb else ""))
    return summary
