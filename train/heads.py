"""Train draft heads on a frozen target: `amphista-jax train --config configs/medusa/tiny-code.yaml`.

Every draft method trains through here: the method comes from `DRAFTERS[method](**method_settings)` and
only its `init` and `loss` are used. Data is ShareGPT-style conversations (chat template, assistant-only
loss) or plain text/code; the target is sharded over a `(data, fsdp, tensor)` mesh; the loop (checkpoints,
resume, SIGTERM, progress, JSONL metrics) is `train.loop.run_loop`. At the end the heads are saved with the
target's fingerprint (`out_dir/heads`) and the training curve is plotted (`out_dir/training_curve.png`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from amphista_jax import config_io
from amphista_jax.assets import default_model_dir
from amphista_jax.drafters import DRAFTERS, Target
from amphista_jax.drafters.io import save_draft
from amphista_jax.models.hf import load_config, load_params
from amphista_jax.models.llama import Transformer
from amphista_jax.sharding import make_mesh, param_shardings
from amphista_jax.tokenizer import load_tokenizer
from train.corpus import build_corpus
from train.data import DataError, conversation_examples, example_dataset, packed_examples, text_examples
from train.loop import LoopConfig, maybe_initialize_distributed, mean_metrics, read_metrics, run_loop
from train.optim import OptimConfig, make_optimizer
from train.pretrain_target import PretrainConfig
from train.step import make_steps, target_forward

DATA_KINDS = ("text", "sharegpt", "stdlib")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # "text": files (a directory or a glob), packed; "sharegpt": conversations JSON / JSONL; "stdlib": the
    # offline code corpus of an embedded target's pre-training (`train/corpus.py`), split by path hash exactly
    # as there, so the target's held-out files stay unseen (`train` / `heldout` are then ignored).
    kind: str = "text"
    train: str = ""
    heldout: str = ""  # "" = hold out `heldout_fraction` of the training examples
    heldout_fraction: float = 0.05  # kind "stdlib" with a `corpus`: the recipe's own fraction is used
    # kind "stdlib": whose corpus: a target recipe YAML, or an exported target directory (its
    # training_summary.json); "" = the standard library alone
    corpus: str = ""
    max_len: int = 256
    batch_size: int = 8
    seed: int = 0
    cache_target_hidden: bool = False  # precompute the target's hidden states once (small targets)

    def __post_init__(self) -> None:
        if self.kind not in DATA_KINDS:
            raise ValueError(f"data.kind {self.kind!r} must be one of {', '.join(DATA_KINDS)}")
        if not self.train and self.kind != "stdlib":
            raise ValueError("data.train is empty: set it to a conversations file, a directory or a glob")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = 1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    data: DataConfig
    model: str = ""  # HF checkpoint directory; "" = the embedded default
    out_dir: str = "runs/heads"
    method: str = "medusa"
    method_settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    optim: OptimConfig = OptimConfig(lr=1e-3, warmup_steps=50, b1=0.9, b2=0.999)
    part_lrs: dict[str, float] = dataclasses.field(default_factory=dict)
    loop: LoopConfig = LoopConfig()
    mesh: MeshConfig | None = None  # None = single device
    dtype: str = "float32"  # target params
    eval_batches: int = 4

    def __post_init__(self) -> None:
        if self.method not in DRAFTERS:
            raise ValueError(f"method {self.method!r} is not one of {', '.join(DRAFTERS)}")
        known = {f.name for f in dataclasses.fields(DRAFTERS[self.method])}
        if unknown := set(self.method_settings) - known:
            raise ValueError(f"method_settings {sorted(unknown)} are not {self.method} settings; "
                             f"known: {', '.join(sorted(known))}")
        DRAFTERS[self.method](**self.method_settings)  # the method validates its own values


def _stdlib_texts(cfg: DataConfig) -> tuple[list[str], list[str]]:
    if cfg.corpus:
        summary = Path(cfg.corpus) / "training_summary.json"
        t = (config_io.from_dict(PretrainConfig, json.loads(summary.read_text())["config"]) if summary.is_file()
             else config_io.load_config(PretrainConfig, cfg.corpus, []))
        corpus = build_corpus(t.stdlib, t.packages, t.exclude_tests, t.heldout_fraction, t.max_source_mb)
    else:
        corpus = build_corpus(True, (), False, cfg.heldout_fraction)
    print(f"code corpus ({', '.join(corpus.manifest['sources'])}): {len(corpus.train)} train / "
          f"{len(corpus.heldout)} held-out files")
    return corpus.train, corpus.heldout


def split_examples(cfg: DataConfig, tok: Any) -> tuple[list, list]:
    """(train, held-out) examples of `cfg`: its held-out file, else a seeded `heldout_fraction` split."""
    if cfg.kind == "stdlib":
        train_texts, heldout_texts = _stdlib_texts(cfg)
        return packed_examples(train_texts, tok, cfg.max_len), packed_examples(heldout_texts, tok, cfg.max_len)
    load = (lambda src: conversation_examples(src, tok, cfg.max_len)) if cfg.kind == "sharegpt" else (
        lambda src: text_examples(src, tok, cfg.max_len))
    train, report = load(cfg.train)
    print(report.summary())
    if cfg.heldout:
        heldout, held_report = load(cfg.heldout)
        print(held_report.summary())
        return train, heldout
    order = np.random.RandomState(cfg.seed).permutation(len(train))
    n_held = max(1, int(len(train) * cfg.heldout_fraction))
    if len(train) - n_held < cfg.batch_size:
        raise DataError(f"{cfg.train} has {len(train)} examples: too few for a held-out split and a batch of "
                        f"{cfg.batch_size}; add data or set data.heldout")
    return [train[i] for i in order[n_held:]], [train[i] for i in order[:n_held]]


def heldout_examples(cfg: DataConfig, tok: Any) -> list:
    """The held-out examples of `split_examples` (for the stdlib corpus, without tokenising the train split)."""
    if cfg.kind == "stdlib":
        return packed_examples(_stdlib_texts(cfg)[1], tok, cfg.max_len)
    return split_examples(cfg, tok)[1]


def batch_examples(examples: list[dict], batch_size: int, max_batches: int) -> list[dict[str, np.ndarray]]:
    """Up to `max_batches` full batches (fixed, shardable shapes) of `examples`, in order."""
    n = min(len(examples) // batch_size, max_batches)
    if n == 0:
        raise DataError(f"{len(examples)} held-out examples are fewer than one batch of {batch_size}: add held-out "
                        "data, raise data.heldout_fraction or lower data.batch_size")
    return [{k: np.stack([e[k] for e in examples[i * batch_size: (i + 1) * batch_size]]) for k in examples[0]}
            for i in range(n)]


def _with_hidden(examples: list[dict], model: Transformer, target_params: dict, batch: int) -> list[dict]:
    """Attach the target's hidden states `[T, D]` (fp16 on host) to every example."""
    forward = jax.jit(lambda p, t: target_forward(model, p, {"tokens": t}).hidden.astype(jnp.float16))
    out = []
    for i in range(0, len(examples), batch):
        chunk = examples[i: i + batch]
        hidden = np.asarray(forward(target_params, jnp.asarray(np.stack([e["tokens"] for e in chunk]))))
        out += [e | {"hidden": h} for e, h in zip(chunk, hidden, strict=True)]
    return out


def train_heads(cfg: TrainConfig) -> dict[str, Any]:
    maybe_initialize_distributed()
    model_dir = cfg.model or str(default_model_dir())
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) if cfg.mesh else None
    target_config = load_config(model_dir)
    shardings = param_shardings(target_config, mesh) if mesh else None
    target_params, target_config = load_params(model_dir, dtype=cfg.dtype, shardings=shardings)
    tok = load_tokenizer(model_dir)
    model = Transformer(target_config)
    drafter = DRAFTERS[cfg.method](**cfg.method_settings)
    train_examples, heldout = split_examples(cfg.data, tok)
    if cfg.data.cache_target_hidden:
        train_examples = _with_hidden(train_examples, model, target_params, cfg.data.batch_size)
        heldout = _with_hidden(heldout, model, target_params, cfg.data.batch_size)
    optimizer = make_optimizer(cfg.optim, cfg.loop.steps, cfg.part_lrs or None)
    train_step, eval_step = make_steps(model, drafter, optimizer, mesh, shardings)

    def init_state() -> dict[str, Any]:
        params = drafter.init(jax.random.key(cfg.data.seed), Target(target_config, target_params))
        return {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}

    heldout_batches = batch_examples(heldout, cfg.data.batch_size, cfg.eval_batches)

    def evaluate(state: dict[str, Any]) -> dict[str, float]:
        return mean_metrics([eval_step(state["params"], target_params, b) for b in heldout_batches])

    print(f"target {model_dir}: {target_config.num_params:,} parameters; method {cfg.method} "
          f"{dataclasses.asdict(drafter)}; {len(train_examples)} train / {len(heldout)} held-out examples")
    out_dir = Path(cfg.out_dir)
    before = evaluate(init_state())
    state, extra = run_loop(
        run_dir=out_dir, cfg=cfg.loop, init_state=init_state,
        train_step=lambda s, b: train_step(s, target_params, b),
        data=iter(example_dataset(train_examples, cfg.data.batch_size, cfg.data.seed)), evaluate=evaluate,
        tokens_per_batch=cfg.data.batch_size * cfg.data.max_len * jax.process_count(), desc=f"train {cfg.method}")
    summary = {
        "method": cfg.method, "settings": dataclasses.asdict(drafter), "model": model_dir,
        "steps": extra["steps"], "tokens_seen": extra["tokens_seen"], "train_seconds": round(extra["train_seconds"], 1),
        "heldout_before": before, "heldout_after": extra["eval"],
    }
    save_draft(out_dir / "heads", cfg.method, drafter, state["params"], target_config)  # collective in orbax
    if jax.process_index() == 0:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_curve(out_dir)
    print(json.dumps({"heldout_before": before, "heldout_after": extra["eval"]}, indent=2))
    return summary


def plot_curve(run_dir: str | Path) -> Path:
    """`training_curve.png`: train loss and held-out per-head top-1 accuracy over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    train = [r for r in rows if "loss" in r]
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    evals = [r for r in rows if "eval/loss" in r]
    ax_loss.plot([r["step"] for r in evals], [r["eval/loss"] for r in evals], "o-", label="held-out")
    ax_loss.set(xlabel="step", ylabel="loss", title="draft loss")
    ax_loss.legend()
    heads = sorted({k.split("/")[1] for r in evals for k in r if k.startswith("eval/head") and k.endswith("/top1")})
    for h in heads:
        ax_acc.plot([r["step"] for r in evals], [r[f"eval/{h}/top1"] for r in evals], "o-", label=h)
    ax_acc.set(xlabel="step", ylabel="held-out top-1", title="per-head accuracy")
    if heads:
        ax_acc.legend()
    fig.tight_layout()
    path = Path(run_dir) / "training_curve.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
