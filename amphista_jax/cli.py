"""`amphista-jax` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from amphista_jax.assets import shipped_heads
from amphista_jax.drafters import DRAFTERS
from amphista_jax.drafters.base import Target
from amphista_jax.models.llama import ATTENTION_IMPLS
from amphista_jax.verify import ACCEPTANCE_RULES

DTYPE_CHOICES = ("checkpoint", "float32", "bfloat16", "float16")


def default_model() -> str:
    from amphista_jax.assets import default_model_dir

    return str(default_model_dir())


def _heads_dir(args: argparse.Namespace) -> str | None:
    """--heads; else the shipped --draft heads when the target is the embedded model; else None (untrained)."""
    from pathlib import Path

    from amphista_jax.assets import shipped_heads_dir

    if args.heads or not args.draft or Path(args.model).resolve() != Path(default_model()).resolve():
        return args.heads
    try:
        heads = str(shipped_heads_dir(args.draft))
    except FileNotFoundError:
        return None
    print(f"note: using the shipped {args.draft} heads ({heads})", file=sys.stderr)
    return heads


def _load_drafter(args: argparse.Namespace, heads: str | None, config, params):
    """(drafter, draft params) from `heads`, else untrained --draft heads initialised from the target."""
    import jax

    from amphista_jax.drafters.io import load_draft

    if heads:
        method, drafter, draft_params = load_draft(heads, config, params)
        if args.draft and args.draft != method:
            raise SystemExit(f"--draft {args.draft} but {heads} holds {method} heads")
        return drafter, draft_params
    print(f"note: no --heads given, using untrained {args.draft} heads (expect accept length ~1)", file=sys.stderr)
    drafter = DRAFTERS[args.draft]()
    return drafter, drafter.init(jax.random.key(args.seed), Target(config, params))


def _generate(args: argparse.Namespace) -> int:
    import functools

    import jax
    import numpy as np

    from amphista_jax.decode import check_fits, generate, pad_prompts, speculative_generate
    from amphista_jax.models.hf import load_params
    from amphista_jax.sampling import SamplingConfig
    from amphista_jax.tokenizer import colour_drafts, encode_prompt, load_tokenizer, stop_token_ids
    from amphista_jax.trees import get_tree
    from amphista_jax.verify import AcceptanceConfig

    speculative = bool(args.draft or args.heads)
    heads = _heads_dir(args) if speculative else None
    try:
        tree = get_tree(args.tree, heads) if speculative else None  # before any loading
    except ValueError as e:
        raise SystemExit(f"--tree {args.tree}: {e}") from None
    params, config = load_params(args.model, dtype=args.dtype)
    tok = load_tokenizer(args.model)
    ids = encode_prompt(tok, args.prompt, chat=args.chat)
    pad_id = config.pad_token_id or 0
    tokens, lengths = pad_prompts([ids], pad_id=pad_id)
    kwargs = dict(config=config, max_new_tokens=args.max_new_tokens, attention=args.attention,
                  sampling=SamplingConfig(args.temperature, args.top_k, args.top_p),
                  eos_ids=stop_token_ids(args.model, tok, config), pad_id=pad_id)
    reserve = 0
    if speculative:
        drafter, draft_params = _load_drafter(args, heads, config, params)
        reserve = tree.num_nodes
        run = functools.partial(speculative_generate, params, draft_params, drafter=drafter, tree=tree,
                                acceptance=AcceptanceConfig(args.acceptance), **kwargs)
    else:
        run = functools.partial(generate, params, **kwargs)
    max_len = args.max_len or tokens.shape[1] + args.max_new_tokens + reserve
    check_fits(lengths, args.max_new_tokens + reserve, max_len)
    rng = jax.random.key(args.seed)
    t0 = time.perf_counter()
    jax.block_until_ready(run(tokens, lengths, rng, cache_size=max_len))  # compile + warm-up
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = jax.block_until_ready(run(tokens, lengths, rng, cache_size=max_len))
    seconds = time.perf_counter() - t0
    n, steps = int(out.num_tokens[0]), int(out.steps)
    new = np.asarray(out.tokens[0, :n])
    text = colour_drafts(tok, new, np.asarray(out.drafted[0, :n])) if args.show_drafts else tok.decode(
        new, skip_special_tokens=True)
    print(text if args.chat else args.prompt + text)
    tau = (n - 1) / max(steps, 1)  # tokens per decoding forward; the prefill's token is not counted
    print(f"\n[{n} tokens in {seconds:.3f}s = {n / seconds:.1f} tokens/s; {steps} decoding forwards, "
          f"tau = {tau:.2f} tokens/forward; compile+first run {compile_s:.1f}s]", file=sys.stderr)
    return 0


def _task_range(text: str) -> tuple[int, int]:
    """argparse type of --tasks: `START:STOP`."""
    start, sep, stop = text.partition(":")
    if not sep or not start.isdigit() or not stop.isdigit() or int(start) >= int(stop):
        raise argparse.ArgumentTypeError(f"{text!r} is not a task range START:STOP with START < STOP, e.g. 100:164")
    return int(start), int(stop)


def _tree_search(args: argparse.Namespace) -> int:
    from pathlib import Path

    from amphista_jax.demo import humaneval_prompts
    from amphista_jax.drafters.io import META_FILE
    from amphista_jax.tree_search import TreeSearchError, output_paths, search
    from amphista_jax.trees import searched_tree_path

    for name in ("max_nodes", "ranks", "runs"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.max_new_tokens < 2:
        raise SystemExit(f"--max-new-tokens {args.max_new_tokens}: must be >= 2 (decode steps are timed)")
    if not (Path(args.heads) / META_FILE).is_file():
        raise SystemExit(f"--heads {args.heads}: not a draft-head checkpoint (no {META_FILE})")
    out = Path(args.out) if args.out else searched_tree_path(args.heads)
    if (taken := [str(p) for p in output_paths(out) if p.exists()]) and not args.replace:
        raise SystemExit(f"{', '.join(taken)} exist: pass --replace to search again and replace them, or --out "
                         "another file")
    try:
        prompts = humaneval_prompts(*args.tasks)
        result, tree = search(args.model, args.heads, prompts, out, max_nodes=args.max_nodes, ranks=args.ranks,
                              max_new_tokens=args.max_new_tokens, runs=args.runs)
    except (TreeSearchError, ValueError) as e:
        raise SystemExit(f"tree-search: {e}") from None
    print(out.with_suffix(".report.md").read_text())
    best = result.speedups[result.best]
    print(f"wrote {out} ({tree.num_nodes - 1} draft nodes, depth {tree.depth}); predicted speed-up {best:.2f}x"
          + ("" if best > 1 else ": no tree is predicted to beat autoregressive decoding on this device"))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from amphista_jax.assets import shipped_heads_dir
    from amphista_jax.demo import format_result, humaneval_prompt, run_demo

    if args.runs < 1:
        raise SystemExit(f"--runs {args.runs}: the demo needs at least one timed run per decoder")
    heads = args.heads or shipped_heads_dir(args.method)
    prompt = args.prompt if args.prompt is not None else humaneval_prompt(args.task)
    result = run_demo(args.model, heads, prompt, args.tree, args.max_new_tokens, args.runs)
    print(format_result(result))
    return 0 if result.identical else 1


def _pretrain_target(args: argparse.Namespace) -> int:
    from amphista_jax.config_io import load_config
    from train.pretrain_target import PretrainConfig, run

    run(load_config(PretrainConfig, args.config, args.overrides))
    return 0


def _convert(args: argparse.Namespace) -> int:
    """Re-save a checkpoint (dtype change, re-sharding into files of at most --max-shard-mb), or with --heads
    a draft-head checkpoint in another dtype (e.g. bf16 heads to ship)."""
    import shutil
    from pathlib import Path

    import jax

    from amphista_jax.models.hf import load_params, save_params

    source = args.heads or args.model
    if Path(args.out).resolve() == Path(source).resolve():
        raise SystemExit("--out must differ from the source checkpoint: convert writes a new checkpoint and never "
                         "overwrites its source")
    params, config = load_params(args.model, dtype="float32" if args.heads else args.dtype)
    if args.heads:
        from amphista_jax.drafters.io import load_draft, save_draft

        method, drafter, draft_params = load_draft(args.heads, config, params)
        dtype = None if args.dtype == "checkpoint" else args.dtype
        save_draft(args.out, method, drafter, draft_params, config, dtype=dtype)
        print(f"saved {method} heads ({sum(x.size for x in jax.tree.leaves(draft_params)):,} parameters, "
              f"{dtype or 'float32'}) to {args.out}")
        return 0
    out = save_params(params, config, args.out, dtype=args.dtype if args.dtype != "checkpoint" else "bfloat16",
                      max_shard_bytes=args.max_shard_mb * 2**20 if args.max_shard_mb else None)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                 "tokenizer.model", "chat_template.jinja"):
        if (Path(args.model) / name).is_file():
            shutil.copy(Path(args.model) / name, out / name)
    print(f"saved {config.num_params:,} parameters to {out}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from amphista_jax.config_io import load_config
    from train.heads import TrainConfig, train_heads

    train_heads(load_config(TrainConfig, args.config, args.set or []))
    return 0


def _distill(args: argparse.Namespace) -> int:
    from train.distill import distill

    distill(args.model, args.prompts, args.out, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
            prompt_len=args.prompt_len, chat=args.chat, temperature=args.temperature, seed=args.seed)
    return 0


def _eval(args: argparse.Namespace) -> int:
    import dataclasses

    from amphista_jax.config_io import load_config
    from evals.runner import EvalConfig, run_eval

    cfg = load_config(EvalConfig, args.config, args.set or [])
    if args.methods:
        cfg = dataclasses.replace(cfg, methods=tuple(args.methods))
    summary = run_eval(cfg)
    mismatches = (summary or {}).get("lossless", {}).get("mismatches", [])
    if mismatches:
        print(f"LOSSLESS CHECK FAILED: {len(mismatches)} prompt(s) differ from the AR baseline (listed in "
              f"{cfg.out_dir}/report.md)", file=sys.stderr)
        return 0 if cfg.allow_mismatch else 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="amphista-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion with the target model (AR baseline)")
    g.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded code-llama)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--max-len", type=int, default=None, help="cache size (default: prompt + max-new-tokens)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32")
    g.add_argument("--draft", choices=sorted(DRAFTERS), default=None, help="speculative decoding with this method")
    g.add_argument("--heads", default=None, help="draft-head checkpoint directory (implies --draft)")
    g.add_argument("--tree", default="auto", help="`auto` (the tree searched for the heads on this device), a "
                   "preset name or a JSON file of top-k paths")
    g.add_argument("--acceptance", choices=ACCEPTANCE_RULES, default=None,
                   help="default: greedy at temperature 0, lossless rejection sampling otherwise")
    g.add_argument("--attention", choices=ATTENTION_IMPLS, default="xla",
                   help="cached attention: dense XLA, or the Pallas tree-attention kernel (interpreted on CPU)")
    g.add_argument("--show-drafts", action="store_true", help="colour the tokens that came from the draft heads")
    g.set_defaults(func=_generate)

    m = sub.add_parser("demo", help="speculative decoding with the shipped heads vs AR on a HumanEval prompt")
    m.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded code-llama)")
    m.add_argument("--method", default="amphista", choices=shipped_heads(), help="which shipped heads to use")
    m.add_argument("--heads", default=None, help="draft-head checkpoint (default: the shipped --method heads)")
    source = m.add_mutually_exclusive_group()
    source.add_argument("--task", default="HumanEval/0", help="HumanEval task id whose prompt to complete")
    source.add_argument("--prompt", default=None, help="complete this text instead of a HumanEval prompt")
    m.add_argument("--tree", default="auto", help="`auto` (the tree searched for the heads on this device), a "
                   "preset name or a JSON file of top-k paths")
    m.add_argument("--max-new-tokens", type=int, default=128)
    m.add_argument("--runs", type=int, default=3, help="timed runs per decoder (median), after a warm-up")
    m.set_defaults(func=_demo)

    ts = sub.add_parser("tree-search", help="grow draft trees from acceptance statistics and time them on this "
                        "device; write the fastest (used by --tree auto)")
    ts.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded model)")
    ts.add_argument("--heads", required=True, help="draft-head checkpoint directory")
    ts.add_argument("--tasks", type=_task_range, default=(100, 164),
                    help="HumanEval task range START:STOP of the calibration prompts "
                    "(keep it apart from the evaluation set)")
    ts.add_argument("--max-nodes", type=int, default=63, help="budget: draft nodes, root not counted")
    ts.add_argument("--ranks", type=int, default=10, help="ranks per depth in the calibration tree")
    ts.add_argument("--max-new-tokens", type=int, default=96)
    ts.add_argument("--runs", type=int, default=3, help="timed runs per tree (median)")
    ts.add_argument("--out", default=None, help="tree JSON (default: <heads>/trees/<backend>.json)")
    ts.add_argument("--replace", action="store_true", help="replace an existing searched tree")
    ts.set_defaults(func=_tree_search)

    c = sub.add_parser("convert", help="re-save a HF checkpoint (or, with --heads, draft heads) in another dtype "
                       "or shard size")
    c.add_argument("--model", default=None, help="HF checkpoint directory (with --heads: their target; default: "
                   "the embedded code-llama)")
    c.add_argument("--heads", default=None, help="convert this draft-head checkpoint instead of the model")
    c.add_argument("--out", required=True)
    c.add_argument("--dtype", choices=DTYPE_CHOICES, default="bfloat16")
    c.add_argument("--max-shard-mb", type=int, default=0, help="0 = one file")
    c.set_defaults(func=_convert)

    t = sub.add_parser("train", help="train draft heads on a frozen target")
    t.add_argument("--config", required=True, help="YAML, e.g. configs/medusa/code.yaml")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    t.set_defaults(func=_train)

    d = sub.add_parser("distill", help="answer prompts with the target to make self-distillation data")
    d.add_argument("--model", default=None)
    d.add_argument("--prompts", required=True, help="JSONL of prompts (prompt / turns / conversations)")
    d.add_argument("--out", required=True, help="ShareGPT JSONL to append to (resumable)")
    d.add_argument("--batch-size", type=int, default=8)
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument("--prompt-len", type=int, default=256, help="prompts are left-truncated to this many tokens")
    d.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="use the chat template (default: when the tokenizer has one)")
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=_distill)

    e = sub.add_parser("eval", help="tau, tokens/s, speed-up, per-head accuracy of AR and draft methods on a "
                                    "benchmark (resumable, multi-process)")
    e.add_argument("--config", required=True, help="YAML, e.g. configs/eval/humaneval-code.yaml")
    e.add_argument("--methods", nargs="+", default=None,
                   help="override the config's methods: `ar`, a heads directory, `<method>:untrained`, each "
                        "optionally `label=...` and `...@tree`")
    e.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    e.set_defaults(func=_eval)

    p = sub.add_parser("pretrain-target", help="train the embedded default target model (recipe)")
    p.add_argument("--config", default="configs/target/code.yaml")
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
