"""Planning time: profile + solve (no compile) for a 24-layer transformer, and the solver alone.

    python benchmarks/planning_time.py [--layers 24] [--repeat 3]

The model is built with `eqx.filter_eval_shape`, so no parameter memory is allocated: the
whole plan is made on abstract values. `calibrate=False, verify=False` is the compile-free
planner; `calibrate=True` adds one small compile per distinct block and policy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (sets the CPU flag before JAX starts)

import equinox as eqx
import jax
import jax.numpy as jnp

import smartremat

from smartremat._memory import Stage
from smartremat._solve import solve
from benchmarks.fit_report import Stack
from benchmarks.models import GPTBlock


def plan_time(layers: int, calibrate: bool) -> tuple[float, smartremat.Plan]:
    smartremat.clear_caches()
    model = eqx.filter_eval_shape(
        lambda: Stack([GPTBlock(768, 12, k) for k in jax.random.split(jax.random.key(0), layers)]))
    x = jax.ShapeDtypeStruct((8, 512, 768), jnp.float32)
    wrapped = smartremat.smartremat(budget_mb=4000, calibrate=calibrate, verify=False)(model)
    t0 = time.perf_counter()
    plan = smartremat.explain(wrapped, x)
    return time.perf_counter() - t0, plan


def solve_time(n: int) -> float:
    stages = [Stage((771, 216, 108, 12), (800, 700, 690, 790), (0, 5, 8, 20), i) for i in range(n)]
    t0 = time.perf_counter()
    assert solve(stages, 4000 * n // 10) is not None
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {os.cpu_count()} cores")
    for calibrate in (False, True):
        times = []
        for _ in range(args.repeat):
            dt, plan = plan_time(args.layers, calibrate)
            times.append(dt)
        print(f"{args.layers}-layer transformer (d=768, T=512, batch 8), calibrate={calibrate}: "
              f"median {statistics.median(times):.2f} s over {args.repeat} (min {min(times):.2f})")
    print(plan)
    times = [solve_time(200) for _ in range(args.repeat)]
    print(f"solve, 200 blocks x 4 policies: median {statistics.median(times):.3f} s")


if __name__ == "__main__":
    main()
