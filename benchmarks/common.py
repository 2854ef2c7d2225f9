"""What every benchmark and study script imports first: the CPU flag and the disk cache setting.

Import this module before JAX: it sets the CPU barrier flag (docs/facts.md, fact 1) when neither an
NVIDIA GPU nor a TPU runtime (the `libtpu` package) is present. On a GPU it must not be set: XLA:GPU
then fails to compile remat ("Unsupported instruction opcode: opt-barrier", seen on an H200 with
jax 0.11.2); the TPU's compiler keeps the barrier without it.
It also turns smartremat's disk plan cache off (unless SMARTREMAT_DISK_CACHE is set), so that the
planning times benchmarks report are of planning, not of reading an earlier run's plans.
The fixed strategies and the training step they are measured on are in `benchmarks/strategies.py`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

CPU_FLAG = "--xla_disable_hlo_passes=cse_barrier_expander"
ACCELERATOR = shutil.which("nvidia-smi") is not None or importlib.util.find_spec("libtpu") is not None
if "jax" not in sys.modules and not ACCELERATOR and CPU_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + CPU_FLAG).strip()
os.environ.setdefault("SMARTREMAT_DISK_CACHE", "0")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def replaced(original: Callable, replacement: Callable) -> Iterator[None]:
    """Within the block, `replacement` stands for the smartremat function `original` (one from
    `smartremat.internal`) in every loaded `smartremat` module that holds it, where the planner
    looks it up: how a study watches or records what planning does. Restored on exit."""
    held: list[tuple[Any, str]] = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "smartremat" or name.startswith("smartremat.")):
            continue
        held += [(module, attr) for attr, value in list(vars(module).items()) if value is original]
    if not held:
        raise RuntimeError(f"no smartremat module holds {original!r}")
    for module, attr in held:
        setattr(module, attr, replacement)
    try:
        yield
    finally:
        for module, attr in held:
            setattr(module, attr, original)
