"""Does a step's time depend on which step ran just before it? (issue 13: how to order timing rounds.)

    python studies/timing_order.py [--model resnet] [--rounds 40]

Four fixed strategies of a quick benchmark model (no remat, `dots_saveable`, full remat,
`dots_with_no_batch_dims_saveable`) are compiled as the benchmark's training step and timed in
`--rounds` interleaved rounds under two designs, each run twice: the order rotated by one from
round to round (which keeps each step's predecessor), and shuffled afresh each round
(`smartremat.internal.round_orders`). Printed per design: each step's median, and its median when
it ran right after the step without remat against after any other.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (sets the CPU flag before JAX starts)
from benchmarks.strategies import compile_step, strategy

import argparse
import statistics
import time

import jax

from benchmarks.run import build, environment
from smartremat.internal import round_orders

NAMES = ["none", "dots", "full", "dots_nb"]


def _orders(design: str, n: int, rounds: int, seed: int) -> list[list[int]]:
    if design == "rotated":
        return [[(i + k) % n for i in range(n)] for k in range(rounds)]
    return round_orders(n, rounds, seed)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args(argv)
    env = environment()
    print(f"jax {env['jax']} on {env['device']} ({env['machine']}); XLA_FLAGS={env['xla_flags']!r}")
    case = build(args.model, "quick")
    steps = [compile_step(strategy(case.model, n, case.where), case.x)[:2] for n in NAMES]
    for step, params in steps:  # warm-up
        jax.block_until_ready(step(params, case.x))
        jax.block_until_ready(step(params, case.x))
    print(f"== {case.label}: {', '.join(NAMES)}; {args.rounds} rounds per design ==")
    for k, design in enumerate(["rotated", "shuffled", "rotated", "shuffled"]):
        after: dict[int, dict[int, list[float]]] = {i: {j: [] for j in range(len(NAMES))} for i in range(len(NAMES))}
        prev = None
        for order in _orders(design, len(NAMES), args.rounds, seed=k):
            for i in order:
                step, params = steps[i]
                t0 = time.perf_counter()
                jax.block_until_ready(step(params, case.x))
                if prev is not None:
                    after[i][prev].append(time.perf_counter() - t0)
                prev = i
        med = {NAMES[i]: statistics.median(sum(a.values(), [])) * 1e3 for i, a in after.items()}
        print(f"{design:9s} median ms: " + ", ".join(f"{n} {m:.1f}" for n, m in med.items()))
        for i in range(1, len(NAMES)):
            first = after[i][0]
            rest = sum((v for j, v in after[i].items() if j != 0), [])
            print(f"          {NAMES[i]:8s} after none: "
                  + (f"{statistics.median(first) * 1e3:6.1f} ms ({len(first)} runs)" if first else "never        ")
                  + f", after the others: {statistics.median(rest) * 1e3:6.1f} ms ({len(rest)} runs)")


if __name__ == "__main__":
    main()
