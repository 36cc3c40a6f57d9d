"""Draft-head train-step throughput on a frozen target, per method: the whole step (target forward + drafter loss +
backward + AdamW) and the step on stored target states, the way the regenerated recipe trains.

    python -m amphista_jax.evals.benchmarks.train_throughput [--model DIR | --target llama-3-8b] [--dtype bfloat16]
        [--methods medusa hydra ...] [--batch-size 8] [--seq-len 256] [--draft-vocab-size 4096] [--steps 3]
        [--skip-forward] [--out runs/benchmarks]

For each method (its default settings; `eagle3` with the reference's 7 training-time-test steps): the full step on
random tokens (the target's forward inside it, its logits as the labels) and the step on stored states: the
target's last hidden state and the inputs of the layers the method reads (`captured`), in the store's dtypes,
and top-32 target labels with the KL to them (`loss.labels: target`, `loss.kind: kl`), over a draft
vocabulary of `--draft-vocab-size` ids (0: the whole vocabulary). Medians over `--steps` after a compiling warm-up,
on whatever backend JAX runs on; `--skip-forward` times the stored-state step alone. `--target` trains on random
weights of a known shape (`models.shapes`, made on the device: nothing to load), `--dtype` is the target's params'.
The stored-state step's FLOPs are XLA's count of its compiled program (`memory_plan.loop_free_flops`; None where a
loop of it multiplies); the full step's are not counted (its target's layers are a scanned loop). Writes
train_throughput.{json,md}.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from amphista_jax.drafters import DRAFTERS
from amphista_jax.engine.memory_plan import loop_free_flops
from amphista_jax.evals.benchmarks.common import benchmark_parser, load_target, median_seconds, write_report
from amphista_jax.evals.benchmarks.step_time import random_target
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Transformer
from amphista_jax.models.shapes import KNOWN_TARGETS
from amphista_jax.models.target import Target
from amphista_jax.train.config import LossConfig
from amphista_jax.train.examples import stored_fields
from amphista_jax.train.optim import OptimConfig, make_optimizer
from amphista_jax.train.step import make_steps

SETTINGS: dict[str, dict[str, Any]] = {"eagle3": {"ttt_steps": 7}}  # the recipes' settings where not the default
LABEL_TOP_K = LossConfig().top_k


def stored_batch(tokens: jax.Array, config: ModelConfig, captures: int, rng: np.random.RandomState) -> dict:
    """A batch as the hidden-state and label store gives it (`examples.stored_fields`: its fields, widths and
    dtypes): random states, top-k label ids and descending log-probs."""
    b, t = tokens.shape
    batch = {"tokens": tokens, "loss_mask": jnp.ones_like(tokens)}
    for name, (width, dtype) in stored_fields(config.hidden_size, captures, LABEL_TOP_K).items():
        if name == "label_ids":
            batch[name] = jnp.asarray(rng.randint(0, config.vocab_size, (b, t, width)), dtype)
        elif name == "label_logp":
            batch[name] = jnp.asarray(np.sort(-5 * rng.rand(b, t, width) - 1, -1)[..., ::-1], dtype)
        else:
            batch[name] = jnp.asarray(rng.randn(b, t, width), dtype)
    return batch


def time_method(method: str, model: Transformer, params: dict, tokens: jax.Array, draft_vocab_size: int,
                steps: int, skip_forward: bool) -> dict:
    """Median seconds of one method's full step (unless `skip_forward`) and stored-state step, and the FLOPs of the
    stored-state step where XLA counts them."""
    config = model.config
    settings = SETTINGS.get(method, {})
    if draft_vocab_size and "draft_vocab" in DRAFTERS[method].__dataclass_fields__:
        settings = settings | {"draft_vocab": tuple(range(draft_vocab_size))}
    drafter = DRAFTERS[method](**settings)
    optimizer = make_optimizer(OptimConfig(), 1000)
    heads = drafter.init(jax.random.key(0), Target(config, params))
    fresh = {"params": heads, "opt_state": optimizer.init(heads), "step": jnp.zeros((), jnp.int32)}
    row: dict[str, Any] = {"method": method, "settings": {k: v for k, v in settings.items() if k != "draft_vocab"},
                           "draft_vocab_size": draft_vocab_size if "draft_vocab" in settings else 0}

    def timed(batch: dict, loss: LossConfig) -> tuple[float, jax.stages.Compiled]:
        state = jax.tree.map(jnp.copy, fresh)  # the step donates its state
        step = make_steps(model, drafter, optimizer, loss=loss)[0].compile(state, params, batch)

        def run() -> jax.Array:
            nonlocal state
            state, metrics = step(state, params, batch)
            return metrics["loss"]
        return median_seconds(run, steps), step

    if not skip_forward:
        row["step_s"] = timed({"tokens": tokens, "loss_mask": jnp.ones_like(tokens)}, LossConfig())[0]
    captures = len(drafter.captured_layers(config))
    kl = LossConfig(labels="target", kind="kl", top_k=LABEL_TOP_K)
    row["stored_step_s"], step = timed(stored_batch(tokens, config, captures, np.random.RandomState(1)), kl)
    row["stored_step_flops"] = loop_free_flops(step)
    return row


def main() -> None:
    parser = benchmark_parser(__doc__)
    trainable = sorted(name for name, cls in DRAFTERS.items() if cls.trainable and not cls.loss_runs_target)
    parser.add_argument("--target", choices=list(KNOWN_TARGETS), help="random weights of this shape, not --model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the target's params")
    parser.add_argument("--methods", nargs="+", default=["medusa", "hydra", "amphista", "sar", "eagle3", "dflash"],
                        choices=trainable)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--draft-vocab-size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--skip-forward", action="store_true")
    args = parser.parse_args()
    if args.target and args.model:
        parser.error("--target (random weights of a known shape) and --model (a checkpoint) exclude each other")
    if args.target:
        (params, config), model_dir = random_target(args.target, args.dtype, "stacked"), args.target
    else:
        model_dir, params, config = load_target(args.model, layout="stacked")
        params = jax.tree.map(lambda x: x.astype(args.dtype), params)
    model = Transformer(config)
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, config.vocab_size, (args.batch_size, args.seq_len)),
                         jnp.int32)
    n = args.batch_size * args.seq_len
    rows = [time_method(m, model, params, tokens, args.draft_vocab_size, args.steps, args.skip_forward)
            for m in args.methods]
    lines = [f"{model_dir} ({args.dtype}), batch {args.batch_size} x {args.seq_len}, draft vocabulary "
             f"{args.draft_vocab_size or 'whole'}, backend {jax.default_backend()}", "",
             "| method | settings | step ms (target forward inside) | stored-state step ms | stored-state tokens/s |",
             "|---|---|---:|---:|---:|"]
    for row in rows:
        full = f"{row['step_s'] * 1e3:.0f}" if "step_s" in row else "-"
        lines.append(f"| {row['method']} | {row['settings'] or '-'} | {full} | {row['stored_step_s'] * 1e3:.0f} | "
                     f"{n / row['stored_step_s']:.0f} |")
    write_report(args.out, "train_throughput", {"model": model_dir, "dtype": args.dtype, "batch_size": args.batch_size,
                                                "seq_len": args.seq_len, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
