"""Accelerator facts in one prepared script: the benchmarks a GPU or TPU lease should run, in a fixed order, under
one time budget, each stage's results written as soon as it ends.

    python -m amphista_jax.evals.benchmarks.accelerator_facts --out DIR [--budget-s 540] [--target llama-3-8b]
        [--small]

Stages, in this order, each started when the previous one ends and run as a child process of its own under a time
limit (this process starts no JAX backend: on a GPU it would hold most of the memory the stages need):

1. `bandwidth`: the memory bandwidth probe (`ar_decode.memory_bandwidth`: fp32, one row: the roofline's bandwidth),
   the bf16 product ceilings at the AR stage's batch sizes, and the share of the data sheet's bandwidth
   (`infra.accelerators`) where the device is one of those named there.
2. `ar_step`: the AR decode step of `--target`'s shape with random bf16 weights, split and stacked layouts, batch 1
   and 16 (`StepClock.ar_step_seconds`, step_time's clock, on a 512-token prompt), against the roofline: bytes per
   step (the weights and the KV cache at the clock's cache size) over stage 1's bandwidth (measured by this stage
   where stage 1 gave none).
3. `weight_traffic`: the weights the compiled decode loop copies or slices per step (`decode_profile.weight_moves`)
   for AR split, AR stacked and EAGLE-3 on the dynamic tree (split), compiled from bf16 shapes on this backend.
4. `spec_step`: `step_time` of `SPEC_PAIRS` next to the AR step, split layout, bf16, batch 1 and 16.
5. `train_step`: `train_throughput` of EAGLE-3 and DFlash at SmolLM2's shape and `--target`'s, bf16 target: tokens/s
   of the full and stored-state steps, and the stored-state step's model-flops utilisation (XLA's FLOP count of the
   compiled step / seconds / the data sheet's dense bf16 peak; none where the device or the count is unknown).
6. `kernel_tests`: the compiled Pallas kernel tests (`pytest tests/test_tree_attention.py -k Device`), counted from
   their JUnit report: "passed", "failed", or "skipped" where every test skipped (CPUs skip them).

Each stage gets `remaining budget x its share / the shares of the stages not yet run` seconds (at least
`MIN_STAGE_S`, at most what remains); one that cannot get `MIN_STAGE_S` is "not run: budget". A child still running
at its limit is killed ("timed out": what it wrote is kept), one that exits with an error makes its stage "failed"
with the last line of its stderr, and the next stage runs either way. DIR/facts.json and DIR/facts.md are written
before and after every stage: each stage's status, wall and limit seconds, error and results (each stage's own
reports and its children's output under DIR/<stage>/), the device (`jax.devices()[0].device_kind`, as a stage
reports it) and machine, the jax version and this command. The sizes are `Sizes.of`'s; `--small` runs every stage
at the `tiny` shape, batch 1 and fewer repetitions (a test on CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from amphista_jax.choice.step_clock import StepClock
from amphista_jax.drafters import VARIANTS
from amphista_jax.evals.benchmarks.ar_decode import memory_bandwidth
from amphista_jax.evals.benchmarks.common import nbytes, write_report
from amphista_jax.evals.benchmarks.decode_profile import decode_program, weight_moves
from amphista_jax.evals.benchmarks.step_time import random_target
from amphista_jax.facade.generator import Generator
from amphista_jax.facade.target import LoadedTarget
from amphista_jax.infra.accelerators import ACCELERATORS, Accelerator
from amphista_jax.infra.output_lock import write_atomic
from amphista_jax.models.llama import param_shapes
from amphista_jax.models.shapes import KNOWN_TARGETS
from amphista_jax.trees.names import get_tree

MODULE = "amphista_jax.evals.benchmarks.accelerator_facts"
ROOT = Path(__file__).resolve().parents[2]  # the repository: the kernel tests' home and every child's directory
KERNEL_TESTS = ROOT / "tests" / "test_tree_attention.py"
MIN_STAGE_S = 10.0
NOT_RUN = "not run: budget"
SPEC_PAIRS = ("eagle3@dynamic", "dflash@chain-15", "medusa@mc_sim_7b_63")
TRAIN_METHODS = ("eagle3", "dflash")
TREE_SLOTS = 256  # cache slots beyond the prompt for the weight-traffic programs: the new tokens and a tree's scratch
# device kinds (`jax.devices()[0].device_kind`, by substring, first match) of the accelerators `infra.accelerators`
# has data sheets for
DEVICE_KINDS = (("H200", "H200"), ("H100 80GB HBM3", "H100-SXM"), ("A100-SXM4-80GB", "A100-80GB"),
                ("TPU v4", "TPU-v4"), ("TPU v5 lite", "TPU-v5e"), ("TPU v5", "TPU-v5p"), ("TPU v6 lite", "TPU-v6e"))


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shapes and repetitions every stage runs at."""

    target: str  # `models.shapes` name of the decode stages' target
    train_targets: tuple[str, ...]
    batches: tuple[int, ...]  # decode batch sizes
    context: int  # prompt tokens of a decode
    new_tokens: int  # tokens a timed decode writes
    runs: int  # timed runs of a decode
    train_rows: int
    train_len: int
    draft_vocab_size: int
    train_steps: int
    skip_forward: bool  # time the stored-state train step alone
    ceilings: bool  # measure the bf16 product ceilings in stage 1 (each probe makes a 512 MiB random matrix)
    # the weight-traffic programs' params: XLA:CPU fuses a bf16 weight's slice with its convert to fp32 (its products'
    # input), which `weight_moves` does not count as a move, so on a CPU only fp32 shows the stacked layout's copies
    weight_dtype: str

    @classmethod
    def of(cls, target: str, small: bool) -> Sizes:
        """The sizes of a run on `target` (SmolLM2's shape beside it for training), or of a `small` one."""
        if small:
            return cls(target="tiny", train_targets=("tiny",), batches=(1,), context=16, new_tokens=16, runs=1,
                       train_rows=2, train_len=16, draft_vocab_size=64, train_steps=1, skip_forward=True,
                       ceilings=False, weight_dtype="float32")
        return cls(target=target, train_targets=tuple(dict.fromkeys(("smollm2-135m", target))), batches=(1, 16),
                   context=512, new_tokens=32, runs=3, train_rows=8, train_len=256, draft_vocab_size=4096,
                   train_steps=3, skip_forward=False, ceilings=True, weight_dtype="bfloat16")


def accelerator(device_kind: str | None) -> Accelerator | None:
    """The data sheet of the device `device_kind` names, if `infra.accelerators` has it."""
    return next((ACCELERATORS[name] for kind, name in DEVICE_KINDS if device_kind and kind in device_kind), None)


# ---- the stages run in the child processes ----

def bandwidth_stage(sizes: Sizes, out: Path) -> None:
    """Stage 1: the memory bandwidth probe and the bf16 product ceilings; `bandwidth.{json,md}` in `out`."""
    bandwidth = memory_bandwidth()
    ceilings = {str(b): memory_bandwidth("bfloat16", b) for b in sizes.batches if sizes.ceilings}
    kind = jax.devices()[0].device_kind
    sheet = accelerator(kind)
    data = {"device_kind": kind, "backend": jax.default_backend(), "bandwidth_bytes_per_s": bandwidth,
            "bf16_product_bytes_per_s": ceilings, "data_sheet": sheet and sheet.name,
            "share_of_data_sheet": sheet and bandwidth / sheet.bandwidth}
    lines = [f"Device: {kind}. Memory bandwidth (fp32 matrix-vector product over 512 MiB): {bandwidth / 1e9:.1f} GB/s"
             + (f", {bandwidth / sheet.bandwidth:.0%} of the {sheet.name} data sheet's "
                f"{sheet.bandwidth / 1e12:.2f} TB/s." if sheet else " (no data sheet for this device)."), "",
             "| bf16 rows | product GB/s |", "|---:|---:|"]
    lines += [f"| {b} | {v / 1e9:.1f} |" for b, v in ceilings.items()]
    write_report(out, "bandwidth", data, "\n".join(lines))


def ar_step_stage(sizes: Sizes, out: Path, bandwidth: float | None) -> None:
    """Stage 2: the AR decode step, split and stacked layouts, each batch size, against the roofline;
    `ar_step.{json,md}` in `out` after every row. Both layouts' weights stay on the device (made on first use)."""
    bandwidth = bandwidth or memory_bandwidth()
    config = KNOWN_TARGETS[sizes.target]()
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, sizes.context).tolist()
    gens: dict[str, Generator] = {}
    rows = []
    for batch in sizes.batches:
        for layout in ("split", "stacked"):
            if layout not in gens:
                params, config = random_target(sizes.target, "bfloat16", layout)
                gens[layout] = Generator.load(LoadedTarget.from_params(config, params))
            gen = gens[layout]
            clock = StepClock.for_trees([gen], prompt, [], sizes.new_tokens, sizes.runs, batch)
            step_s = clock.ar_step_seconds(gen)
            weights = nbytes(gen.params)
            cache = 2 * config.num_layers * batch * clock.cache_size * config.num_kv_heads * config.head_dim * 2  # bf16
            rows.append({"layout": layout, "batch": batch, "step_ms": step_s * 1e3, "tokens_per_s": batch / step_s,
                         "weight_bytes": weights, "cache_bytes": cache, "bytes_per_step": weights + cache,
                         "roofline_ms": (weights + cache) / bandwidth * 1e3,
                         "roofline_share": (weights + cache) / bandwidth / step_s})
            write_report(out, "ar_step", {"target": sizes.target, "device_kind": jax.devices()[0].device_kind,
                                          "context": sizes.context, "bandwidth_bytes_per_s": bandwidth, "rows": rows},
                         ar_step_table(rows, sizes, bandwidth))


def ar_step_table(rows: list[dict], sizes: Sizes, bandwidth: float) -> str:
    lines = [f"{sizes.target}, random bf16 weights, prompt {sizes.context} tokens; roofline = bytes per step / "
             f"{bandwidth / 1e9:.1f} GB/s", "",
             "| layout | batch | step ms | tokens/s | GB/step (weights + cache) | roofline ms | share of roofline |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['layout']} | {r['batch']} | {r['step_ms']:.3f} | {r['tokens_per_s']:.1f} | "
              f"{r['bytes_per_step'] / 1e9:.3f} | {r['roofline_ms']:.3f} | {r['roofline_share']:.0%} |" for r in rows]
    return "\n".join(lines)


def weight_traffic_stage(sizes: Sizes, out: Path) -> None:
    """Stage 3: the weights each compiled decode loop moves per step (`weight_moves`), one program at a time;
    `weight_traffic.{json,md}` in `out` after every program."""
    config = KNOWN_TARGETS[sizes.target]()
    programs = (("AR", "split", None, None), ("AR", "stacked", None, None),
                ("eagle3@dynamic", "split", VARIANTS["eagle3"], get_tree("dynamic")))
    rows = []
    for name, layout, drafter, tree in programs:
        params = param_shapes(config, jnp.dtype(sizes.weight_dtype), split=layout == "split")[0]
        hlo = decode_program(config, params, 1, sizes.context + TREE_SLOTS, drafter, tree)
        moved = weight_moves(hlo, config.num_layers)
        rows.append({"program": name, "layout": layout, "weight_moves": len(moved),
                     "weight_move_bytes_per_step": sum(b for *_, b in moved),
                     "moved": sorted({f"{w} ({op})" for w, op, _ in moved})})
        write_report(out, "weight_traffic", {"target": sizes.target, "dtype": sizes.weight_dtype,
                                             "device_kind": jax.devices()[0].device_kind, "rows": rows},
                     weight_traffic_table(rows, sizes.weight_dtype))


def weight_traffic_table(rows: list[dict], dtype: str) -> str:
    """The rows, and a warning where the check saw no per-layer copy in the stacked layout either."""
    lines = [f"Weights moved into buffers of their own per step of the compiled decode loop (batch 1, {dtype}).", "",
             "| program | layout | weight moves per step | GB per step |", "|---|---|---:|---:|"]
    lines += [f"| {r['program']} | {r['layout']} | {r['weight_moves']} | {r['weight_move_bytes_per_step'] / 1e9:.4f} |"
              for r in rows]
    if any(r["layout"] == "stacked" and not r["weight_moves"] for r in rows):
        lines += ["", "The stacked layout shows no per-layer weight copy either: this backend reads the layers' slices "
                      "in place, or the check misses the copies here (as on XLA:CPU in bf16), so the split layout's "
                      "zeros are no proof on their own."]
    return "\n".join(lines)


# ---- what the parent runs and reads of each stage ----

def own_stage(name: str) -> Callable[[argparse.Namespace, Path, dict], list[list[str]]]:
    """The commands of a stage this module runs in a child (`--stage name`)."""
    def commands(args: argparse.Namespace, folder: Path, facts: dict) -> list[list[str]]:
        argv = [sys.executable, "-m", MODULE, "--stage", name, "--out", str(folder), "--target", args.target]
        bandwidth = facts["stages"]["bandwidth"].get("result", {}).get("bandwidth_bytes_per_s")
        return [argv + (["--small"] if args.small else []) + (["--bandwidth", repr(bandwidth)] if bandwidth else [])]
    return commands


def spec_step_commands(args: argparse.Namespace, folder: Path, facts: dict) -> list[list[str]]:
    """`step_time` of `SPEC_PAIRS` beside the AR step: it writes its report after every batch size."""
    s = Sizes.of(args.target, args.small)
    return [[sys.executable, "-m", "amphista_jax.evals.benchmarks.step_time", "--target", s.target, "--dtype",
             "bfloat16", "--layout", "split", "--context", str(s.context), "--batch", *map(str, s.batches),
             "--pairs", *SPEC_PAIRS, "--new-tokens", str(s.new_tokens), "--runs", str(s.runs), "--out", str(folder)]]


def train_step_commands(args: argparse.Namespace, folder: Path, facts: dict) -> list[list[str]]:
    """One `train_throughput` run per (target, method): each writes its report when it ends."""
    s = Sizes.of(args.target, args.small)
    return [[sys.executable, "-m", "amphista_jax.evals.benchmarks.train_throughput", "--target", target, "--dtype",
             "bfloat16", "--methods", method, "--batch-size", str(s.train_rows), "--seq-len", str(s.train_len),
             "--draft-vocab-size", str(s.draft_vocab_size), "--steps", str(s.train_steps),
             *(["--skip-forward"] if s.skip_forward else []), "--out", str(folder / f"{target}-{method}")]
            for target in s.train_targets for method in TRAIN_METHODS]


def kernel_test_commands(args: argparse.Namespace, folder: Path, facts: dict) -> list[list[str]]:
    """pytest on the compiled kernel tests, with the project's addopts replaced (no pytest-xdist needed)."""
    return [[sys.executable, "-m", "pytest", str(KERNEL_TESTS), "-k", "Device", "-q", "-p", "no:cacheprovider",
             "-o", "addopts=-ra", f"--junitxml={folder / 'junit.xml'}"]]


def read_json(path: Path, facts: dict) -> dict | None:
    """The report at `path` (None where none was written) less its machine, which goes to `facts` once for the run."""
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    machine = data.pop("machine", None)
    facts["machine"] = facts["machine"] or machine
    return data


def read_own(folder: Path, facts: dict) -> dict:
    """The report a stage of this module wrote (`write_report`, named after the stage)."""
    return read_json(folder / f"{folder.name}.json", facts) or {}


def read_spec_step(folder: Path, facts: dict) -> dict:
    return read_json(folder / "step_time.json", facts) or {}


def read_train_step(folder: Path, facts: dict) -> dict:
    """Per (target, method) run: tokens/s of each timed step and the stored-state step's model-flops utilisation."""
    peak = (sheet := accelerator(facts["device"])) and sheet.peak_flops
    rows = []
    for report in sorted(folder.glob("*/train_throughput.json")):
        data = read_json(report, facts)
        tokens = data["batch_size"] * data["seq_len"]
        for r in data["rows"]:
            flops = r["stored_step_flops"]
            rows.append({"target": data["model"], "method": r["method"], "tokens_per_step": tokens,
                         "step_tokens_per_s": tokens / r["step_s"] if "step_s" in r else None,
                         "stored_step_tokens_per_s": tokens / r["stored_step_s"], "stored_step_flops": flops,
                         "stored_step_mfu": flops / r["stored_step_s"] / peak if flops and peak else None})
    return {"peak_flops": peak, "rows": rows} if rows else {}


def read_kernel_tests(folder: Path, facts: dict) -> dict:
    """Counts of the JUnit report (absent: pytest ran no test), and the status they make."""
    report = folder / "junit.xml"
    if not report.is_file():
        return {}
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [f"{c.get('classname')}.{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    status = ("failed" if failed or counts["tests"] == 0 else "passed" if counts["passed"] else "skipped")
    return counts | {"status": status, "failed_tests": failed}


def cell(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, fmt)


def train_lines(result: dict) -> list[str]:
    lines = ["| target | method | full step tokens/s | stored-state tokens/s | stored-state GFLOP | MFU |",
             "|---|---|---:|---:|---:|---:|"]
    return lines + [f"| {r['target']} | {r['method']} | {cell(r['step_tokens_per_s'], '.0f')} | "
                    f"{r['stored_step_tokens_per_s']:.0f} | {cell(r['stored_step_flops'], '.2f', 1e9)} | "
                    f"{cell(r['stored_step_mfu'], '.1%')} |" for r in result.get("rows", [])]


def kernel_lines(result: dict) -> list[str]:
    if not result:
        return []
    return [f"{result['passed']} passed, {result['failures'] + result['errors']} failed, {result['skipped']} skipped"
            + (f": {', '.join(result['failed_tests'])}" if result["failed_tests"] else "")]


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    share: float  # of the remaining budget, against the stages not yet run
    commands: Callable[[argparse.Namespace, Path, dict], list[list[str]]]  # (args, its folder, facts so far)
    read: Callable[[Path, dict], dict]  # its results from the files it wrote; a "status" there names the stage's
    lines: Callable[[dict], list[str]] = lambda result: []  # facts.md lines beyond the reports' own tables


STAGES = (Stage("bandwidth", 1, own_stage("bandwidth"), read_own),
          Stage("ar_step", 4, own_stage("ar_step"), read_own),
          Stage("weight_traffic", 2, own_stage("weight_traffic"), read_own),
          Stage("spec_step", 5, spec_step_commands, read_spec_step),
          Stage("train_step", 4, train_step_commands, read_train_step, train_lines),
          Stage("kernel_tests", 2, kernel_test_commands, read_kernel_tests, kernel_lines))


def run_child(argv: list[str], log: Path, seconds: float) -> int | None:
    """Exit status of `argv`, run from the repository with its output in `log`.out and `log`.err; None when it was
    killed (with anything it started) at `seconds`."""
    with open(log.with_suffix(".out"), "w") as out, open(log.with_suffix(".err"), "w") as err:
        child = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=err, start_new_session=True)
        try:
            return child.wait(timeout=max(seconds, 0.0))
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return None


def last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def run_stage(stage: Stage, args: argparse.Namespace, facts: dict, limit: float) -> dict:
    """Run `stage`'s commands one after another inside `limit` seconds; its status, error and results."""
    folder = Path(args.out) / stage.name
    folder.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + limit
    status, error = "done", None
    try:
        for n, argv in enumerate(stage.commands(args, folder, facts)):
            code = run_child(argv, folder / f"child-{n}", deadline - time.monotonic())
            if code is None:
                status, error = "timed out", f"killed at its {limit:.0f} s limit: {shlex.join(argv[1:])}"
                break
            if code and error is None:
                status, error = "failed", last_line(folder / f"child-{n}.err") or f"exit status {code}"
        result = stage.read(folder, facts)
    except Exception as e:  # a stage's own fault (its reports unreadable, say): recorded, and the next stage runs
        return {"status": "failed", "error": f"{type(e).__name__}: {e}".splitlines()[0]}
    status = result.pop("status", status)
    return {"status": status, "error": error, "result": result}


def run_stages(args: argparse.Namespace, command: str) -> dict:
    """Every stage in order under `args.budget_s`; facts.json and facts.md in `args.out` before and after each."""
    facts = {"command": command, "device": None, "machine": None, "jax": importlib.metadata.version("jax"),
             "budget_s": args.budget_s,
             "sizes": dataclasses.asdict(Sizes.of(args.target, args.small)),
             "stages": {s.name: {"status": "pending"} for s in STAGES}}
    start = time.monotonic()
    for i, stage in enumerate(STAGES):
        entry, remaining = facts["stages"][stage.name], args.budget_s - (time.monotonic() - start)
        if remaining < MIN_STAGE_S:
            entry["status"] = NOT_RUN
        else:
            limit = min(remaining, max(MIN_STAGE_S, remaining * stage.share / sum(s.share for s in STAGES[i:])))
            entry |= {"status": "running", "limit_s": round(limit, 1)}
            write_facts(Path(args.out), facts, time.monotonic() - start)
            t0 = time.monotonic()
            entry |= run_stage(stage, args, facts, limit) | {"wall_s": round(time.monotonic() - t0, 1)}
            found = entry.get("result", {})
            facts["device"] = facts["device"] or found.get("device_kind") or found.get("device")
        write_facts(Path(args.out), facts, time.monotonic() - start)
    return facts


def write_facts(out: Path, facts: dict, elapsed: float) -> None:
    """facts.json and facts.md: every stage's status, times, error, results and its reports' tables."""
    facts["elapsed_s"] = round(elapsed, 1)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "facts.json", json.dumps(facts, indent=2) + "\n")
    lines = ["# Accelerator facts", "", f"Command: `{facts['command']}`", "",
             f"Device: {facts['device'] or 'not known yet'}; jax {facts['jax']}; budget {facts['budget_s']} s, "
             f"{facts['elapsed_s']} s spent.", ""]
    for n, stage in enumerate(STAGES, 1):
        entry = facts["stages"][stage.name]
        times = f" ({entry['wall_s']} s of a {entry['limit_s']} s limit)" if "wall_s" in entry else ""
        lines += [f"## {n}. {stage.name}: {entry['status']}{times}", ""]
        lines += [f"Error: {entry['error']}", ""] if entry.get("error") else []
        lines += [p.read_text().strip() + "\n" for p in sorted((out / stage.name).glob("**/*.md"))]
        lines += stage.lines(entry.get("result", {})) + [""]
    write_atomic(out / "facts.md", "\n".join(lines))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=540.0, help="seconds for all the stages together")
    p.add_argument("--target", default="llama-3-8b", choices=list(KNOWN_TARGETS), help="the decode stages' shape")
    p.add_argument("--small", action="store_true", help="every stage at the tiny shape (a test on CPU)")
    p.add_argument("--stage", choices=("bandwidth", "ar_step", "weight_traffic"),
                   help="internal: run this one stage here (the child process the script starts for it)")
    p.add_argument("--bandwidth", type=float, help="internal: stage 1's bandwidth, bytes/s, for the ar_step stage")
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    sizes, out = Sizes.of(args.target, args.small), Path(args.out)
    if args.stage == "bandwidth":
        bandwidth_stage(sizes, out)
    elif args.stage == "ar_step":
        ar_step_stage(sizes, out, args.bandwidth)
    elif args.stage == "weight_traffic":
        weight_traffic_stage(sizes, out)
    else:
        facts = run_stages(args, shlex.join(["python", "-m", MODULE, *argv]))
        print("\n".join(f"{name}: {e['status']}" + (f" ({e['error']})" if e.get("error") else "")
                        for name, e in facts["stages"].items()))


if __name__ == "__main__":
    main()
