"""How far apart two compiles of one training step time, and whether `tune=True`'s synthetic inputs
time like real ones (issue 13: the noise a timed choice has to beat).

    python studies/timing_noise.py [--models gpt resnet] [--compiles 4] [--rounds 30] [--copies]

For each model the quick benchmark's no-remat training step (`benchmarks.strategies.compile_step`) is
compiled `--compiles` times; each compile runs on the benchmark's real inputs and on
`smartremat.internal.synthetic` inputs of the same shapes (what `tune=True` times). All of them are
warmed up twice and timed in `--rounds` interleaved rounds, each round in a fresh order (`smartremat.internal.round_orders`; runs before it was rotated by one). Printed: each one's median and minimum,
the spread of the medians (and of the minima) between compiles, as (max - min) / min, and the
median ratio synthetic / real.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (sets the CPU flag before JAX starts)
from benchmarks.strategies import compile_step

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.run import build, environment
from smartremat.internal import round_orders, synthetic


def _inputs(params, x) -> tuple:
    leaves, treedef = jax.tree.flatten(params)
    fake = synthetic([jax.ShapeDtypeStruct(a.shape, a.dtype) for a in [*leaves, x]])
    return jax.tree.unflatten(treedef, list(fake[:-1])), fake[-1]


def measure(name: str, compiles: int, rounds: int, copies: bool = False) -> list[str]:
    case = build(name, "quick")
    runs = {}
    for k in range(compiles):
        step, params, _, _ = compile_step(case.model, case.x)
        runs[f"compile {k} real"] = (step, params, case.x)
        runs[f"compile {k} synthetic"] = (step, *_inputs(params, case.x))
        if copies:  # the same executable on a second copy of the real inputs: an offset of the arrays?
            runs[f"compile {k} real copy"] = (step, *jax.tree.map(jnp.copy, (params, case.x)))
    for step, p, x in runs.values():  # warm-up
        jax.block_until_ready(step(p, x))
        jax.block_until_ready(step(p, x))
    times: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    for order in round_orders(len(names), rounds):  # each round in a fresh order, as `tune=True` times
        for i in order:
            k = names[i]
            step, p, x = runs[k]
            t0 = time.perf_counter()
            jax.block_until_ready(step(p, x))
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(t) for k, t in times.items()}
    low = {k: min(t) for k, t in times.items()}
    lines = [f"== {case.label}: no remat, {compiles} compiles x {rounds} interleaved rounds =="]
    lines += [f"{k:22s} median {med[k] * 1e3:8.1f} ms   min {low[k] * 1e3:8.1f} ms" for k in runs]
    for kind in ("real", "synthetic"):
        m = [v for k, v in med.items() if k.endswith(kind)]
        lo = [v for k, v in low.items() if k.endswith(kind)]
        lines.append(f"{kind:9s} inputs: spread between compiles of the median {(max(m) - min(m)) / min(m):.3f}, "
                     f"of the minimum {(max(lo) - min(lo)) / min(lo):.3f}")
    ratio = [med[f"compile {k} synthetic"] / med[f"compile {k} real"] for k in range(compiles)]
    lines.append("median synthetic / real per compile: " + ", ".join(f"{r:.3f}" for r in ratio))
    lines += _split(times, compiles, copies)
    return lines


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / min(values)


def _split(times: dict[str, list[float]], compiles: int, copies: bool) -> list[str]:
    """Whether a compile has an offset of its own or its median is just a draw: the spread between
    the medians of one compile's even and odd rounds (sampling alone) against the spread between
    compiles' medians of their even rounds (sampling and any per-compile offset); with `copies`,
    between one executable's two copies of the inputs (an offset of where the arrays lie)."""
    real = [times[f"compile {k} real"] for k in range(compiles)]
    halves = [_spread([statistics.median(t[0::2]), statistics.median(t[1::2])]) for t in real]
    out = ["split half (real inputs): spread even / odd rounds within a compile "
           + ", ".join(f"{h:.3f}" for h in halves)
           + f"; between compiles, even rounds {_spread([statistics.median(t[0::2]) for t in real]):.3f}, "
           f"odd rounds {_spread([statistics.median(t[1::2]) for t in real]):.3f}"]
    if copies:
        pairs = [_spread([statistics.median(times[f"compile {k} real"]), statistics.median(times[f"compile {k} real copy"])])
                 for k in range(compiles)]
        out.append("one executable, two copies of the real inputs: spread of the medians "
                   + ", ".join(f"{p:.3f}" for p in pairs))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt", "resnet"])
    ap.add_argument("--compiles", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--copies", action="store_true", help="also run each executable on a copy of the real inputs")
    args = ap.parse_args(argv)
    env = environment()
    print(f"jax {env['jax']} on {env['device']} ({env['machine']}); XLA_FLAGS={env['xla_flags']!r}")
    for name in args.models:
        print("\n".join(measure(name, args.compiles, args.rounds, args.copies)), flush=True)


if __name__ == "__main__":
    main()
