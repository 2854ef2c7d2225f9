"""What `filter_jit(budget_mb="auto")` saves by not compiling the step without remat as its
reference where the model already puts it above the device (`StepTarget.beyond_device`), on the CPU
under a simulated chip that refuses larger programs as XLA:TPU does (`tests/simulated_chip.py`).

    python studies/reference_skip.py --runs 2   # alternates the library (on) and the skip turned off

The model: the accelerator check's `SequenceGPT`, unrolled, 8 layers, d=256, T=256, batch 4, Adam,
donated, on a chip of 300 MB. Per run: the first plan's wall time, the chip's refusals, the compiles
by what they are for (`benchmarks/planning_time.py`), the plan's compiled bytes and policies.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (sets the CPU flag before JAX starts)

import equinox as eqx
import jax

import smartremat
from benchmarks.accelerator_check import OPT, step
from benchmarks.models import SequenceGPT
from benchmarks.planning_time import compile_breakdown, recorded_compiles
from smartremat.internal import StepTarget
from tests.simulated_chip import simulated_chip

os.environ.setdefault("SMARTREMAT_DISK_CACHE", "0")  # every run plans, none reads an old plan
SHAPE = dict(layers=8, d=256, heads=4, seq=256, vocab=4096)
MB = 2**20


def run(skip: bool, chip_mb: int, batch: int) -> str:
    model = SequenceGPT(**SHAPE, key=jax.random.key(0), scanned=False)
    opt_state = OPT.init(eqx.filter(model, eqx.is_array))
    tokens = jax.random.randint(jax.random.key(1), (batch, SHAPE["seq"] + 1), 0, SHAPE["vocab"])
    off = mock.patch.object(StepTarget, "beyond_device", lambda self, model: False)
    with (contextlib.nullcontext() if skip else off,
          simulated_chip(chip_mb * MB) as chip, recorded_compiles() as record):
        t = time.perf_counter()
        plan = smartremat.filter_jit(step, budget_mb="auto", donate="all").plan(model, opt_state, tokens)
        seconds = time.perf_counter() - t
    return (f"skip {'on ' if skip else 'off'}: first plan {seconds:.2f} s; refused {len(chip.refused)}; "
            f"compiled {plan.compiled_peak_bytes / MB:.2f} MB; policies {plan.policies}\n"
            f"  compiles {compile_breakdown(record)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs of each, alternated (on, off, on, ...)")
    parser.add_argument("--chip-mb", type=int, default=300)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, smartremat {smartremat.__version__}, chip {args.chip_mb} MB, batch {args.batch}")
    for _ in range(args.runs):
        for skip in (True, False):
            print(run(skip, args.chip_mb, args.batch), flush=True)


if __name__ == "__main__":
    main()
