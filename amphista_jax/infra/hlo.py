"""Optimized HLO modules read from their text (`jax.stages.Compiled.as_text()`): computations, instructions, loops."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8,
               "u64": 8, "token": 0}
Shapes = list[tuple[str, tuple[int, ...]]]  # (dtype, shape) of each output of an instruction


def nbytes(dims: Shapes) -> int:
    return sum(DTYPE_BYTES[d] * math.prod(s) for d, s in dims)


@dataclasses.dataclass
class Instr:
    """One HLO instruction: `%name = shape op(args), attrs`; `args`: operands, or a parameter's index."""

    name: str
    dims: Shapes
    op: str
    args: str
    attrs: str

    @classmethod
    def parse(cls, line: str) -> Instr:
        name, shape, op, args, attrs = re.match(
            r"\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][\w\-]*)\((.*?)\)(?:, (.*))?$", line).groups()
        dims = [(d, tuple(int(x) for x in s.split(",") if x))
                for d, s in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape) if d in DTYPE_BYTES]
        return cls(name, dims, op, args, attrs or "")

    @functools.cached_property
    def operands(self) -> list[str]:
        return re.findall(r"%([\w.\-]+)", self.args)

    def called(self, key: str = "calls") -> str:
        return re.search(rf"{key}=%([\w.\-]+)", self.attrs).group(1)

    @property
    def scope(self) -> str:
        """The JAX name stack (`jit(advance)/while/body/Transformer/layer_3/attn/q_proj/dot_general`), or an entry
        parameter's path (`params['layer_3']['attn']['q_proj']['kernel']` -> `params/layer_3/attn/q_proj/kernel`)."""
        name = re.search(r'op_name="([^"]*)"', self.attrs)
        return re.sub(r"\[\\'(\w+)\\'\]", r"/\1", name.group(1)) if name else ""


class HloModule:
    """An optimized HLO module: its computations (instructions by name) and their roots."""

    def __init__(self, text: str):
        self.comps: dict[str, dict[str, Instr]] = {}
        self.roots: dict[str, Instr] = {}
        self.entry = comp = ""
        for line in text.splitlines():
            if (header := re.match(r"^(ENTRY )?%(\S+) \(.*\{$", line)) is not None:
                comp = header.group(2)
                self.comps[comp] = {}
                self.entry = comp if header.group(1) else self.entry
            elif comp and (instr := re.match(r"\s*(?:ROOT )?%(\S+) = ", line)) is not None:
                ins = self.comps[comp][instr.group(1)] = Instr.parse(line)
                if line.lstrip().startswith("ROOT"):
                    self.roots[comp] = ins
        self.loops = {i.called(k): (c, i) for c, ins in self.comps.items() for i in ins.values() if i.op == "while"
                      for k in ("body", "condition")}  # loop computation -> (the computation of its while, the while)

    def multiplies(self, comp: str, seen: set[str] | None = None) -> bool:
        """Whether `comp`, or anything it calls, runs a product (`dot`, `convolution`)."""
        seen = set() if seen is None else seen
        seen.add(comp)
        return any(ins.op in ("dot", "convolution") or any(
            self.multiplies(c, seen) for c in set(re.findall(r"%([\w.\-]+)", ins.attrs)) & self.comps.keys() - seen)
            for ins in self.comps.get(comp, {}).values())
