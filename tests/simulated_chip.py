"""A simulated accelerator on the CPU: a device of `hbm` bytes whose compiler refuses larger programs.

XLA:TPU refuses at compile time a program larger than the chip (docs/facts.md, fact 21); XLA:CPU
compiles any size, so CI would never meet a refusal. Inside `simulated_chip(hbm)` every
`jax.stages.Lowered.compile` (every ahead-of-time compile: `jax.jit(f).lower(...).compile()`,
`eqx.filter_jit(f).lower(...).compile()` and all of smartremat's; a plain call of a jitted function
compiles by another path, which the chip does not see) compiles as usual and then raises what XLA:TPU
raises when
the program's temporaries exceed the chip, or its temporaries, arguments and outputs together do:
a `jax.errors.JaxRuntimeError` worded as XLA:TPU words it (sizes as XLA prints them, `19.40G`).
And every device reports `memory_stats()["bytes_limit"] == hbm`, as a TPU does, for
`budget_mb="auto"`, and `device_kind == kind` (a TPU v5e's by default), which sets what smartremat's
objective charges for kept bytes (`smartremat/_objective.py`). Nothing of smartremat is patched: it meets the chip through JAX alone; its
caches are cleared on entry and on exit (figures kept there are of another device).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax

import smartremat

_LOCK = threading.Lock()


def xla_size(n: float) -> str:
    """Bytes as XLA:TPU's messages print them: `19.40G`, `512.00M`, `3.00K`, `12B`."""
    for unit, size in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{int(n)}B"


def refusal(compiled: Any, hbm: int) -> str | None:
    """XLA:TPU's message refusing `compiled` on a chip of `hbm` bytes, or `None` if it fits."""
    m = compiled.memory_analysis()
    temp = int(m.temp_size_in_bytes)
    total = temp + int(m.argument_size_in_bytes) + int(m.output_size_in_bytes) - int(m.alias_size_in_bytes)
    if temp > hbm:
        return (f"RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                f"temporaries ({xla_size(temp)}) exceeds available HBM ({xla_size(hbm)}).")
    if total > hbm:
        return (f"RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
                f"hbm. Used {xla_size(total)} of {xla_size(hbm)} hbm. Exceeded hbm capacity by "
                f"{xla_size(total - hbm)}.")
    return None


class Chip:
    """What a `simulated_chip` saw: the compiles it refused (their messages) and let through."""

    def __init__(self, hbm: int):
        self.hbm = hbm
        self.refused: list[str] = []
        self.compiled = 0


@contextlib.contextmanager
def simulated_chip(hbm: int, refuses: bool = True, kind: str = "TPU v5 lite") -> Iterator[Chip]:
    """Inside: every device has `hbm` bytes, and every compile above them is refused (see above);
    with `refuses=False`, compiled (as XLA:GPU compiles a program larger than the device, logging
    that it cannot reduce memory below the limit) and only recorded in `Chip.refused`. Every
    device's `device_kind` is `kind`. Process-wide (smartremat compiles in worker threads); not
    re-entrant."""
    lowered_cls, device_cls = jax.stages.Lowered, type(jax.devices()[0])
    compile_before, stats_before = lowered_cls.compile, device_cls.memory_stats
    kind_before = vars(device_cls).get("device_kind")  # None: inherited, restored by deleting ours
    chip = Chip(hbm)

    def compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        compiled = compile_before(self, *args, **kwargs)
        message = refusal(compiled, hbm)
        with _LOCK:
            if message is None:
                chip.compiled += 1
            else:
                chip.refused.append(message)
        if message is not None and refuses:
            raise jax.errors.JaxRuntimeError(message)
        return compiled

    def memory_stats(self: Any) -> dict[str, int]:
        return {"bytes_limit": hbm, "bytes_in_use": 0, "peak_bytes_in_use": 0}

    smartremat.clear_caches()
    try:
        lowered_cls.compile, device_cls.memory_stats = compile, memory_stats
        device_cls.device_kind = property(lambda self: kind)
        yield chip
    finally:
        lowered_cls.compile, device_cls.memory_stats = compile_before, stats_before
        if kind_before is not None:
            device_cls.device_kind = kind_before
        elif "device_kind" in vars(device_cls):
            delattr(device_cls, "device_kind")
        smartremat.clear_caches()
