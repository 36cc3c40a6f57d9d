"""Where the AR decode step's flops and memory traffic go, per component, read from the compiled programs.

    python -m amphista_jax.evals.benchmarks.decode_profile [--model smollm2] [--batches 1 64] [--cache-size 320]
        [--layouts split stacked] [--out runs/benchmarks]

Static: for each layout and batch, the program decoding runs (`decode.advance` with an AR `DecodeSpec`: a
`while_loop` of `ar_step`s on a `start`ed state) is compiled from `jax.ShapeDtypeStruct`s (no weights are read: a
program depends only on shapes and dtypes) and its optimized HLO text is parsed; one iteration of the loop is one
step. The teacher-forced forward over [8, 256] tokens (no cache) is compiled beside it, for the intensity. Nothing is
timed but the memory bandwidth probe (`ar_decode.memory_bandwidth`) that turns bytes into predicted tokens/s.

GFLOP: 2 x multiply-adds of the matrix products. Bytes, a model of the traffic (not a measurement): every
instruction reads its operands and writes its output (a nested loop's body counts its trip count times), except
that a fused operand used only through slices counts the bytes taken, a scatter or dynamic-update-slice (or a fusion
whose root is one) works in place and counts 2 x the update, and parameters, tuples and bitcasts count nothing.
Components come from each instruction's JAX name stack. Cache copies: the instructions of a step that write at
least one layer's K or V (a cache-shaped output, or an in-place update that size). Weight copies (`weight_moves`):
the instructions of a step that move at least one layer's share of a weight into a buffer of its own (the stacked
layout's per-layer slices; the split layout, decoding's, has none: `tests/test_decode_weight_traffic.py`). Writes
decode_profile.json and decode_profile.md to `--out`.
"""

from __future__ import annotations

import collections
import functools
import math
import re
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from amphista_jax.drafters.base import Drafter
from amphista_jax.engine.decode import advance, start
from amphista_jax.engine.decode_spec import DecodeSpec
from amphista_jax.evals.benchmarks.ar_decode import memory_bandwidth
from amphista_jax.evals.benchmarks.common import benchmark_parser, write_report
from amphista_jax.infra.hlo import HloModule, Instr, nbytes
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.fetch import resolve_model
from amphista_jax.models.hf import LAYOUTS, load_config
from amphista_jax.models.llama import param_shapes
from amphista_jax.models.target import Target
from amphista_jax.trees.tree import Tree

NEW_TOKENS = 64  # the state's token buffer [B, 64]; the prompt fills the rest of the cache
FORCED = (8, 256)  # the teacher-forced forward's tokens [B, T]
FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "opt-barrier", "partition-id"}
IN_PLACE = ("scatter", "dynamic-update-slice")


class Hlo(HloModule):
    """An optimized HLO module with what the profile reads of it: roots' ops, weights, flops, traffic."""

    def root_op(self, ins: Instr) -> str:
        return self.roots[ins.called()].op if ins.op == "fusion" else ins.op

    def instructions(self, step: bool) -> Iterator[tuple[str, Instr, int]]:
        """(computation, instruction, times it runs) of one iteration of the entry's decode loop (`step`: its `while`
        of no known trip count; body and condition) or of the whole program, through nested loops (their trip count
        times), calls and both branches of a conditional; the control instructions themselves left out."""
        def walk(comp: str, times: int) -> Iterator[tuple[str, Instr, int]]:
            for ins in self.comps[comp].values():
                if ins.op not in ("while", "call", "conditional"):
                    yield comp, ins, times
                    continue
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
                for inner in set(re.findall(r"%([\w.\-]+)", ins.attrs)) & self.comps.keys():
                    yield from walk(inner, times * (int(trip.group(1)) if trip else 1))

        if not step:
            yield from walk(self.entry, 1)
            return
        loop = next(i for i in self.comps[self.entry].values() if i.op == "while" and "known_trip_count" not in i.attrs)
        yield from walk(loop.called("body"), 1)
        yield from walk(loop.called("condition"), 1)

    def weight(self, comp: str, name: str, index: int | None = None) -> str:
        """The path of the entry parameter that value `name` (its element `index`, for a tuple) comes from, through
        loop carries, tuples, bitcasts, copies and slices; "" for none."""
        ins = self.comps[comp][name]
        if ins.op == "get-tuple-element" and index is None:
            return self.weight(comp, ins.operands[0], int(re.search(r"index=(\d+)", ins.attrs).group(1)))
        if ins.op == "tuple" and index is not None:
            return self.weight(comp, ins.operands[index])
        if ins.op == "parameter" and comp == self.entry and index is None:
            return ins.scope
        if ins.op == "parameter" and comp in self.loops and index is not None:
            outer, loop = self.loops[comp]
            return self.weight(outer, loop.operands[0], index)
        moves = ("bitcast", "copy", "slice", "dynamic-slice")  # of operand 0, alone or as a fusion's root
        return self.weight(comp, ins.operands[0], index) if self.root_op(ins) in moves else ""

    def flops(self, comp: str, ins: Instr) -> float:
        """2 x multiply-adds of `ins` (a dot, or a fusion's dots)."""
        if ins.op == "fusion":
            return sum(self.flops(ins.called(), i) for i in self.comps[ins.called()].values())
        if ins.op != "dot":
            return 0.0
        lhs = self.comps[comp][ins.operands[0]].dims[0][1]
        contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs).group(1)
        return 2.0 * math.prod(ins.dims[0][1]) * math.prod(lhs[int(d)] for d in contracted.split(",") if d)

    def taken(self, comp: str, name: str) -> float:
        """Bytes read of fused value `name` when it is used only through (bitcasts to) slices, else infinity."""
        total = 0
        for user in (i for i in self.comps[comp].values() if name in i.operands):
            if user.op in ("slice", "dynamic-slice") or (user.op == "gather" and user.operands[0] == name):
                total += nbytes(user.dims)
            elif user.op == "bitcast" and (inner := self.taken(comp, user.name)) < math.inf:
                total += inner
            else:
                return math.inf
        return total

    def update(self, comp: str, ins: Instr) -> Instr | None:
        """What an in-place `ins` (a scatter or dynamic-update-slice, or a fusion whose root is one) writes into its
        operand 0; None for any other instruction."""
        if ins.op == "fusion":
            comp, ins = ins.called(), self.roots[ins.called()]
        return self.comps[comp][ins.operands[-1 if ins.op == "scatter" else 1]] if ins.op in IN_PLACE else None

    def traffic(self, comp: str, ins: Instr) -> int:
        """Bytes `ins` moves (the module docstring's byte model)."""
        if ins.op in FREE:
            return 0
        if (update := self.update(comp, ins)) is not None:
            return 2 * nbytes(update.dims)
        if ins.op in ("slice", "dynamic-slice"):
            return 2 * nbytes(ins.dims)
        operands = [nbytes(self.comps[comp][o].dims) for o in ins.operands]
        if ins.op != "fusion":
            return nbytes(ins.dims) + sum(operands)
        params = (i for i in self.comps[ins.called()].values() if i.op == "parameter")  # i.args: operand index
        return nbytes(ins.dims) + int(sum(min(operands[int(p.args)], self.taken(ins.called(), p.name)) for p in params))


def component(scope: str, ins: Instr, root_op: str, out_cache: bool, whole_cache: bool) -> str:
    """The component of `ins`, from its name stack `scope`, whether its output is shaped like one layer's K or V (in
    any axis order) or like the whole cache, and, for a fusion, its root's op."""
    scope = re.sub(r"layer_\d+/", "", scope)
    last = scope.rsplit("/", 1)[-1]
    rules = (("whole-cache copy / zero-init", whole_cache and (ins.op == "copy" or (ins.op == "fusion" and not scope))),
             ("q/k/v projections", any(f"{p}_proj" in scope for p in "qkv")),
             ("o projection", "o_proj" in scope),
             ("MLP (gate/up/down)", "/mlp/" in scope),
             ("argmax / sampling", any(k in scope for k in ("argmax", "categorical", "select_token"))
              or (last == "reduce" and any(d == "s32" for d, _ in ins.dims[1:]))),
             ("vocabulary projection", any(k in scope for k in ("attend", "lm_head", "logits"))),
             ("KV-cache write (scatter)", "scatter" in scope and "/attn/" in scope),
             ("KV-cache layer write (dynamic-update-slice)", out_cache and "dynamic_update_slice" in scope),
             ("KV-cache layer slice copy", out_cache and root_op in ("bitcast", "slice", "dynamic-slice")
              and last in ("slice", "squeeze", "dynamic_slice")),
             ("K/V copy before the products", out_cache and "dot_general" not in scope and root_op != "dot"),
             ("stacked-layer weight slice copy", ("dynamic_slice" in scope or "Transformer/slice" in scope)
              and ins.op != "dot"),
             ("attention products (QK^T, PV)", "/attn/" in scope and "dot_general" in scope),
             ("attention: RoPE, mask, softmax", "/attn/" in scope),
             ("RMSNorm", "norm" in scope),
             ("token embedding", "embed" in scope))
    return next((name for name, hit in rules if hit), "other")


def profile(hlo: Hlo, kv: tuple[int, ...], layers: int, step: bool) -> dict:
    """Flops and bytes by component, and the cache copies, of one iteration of the entry's decode loop (`step`: its
    `while` of no known trip count) or of the whole program. `kv`: one layer's K or V shape `[B, S, KVH, Dh]` (empty:
    no cache). Nested loops count their trip count times, both branches of a conditional count, and a dot that lost
    its name stack (XLA:CPU's matrix-vector products and XNNPACK fusions) takes its weight's path."""
    layer = sorted(d for d in kv if d != 1)

    def cache_like(shape: tuple[int, ...]) -> bool:  # a layer's K or V in any axis order (size-1 axes aside), or L
        dims = [d for d in shape if d != 1]
        return bool(layer) and (sorted(dims) == layer or (dims[:1] == [layers] and sorted(dims[1:]) == layer))

    parts: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])  # component -> [flops, bytes]
    copies = [0, 0]  # [instructions, bytes written]

    for comp, ins, times in hlo.instructions(step):
        root_op, update = hlo.root_op(ins), hlo.update(comp, ins)
        scope = ins.scope
        if not scope and root_op == "dot":  # a product with a weight (its right operand), else attention's
            reads = [hlo.comps[comp][o] for o in reversed(ins.operands)]
            scope = next(filter(None, (hlo.weight(comp, o.name) for o in reads)), "") or (
                "/attn/dot_general" if any(cache_like(d) for o in reads for _, d in o.dims) else "")
        out_cache = any(cache_like(d) for _, d in ins.dims)
        part = parts[component(scope, ins, root_op, out_cache, out_cache and ins.dims[0][1][:1] == (layers,))]
        part[0] += times * hlo.flops(comp, ins)
        part[1] += times * hlo.traffic(comp, ins)
        written = update.dims if update else [] if ins.op in FREE or root_op == "dot" else ins.dims
        if any(cache_like(s) for _, s in written):
            copies[0] += times
            copies[1] += times * nbytes(written)

    return {"components": {k: {"flops": f, "bytes": b} for k, (f, b) in parts.items()},
            "flops": sum(f for f, _ in parts.values()), "bytes": sum(b for _, b in parts.values()),
            "cache_copies": copies[0], "cache_copy_bytes": copies[1]}


def decode_program(config: ModelConfig, params: dict, batch: int, cache_size: int, drafter: Drafter | None = None,
                   tree: Tree | None = None) -> Hlo:
    """`advance`'s compiled program (greedy; AR without a `drafter`) on the state `start` leaves after the longest
    prompt `cache_size` holds beside `NEW_TOKENS` (and a tree's scratch); the drafter's params are its `init`'s shapes
    on this target."""
    spec = DecodeSpec(config, drafter, tree, NEW_TOKENS, eos_ids=config.eos_token_ids, pad_id=config.pad_token_id or 0)
    draft = None if drafter is None else jax.eval_shape(
        lambda p: drafter.decode_params(drafter.init(jax.random.key(0), Target(config, p)), Target(config, p)), params)
    prompt = jax.ShapeDtypeStruct((batch, cache_size - spec.cache_size(0)), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    state = jax.eval_shape(functools.partial(start, spec=spec, cache_size=cache_size), params, draft, prompt, lengths,
                           jax.random.key(0))
    return Hlo(advance.lower(params, draft, state, spec=spec, steps=NEW_TOKENS).compile().as_text())


MOVES = {"parameter", "constant", "bitcast", "copy", "slice", "dynamic-slice", "transpose", "reshape"}


def weight_moves(hlo: Hlo, layers: int) -> list[tuple[str, str, int]]:
    """(weight, op, bytes written per step) of each instruction in one iteration of the entry's decode loop that
    writes a weight's values elsewhere (a copy, slice, dynamic-slice or transpose, or a fusion of only such moves), at
    least one layer's share of that weight in size: per-step weight traffic beyond the products' own read of it. A
    nested loop's instructions count its trip count times."""
    sizes = {ins.scope: nbytes(ins.dims) for ins in hlo.comps[hlo.entry].values() if ins.op == "parameter"}
    found = []

    for comp, ins, times in hlo.instructions(step=True):
        moves = ({i.op for i in hlo.comps[ins.called()].values()} <= MOVES if ins.op == "fusion"
                 else ins.op in MOVES - {"parameter", "constant", "bitcast", "reshape"})
        if not moves:
            continue
        for weight in {hlo.weight(comp, o) for o in ins.operands} & sizes.keys():
            if weight.startswith("params/") and nbytes(ins.dims) * layers >= sizes[weight]:
                found.append((weight, hlo.root_op(ins), times * nbytes(ins.dims)))
    return found


def forced_program(config: ModelConfig, params: dict) -> Hlo:
    """The compiled teacher-forced forward: logits `[B, T, V]` of `FORCED` tokens, no cache."""
    model = DecodeSpec(config, None, None, 1).model(params)
    positions = jnp.broadcast_to(jnp.arange(FORCED[1]), FORCED)  # [B, T]
    forward = jax.jit(lambda p, tokens: model.apply({"params": p}, tokens, positions).logits)
    return Hlo(forward.lower(params, jax.ShapeDtypeStruct(FORCED, jnp.int32)).compile().as_text())


def component_table(row: dict) -> str:
    lines = [f"### {row['program']} ({row['tokens']} tokens per step)", "",
             "| component | GFLOP | GB per step | share of bytes |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {c['flops'] / 1e9:.3f} | {c['bytes'] / 1e9:.3f} | {c['bytes'] / row['bytes']:.1%} |"
              for k, c in sorted(row["components"].items(), key=lambda kc: -kc[1]["bytes"])]
    return "\n".join(lines + [f"| **total** | {row['flops'] / 1e9:.2f} | {row['bytes'] / 1e9:.3f} | 100% |"])


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.set_defaults(model="smollm2")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--cache-size", type=int, default=320)
    parser.add_argument("--layouts", nargs="+", default=["split", "stacked"], choices=LAYOUTS)
    args = parser.parse_args()
    if args.cache_size <= NEW_TOKENS:
        parser.error(f"--cache-size {args.cache_size} must exceed the {NEW_TOKENS} new tokens")
    model_dir = resolve_model(args.model)
    config = load_config(model_dir)
    bandwidth = memory_bandwidth()
    rows = []
    for layout in args.layouts:
        params, _ = param_shapes(config, split=layout == "split")  # hf.load_params(layout=layout)'s tree, fp32
        for batch in args.batches:
            kv = (batch, args.cache_size, config.num_kv_heads, config.head_dim)
            hlo = decode_program(config, params, batch, args.cache_size)
            moved = weight_moves(hlo, config.num_layers)
            rows.append({"program": f"decode, {layout}, batch {batch}", "layout": layout, "tokens": batch,
                         "weight_moves": len(moved), "weight_move_bytes": sum(b for *_, b in moved)}
                        | profile(hlo, kv, config.num_layers, step=True))
        rows.append({"program": f"teacher-forced, {layout}, {list(FORCED)}", "layout": layout,
                     "tokens": math.prod(FORCED)}
                    | profile(forced_program(config, params), (), config.num_layers, step=False))
    for r in rows:
        r["predicted_tokens_per_s"] = r["tokens"] * bandwidth / r["bytes"]
    lines = [f"{model_dir}, fp32, cache of {args.cache_size} slots. Flops and bytes of one step of each compiled "
             "program (bytes: the byte model of the module's docstring); predicted tokens/s = tokens per step x "
             f"bandwidth / bytes per step, at {bandwidth / 1e9:.1f} GB/s (fp32 matrix-vector product over 512 MiB, "
             "measured in this run).", "",
             "| program | GFLOP/step | GB/step | flop/B | MB/token | cache copies/step (GB) | weight copies/step (GB) "
             "| predicted tok/s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['program']} | {r['flops'] / 1e9:.2f} | {r['bytes'] / 1e9:.3f} | {r['flops'] / r['bytes']:.2f} | "
              f"{r['bytes'] / r['tokens'] / 1e6:.2f} | {r['cache_copies']} ({r['cache_copy_bytes'] / 1e9:.3f}) | "
              + (f"{r['weight_moves']} ({r['weight_move_bytes'] / 1e9:.3f})" if "weight_moves" in r else "-")
              + f" | {r['predicted_tokens_per_s']:.0f} |" for r in rows]
    data = {"model": model_dir, "cache_size": args.cache_size, "new_tokens": NEW_TOKENS,
            "bandwidth_bytes_per_s": bandwidth, "rows": rows}
    write_report(args.out, "decode_profile", data, "\n\n".join(["\n".join(lines)] + [component_table(r) for r in rows]))


if __name__ == "__main__":
    main()
