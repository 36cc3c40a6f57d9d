"""Ranges declared beside their fields, and the one checker that reads them.

    @dataclasses.dataclass(frozen=True)
    class Medusa:
        num_heads: int = setting(4, ge=1)
        loss_decay: float = setting(0.8, gt=0, le=1)

        def __post_init__(self) -> None:
            check_ranges(self)  # then the checks that relate fields, as code

`setting` stores the bound in the field's metadata; `check_ranges(obj)` raises one `ValueError` line for the first
field outside its range: `num_heads=0 must be an integer >= 1`, with the field's `why` after it in brackets
(`lm_head_rank=-1 must be an integer >= 0 (0 = full rank)`). A field annotated `int` (or `int | None`) must hold an
integer, never a bool; any other ranged field a number, never a bool; None passes where the annotation allows it.
NaN fails every range.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import types
import typing
from typing import Any

RANGE = "range"  # the metadata key of a field's `Range`


@dataclasses.dataclass(frozen=True)
class Range:
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    why: str = ""  # what the bounds mean ("0 = no noise"), shown after the rule

    def holds(self, value: float) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def rule(self) -> str:
        """`>= 1`, `> 0`, `in [0, 1)`, `<= 4`."""
        low = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else ""
        high = f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else ""
        if low and high:
            return f"in {low}, {high}"
        if low:
            return f">= {self.ge}" if self.ge is not None else f"> {self.gt}"
        return f"<= {self.le}" if self.le is not None else f"< {self.lt}"


def setting(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None, why: str = "") -> Any:
    """A dataclass field with `default` and its range (`check_ranges` checks it)."""
    if (ge is not None and gt is not None) or (le is not None and lt is not None) or (ge, gt, le, lt) == (None,) * 4:
        raise TypeError("a range has at most one lower bound (ge or gt) and one upper bound (le or lt), and one "
                        "of them at least")
    return dataclasses.field(default=default, metadata={RANGE: Range(ge, gt, le, lt, why)})


@functools.cache
def _ranged(cls: type) -> tuple[tuple[str, Range, bool, bool], ...]:
    """(name, range, whole, optional) of `cls`'s ranged fields: whole when annotated `int`, optional when its
    annotation allows None."""
    fields = [(f.name, f.metadata[RANGE]) for f in dataclasses.fields(cls) if RANGE in f.metadata]
    if not fields:
        return ()
    hints = typing.get_type_hints(cls)
    out = []
    for name, rng in fields:
        hint = hints[name]
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        out.append((name, rng, int in args, type(None) in args))
    return tuple(out)


def check_ranges(obj: Any, prefix: str = "") -> None:
    """Raise `ValueError` (`{prefix}{name}={value!r} must be {rule}`) at the first field of dataclass `obj` outside
    the range its `setting` declares."""
    for name, rng, whole, optional in _ranged(type(obj)):
        value = getattr(obj, name)
        if value is None and optional:
            continue
        number = isinstance(value, numbers.Integral if whole else numbers.Real) and not isinstance(value, bool)
        if not number or not rng.holds(value):
            noun = "an integer " if whole else "" if number else "a number "
            why = f" ({rng.why})" if rng.why else ""
            raise ValueError(f"{prefix}{name}={value!r} must be {noun}{rng.rule()}{why}")
