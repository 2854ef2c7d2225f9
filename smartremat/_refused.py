"""A compile the device refuses for memory: an answer ("it does not fit"), never a crash of planning.

XLA:TPU refuses, at compile time, a program larger than the chip: `jax.errors.JaxRuntimeError`
with `RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries
(19.40G) exceeds available HBM (15.75G).` (docs/facts.md, fact 21), or, where the arguments tip it
over, `... Ran out of memory in memory space hbm. Used 20.51G of 15.48G hbm ...`. XLA:CPU never
refuses. `compile_or_refuse` turns such an error into `Refused`, which carries the bytes the
message says the program needs (its first size), for the planner to record as over budget. A leaf:
it imports nothing from the package.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import jax

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?(?![A-Za-z])")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}

T = TypeVar("T")


class Refused(Exception):
    """A compile (or a run) the device refused for memory. `needed`: the bytes its message says
    the program needs (`None` where it names none); `message`: the compiler's first line."""

    def __init__(self, needed: int | None, message: str):
        super().__init__(needed, message)
        self.needed, self.message = needed, message

    def __str__(self) -> str:
        return self.message


def refusal(e: BaseException) -> Refused | None:
    """`Refused` for a `JaxRuntimeError` that says the device is out of memory
    (`RESOURCE_EXHAUSTED`), else `None`."""
    if not isinstance(e, jax.errors.JaxRuntimeError) or "RESOURCE_EXHAUSTED" not in str(e):
        return None
    text = str(e)
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return Refused(needed_bytes(text), first)


def needed_bytes(text: str) -> int | None:
    """The first size in an out-of-memory message (`19.40G`, `512.00M`, `1.5GiB`) in bytes, after
    the `RESOURCE_EXHAUSTED` tag: what the refused program needs. `None` where it names none."""
    tail = text.split("RESOURCE_EXHAUSTED", 1)[-1]
    for match in _SIZE.finditer(tail):
        number, unit = match.groups()
        if unit or "." in number:  # a bare integer is a count or a line number, not a size
            return int(float(number) * _UNITS[unit])
    return None


def compile_or_refuse(compile: Callable[[], T]) -> T:
    """`compile()`, with an out-of-memory refusal raised as `Refused` (from the compiler's error)."""
    try:
        return compile()
    except jax.errors.JaxRuntimeError as e:
        refused = refusal(e)
        if refused is None:
            raise
        raise refused from e


class Refusal(NamedTuple):
    """A refusal as a cached value (no traceback, no compiler frames held)."""

    needed: int | None
    message: str


def kept(make: Callable[[], T]) -> Callable[[], T | Refusal]:
    """`make` for a cache: a refusal returned as a `Refusal` value, so that a program the device
    refused is not compiled again (on a TPU, each such compile of a real model takes about a minute)."""

    def made() -> T | Refusal:
        try:
            return make()
        except Refused as e:
            return Refusal(e.needed, e.message)

    return made


def raised(value: T | Refusal) -> T:
    """A cached value of `kept`: a refusal raised afresh (`Refused`), anything else returned."""
    if isinstance(value, Refusal):
        raise Refused(value.needed, value.message)
    return value


def over_budget(refused: Refused, budget: int) -> int:
    """The temp figure a refused candidate is recorded with: what its message says it needs, and
    above `budget` whatever it says (a program refused for its arguments may need fewer temp
    bytes than the budget, and still does not fit)."""
    return max(refused.needed or 0, budget + 1)
