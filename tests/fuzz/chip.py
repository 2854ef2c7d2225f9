"""The simulated chip of a fuzz case (`grammar.Case.chip`): its bytes, sized from the plain step's
compiled figures (`chip_bytes`), and the chip itself (`on_chip`, `tests/simulated_chip.py`).
`check.py` says what is checked on it."""

from __future__ import annotations

import contextlib
import math
from typing import Any

from smartremat import MB
from tests.simulated_chip import Chip, simulated_chip

#: The share of the temp bytes between the floor and the step without remat that a chip holds.
CHIP_SHARE = 0.6

#: The share of the device's memory `budget_mb="auto"` leaves unplanned (`smartremat.filter_jit`).
AUTO_RESERVE = 0.05


def chip_bytes(chip: str, plain: Any, floor_mb: float) -> int | None:
    """The bytes of the case's simulated chip (`None`: none), from the plain step's compiled
    figures `plain`: its arguments and outputs (less those aliased), its floor (the stated figure
    plus the half unit of its rounding) and `CHIP_SHARE` of its temp bytes above the floor. So the
    floor plan fits, and the step without remat is refused (unless remat saves nothing). For
    `"auto"` the chip is larger by `AUTO_RESERVE`, so the automatic budget is that same room (and
    the step without remat is refused only where that reserve is below the other 40% above the
    floor)."""
    if chip == "none":
        return None
    floor = (floor_mb + 0.0005) * MB
    room = floor + CHIP_SHARE * max(plain.temp_size_in_bytes - floor, 0.0)
    hbm = total(plain) - plain.temp_size_in_bytes + room
    return math.ceil(hbm if chip == "tight" else hbm / (1 - AUTO_RESERVE))


def on_chip(hbm: int | None) -> contextlib.AbstractContextManager[Chip | None]:
    """`tests.simulated_chip.simulated_chip(hbm)` (its `Chip` records the compiles it refused), or
    nothing where `hbm` is `None`."""
    return contextlib.nullcontext() if hbm is None else simulated_chip(hbm)


def total(memory: Any) -> int:
    """What a compiled step holds on the device: temp, arguments and outputs not aliased."""
    return (memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
            - memory.alias_size_in_bytes)
