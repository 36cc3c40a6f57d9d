"""Train-step throughput for draft heads on a frozen target, and the share of time in the target forward.

    python -m amphista_jax.evals.benchmarks.train_throughput [--model DIR] [--method medusa] [--batch-size 8]
                                                [--seq-len 256] [--steps 10] [--out runs/benchmarks]

Times (medians over `--steps` after a warm-up) the full jitted train step (target forward + drafter loss +
backward + AdamW), the target forward alone, and the step on precomputed target hidden states
(`data.cache_target_hidden`), on whatever backend JAX runs on. Writes train_throughput.{json,md}.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from amphista_jax.drafters import DRAFTERS
from amphista_jax.evals.benchmarks.common import benchmark_parser, load_target, median_seconds, write_report
from amphista_jax.models.llama import Transformer
from amphista_jax.target import Target
from amphista_jax.train.optim import OptimConfig, make_optimizer
from amphista_jax.train.step import make_steps, target_forward


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--method", default="medusa", choices=sorted(DRAFTERS))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    model_dir, params, config = load_target(args.model, layout="stacked")
    model = Transformer(config)
    drafter = DRAFTERS[args.method]()
    optimizer = make_optimizer(OptimConfig(), 1000)
    heads = drafter.init(jax.random.key(0), Target(config, params))
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, config.vocab_size, (args.batch_size, args.seq_len)),
                         jnp.int32)
    batch = {"tokens": tokens, "loss_mask": jnp.ones_like(tokens)}
    train_step, _ = make_steps(model, drafter, optimizer)
    state = {"params": heads, "opt_state": optimizer.init(heads), "step": jnp.zeros((), jnp.int32)}

    def full():
        nonlocal state
        state, metrics = train_step(state, params, batch)
        return metrics["loss"]

    forward = jax.jit(lambda p, b: target_forward(model, p, b).hidden)
    hidden = forward(params, batch)
    cached_batch = batch | {"hidden": hidden}

    def cached():
        nonlocal state
        state, metrics = train_step(state, params, cached_batch)
        return metrics["loss"]

    t_full = median_seconds(full, args.steps)
    t_forward = median_seconds(lambda: forward(params, batch), args.steps)
    t_cached = median_seconds(cached, args.steps)
    n = args.batch_size * args.seq_len
    row = {"model": model_dir, "parameters": config.num_params, "method": args.method, "backend": jax.default_backend(),
           "batch_size": args.batch_size, "seq_len": args.seq_len, "step_s": t_full, "tokens_per_s": n / t_full,
           "target_forward_s": t_forward, "target_forward_fraction": t_forward / t_full,
           "cached_hidden_step_s": t_cached, "cached_hidden_tokens_per_s": n / t_cached}
    table = "\n".join([
        "| backend | method | batch x len | train tok/s | step ms | target forward share | tok/s with cached hidden |",
        "|---|---|---|---|---|---|---|",
        f"| {row['backend']} | {args.method} | {args.batch_size}x{args.seq_len} | {row['tokens_per_s']:.0f} | "
        f"{t_full * 1e3:.1f} | {row['target_forward_fraction']:.0%} | {row['cached_hidden_tokens_per_s']:.0f} |"])
    write_report(args.out, "train_throughput", row, table)


if __name__ == "__main__":
    main()
