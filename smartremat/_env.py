"""Facts of the environment smartremat runs in: the megabyte, the package version, the backend and
XLA flags a compiled figure depends on, the XLA options of measuring compiles, and the CPU barrier
flag (design fact 1: without it, XLA on the CPU undoes remat outside loops). A leaf: it imports
nothing from the package."""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any

import jax

MB = 2**20  #: smartremat's megabyte: `budget_mb=1` means 2**20 bytes.


def _version() -> str:
    try:
        return importlib.metadata.version("smartremat")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "0+unknown"


#: The installed package's version (from its metadata, as pyproject.toml declares it).
VERSION = _version()


def environment_key() -> tuple[str, str]:
    """What else a compiled figure depends on: the backend and the XLA flags."""
    return jax.default_backend(), os.environ.get("XLA_FLAGS", "")


def measuring_options() -> dict[str, Any]:
    """XLA options for the compiles smartremat only measures (profiles, candidate plans), never
    for a step that runs. On the CPU, LLVM's optimisation level decides code generation only,
    after the HLO passes and buffer assignment that `memory_analysis()` and `cost_analysis()`
    read, so level 0 gives the same figures in about half the compile time (docs/fit.md,
    "Planning time"). Other backends compile as they would anyway."""
    return {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else {}


def profiling_options() -> dict[str, Any]:
    """XLA options for the small compiles that profile one block (its own peak, its copies in a
    row): `measuring_options()` and, on the CPU, XLA's loop emitters instead of its MLIR fusion
    emitters, which halves these compiles at the same temp bytes on every block profile of the
    benchmark models (docs/fit.md, "Planning time"); also for the one compile of the module with
    its stack's blocks skipped (`_head.in_place`), a measure too. Not for whole-step compiles,
    whose figures must be those of the step that runs: there the emitters move the quick GPT's
    temp bytes by up to 192 bytes. `_profile.compiled_temp` falls back to `measuring_options()` where a jaxlib does
    not know the option."""
    extra = {"xla_cpu_use_fusion_emitters": False} if jax.default_backend() == "cpu" else {}
    return {**measuring_options(), **extra}


CPU_NOTE = (
    "on the CPU backend XLA removes remat's optimisation barriers before CSE, so remat outside "
    "loops saves nothing unless XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander is set "
    "before JAX is imported"
)


def cpu_barrier_missing() -> bool:
    """Whether this process runs on the CPU without the barrier flag (`CPU_NOTE`)."""
    return jax.default_backend() == "cpu" and "cse_barrier_expander" not in os.environ.get("XLA_FLAGS", "")


def barrier_hint() -> str:
    """For an error about a budget that is too low: on the CPU without the barrier flag, a
    sentence saying that the figures overstate what remat can save and how to set the flag;
    else `""`."""
    if not cpu_barrier_missing():
        return ""
    return (f" Note: {CPU_NOTE}, and it is not set in this process, so the compiled program keeps what "
            "remat should free and the figures above may be too high: set it (e.g. "
            "`XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander python train.py`) and plan again "
            "before raising the budget.")
