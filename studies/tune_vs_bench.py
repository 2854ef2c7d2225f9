"""Does `tune=True` rank its candidates as the benchmark would? (issue 13: where the two disagree.)

    python studies/tune_vs_bench.py [--model gpt] [--budget 295.39] [--rounds 40]

Plans `--model` (quick size) at `--budget` MB with `tune=True`, keeping the candidate steps it
timed, then times each candidate three ways in `--rounds` interleaved rounds, each round in a
fresh order (`smartremat.internal.round_orders`):

- **synthetic**: the candidate's executable as `tune=True` runs it, on its synthetic inputs
  (`smartremat.internal.synthetic`: small uniform floats for the parameters, zeros for integers);
- **real**: the same executable on the benchmark's inputs (the model's own arrays, its input and
  its targets);
- **real fl.** (where the step has integer inputs, such as tokens): the benchmark's floating
  arrays with `synthetic`'s zeros for the integers;
- **bench**: for the uniform candidates and the tuned plan, the benchmark's own step
  (`benchmarks.run.Timer`, a separate compile of `strategies.grad_step`).

Printed per candidate: `tune=True`'s own median (`Plan.timed`) and the three medians, each with the
spread between the medians of the even and odd rounds (the noise of that column). Where the
columns rank the candidates alike within that spread, the way `tune=True` times is not what makes
it disagree with the benchmark: the noise is.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (sets the CPU flag before JAX starts)

import argparse
import statistics
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import smartremat
from benchmarks.strategies import exact, strategy, target_of
from benchmarks.run import MB, Timer, build, environment
from benchmarks.common import replaced
from smartremat.internal import TimedRun, round_orders, synthetic, timings


def tuned_candidates(case: Any, budget_mb: float) -> tuple[smartremat.Plan, list, Any]:
    """`(plan, timed steps, wrapped model)`: the candidates `tune=True` timed, caught on their way
    to `smartremat.internal.timings`."""
    caught: list = []

    def catch(steps: Any, *a: Any) -> Any:
        caught.extend(steps)
        return timings(steps, *a)

    with replaced(timings, catch):
        wrapped = smartremat.smartremat(budget_mb=budget_mb, tune=True, **exact(case.model, case.x))(case.model)
        plan = smartremat.explain(wrapped, case.x)
    return plan, caught, wrapped


def real_inputs(case: Any, avals: tuple) -> tuple:
    """The benchmark's arrays in the order of the step's abstract inputs (checked leaf by leaf)."""
    leaves = [*jax.tree.leaves((eqx.filter(case.model, eqx.is_array), case.x)), target_of(case.model, case.x)]
    if [(a.shape, a.dtype) for a in leaves] != [(a.shape, a.dtype) for a in avals]:
        raise SystemExit("the step's inputs are not the model's arrays, its input and its targets in that order")
    return tuple(leaves)


class Column:
    """One way of timing one candidate: `run()` returns seconds per call."""

    def __init__(self, run: Any):
        self.run, self.times = run, []

    def once(self) -> None:
        self.times.append(self.run())

    def summary(self) -> str:
        even, odd = statistics.median(self.times[::2]), statistics.median(self.times[1::2])
        return f"{statistics.median(self.times) * 1e3:7.1f} ms (halves {abs(even - odd) / min(even, odd):5.1%})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--budget", type=float, default=295.39, help="MB")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args(argv)
    env = environment()
    print(f"jax {env['jax']} on {env['device']} ({env['machine']}); XLA_FLAGS={env['xla_flags']!r}")
    case = build(args.model, "quick")
    plan, steps, wrapped = tuned_candidates(case, args.budget)
    print(f"== {case.label} @ {args.budget} MB: tune=True timed {len(steps)} candidates, kept "
          f"{plan.policies} ==")
    columns: list[tuple[str, Column]] = []
    for k, (s, (temp, flops, median)) in enumerate(zip(steps, plan.timed)):
        exe = s.build()
        head = f"#{k} {temp / MB:7.2f} MB {flops / 1e9:7.3f} GFLOP tune {median * 1e3:7.1f} ms"
        columns.append((f"{head} synthetic", Column(TimedRun(exe, synthetic(s.avals), s.donated).once)))
        real = real_inputs(case, s.avals)
        columns.append((f"{head} real     ", Column(TimedRun(exe, real, s.donated).once)))
        if any(not jnp.issubdtype(a.dtype, jnp.floating) for a in s.avals):
            mixed = tuple(r if jnp.issubdtype(a.dtype, jnp.floating) else z
                          for a, r, z in zip(s.avals, real, synthetic(s.avals)))
            columns.append((f"{head} real fl. ", Column(TimedRun(exe, mixed, s.donated).once)))
    for name in ["none", "full", "dots", "dots_nb"]:
        t = Timer(strategy(case.model, name, case.where), case.x)
        if t.temp <= args.budget * MB:
            columns.append((f"bench {name:8s} {t.temp / MB:7.2f} MB", Column(t.run)))
    t = Timer(wrapped, case.x)
    columns.append((f"bench tuned plan {t.temp / MB:7.2f} MB", Column(t.run)))
    for c in columns:  # warm-up
        c[1].run()
    for order in round_orders(len(columns), args.rounds):
        for i in order:
            columns[i][1].once()
    for label, c in columns:
        print(f"  {label}: {c.summary()}")


if __name__ == "__main__":
    main()
