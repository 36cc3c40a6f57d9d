"""`amphista-jax` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

DTYPE_CHOICES = ("checkpoint", "float32", "bfloat16", "float16")


def default_model() -> str:
    from amphista_jax.assets import default_model_dir

    return str(default_model_dir())


def _generate(args: argparse.Namespace) -> int:
    import jax
    import numpy as np

    from amphista_jax.decode import check_fits, generate, pad_prompts
    from amphista_jax.models.hf import load_params
    from amphista_jax.sampling import SamplingConfig
    from amphista_jax.tokenizer import encode_prompt, load_tokenizer, stop_token_ids

    params, config = load_params(args.model, dtype=args.dtype)
    tok = load_tokenizer(args.model)
    ids = encode_prompt(tok, args.prompt, chat=args.chat)
    tokens, lengths = pad_prompts([ids], pad_id=config.pad_token_id or 0)
    max_len = args.max_len or tokens.shape[1] + args.max_new_tokens
    check_fits(lengths, args.max_new_tokens, max_len)
    kwargs = dict(config=config, max_new_tokens=args.max_new_tokens, cache_size=max_len,
                  sampling=SamplingConfig(args.temperature, args.top_k, args.top_p),
                  eos_ids=stop_token_ids(args.model, tok, config), pad_id=config.pad_token_id or 0)
    rng = jax.random.key(args.seed)
    t0 = time.perf_counter()
    jax.block_until_ready(generate(params, tokens, lengths, rng, **kwargs))  # compile + warm-up
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = jax.block_until_ready(generate(params, tokens, lengths, rng, **kwargs))
    seconds = time.perf_counter() - t0
    n = int(out.num_tokens[0])
    text = tok.decode(np.asarray(out.tokens[0, :n]), skip_special_tokens=True)
    print(args.prompt + text if not args.chat else text)
    print(f"\n[{n} tokens in {seconds:.3f}s = {n / seconds:.1f} tokens/s; compile+first run {compile_s:.1f}s]",
          file=sys.stderr)
    return 0


def _pretrain_target(args: argparse.Namespace) -> int:
    from amphista_jax.config_io import load_config
    from train.pretrain_target import PretrainConfig, run

    run(load_config(PretrainConfig, args.config, args.overrides))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="amphista-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion with the target model (AR baseline)")
    g.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded tiny-code-llama)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--max-len", type=int, default=None, help="cache size (default: prompt + max-new-tokens)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32")
    g.set_defaults(func=_generate)

    p = sub.add_parser("pretrain-target", help="train the embedded default target model (recipe)")
    p.add_argument("--config", default="configs/target/tiny-code.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. steps=10 arch.num_layers=2")
    p.set_defaults(func=_pretrain_target)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "model", "unset") is None:
        args.model = default_model()
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
