"""Which cost model orders training-step times (issue 13)? Measured on the quick benchmark models.

    python studies/time_model.py [--models tutorial gpt resnet] [--random 8] [--repeat 9] [--seed 0] [--size quick]

Per model, the candidates are the fixed strategies of `benchmarks/run.py` and `--random` mixed plans
(each block under a random one of no remat, `dots_saveable`, `dots_with_no_batch_dims_saveable`,
full remat). Each is compiled as the benchmark's training step and timed: `--repeat` interleaved
rounds (every candidate once per round, so drift falls on all alike), after a warm-up, the median
kept; the spread between two identical programs (the no-remat step compiled twice) is the noise.
Each candidate is then ranked by:

- **compiled FLOPs** (`cost_analysis()["flops"]`): smartremat's objective through issue 12;
- **bytes accessed** (`cost_analysis()["bytes accessed"]`);
- **temp bytes** (`memory_analysis().temp_size_in_bytes`): how much memory the step touches;
- **roofline**: `flops / F + bytes / B`, with `F` (FLOP/s) and `B` (bytes/s) measured once on this
  backend (a large matmul, a large elementwise add);
- **block times**: the sum over blocks of each block's measured forward+backward time under its
  option, on its own inputs (Checkmate's profile), the rest of the step a constant.

and Spearman's rank correlation of each with the measured times is printed (issue 13's goal for the
model it picks: >= 0.9 on every model).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (sets the CPU flag before JAX starts)
from benchmarks.strategies import UNIFORM, Ckpt, grad_step, strategy

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from studies.mixed_plans import mixed
from benchmarks.run import FIXED, build

POLICIES = ["none", "dots", "dots_nb", "full"]


def _median_time(fn, repeat: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine_constants(repeat: int) -> tuple[float, float]:
    """`(FLOP/s, bytes/s)` of this backend: a 2048^3 f32 matmul, an add of two 64 MB arrays."""
    a = jnp.ones((2048, 2048), jnp.float32)
    mm = jax.jit(lambda a: a @ a)
    flops = 2 * 2048**3 / _median_time(lambda: mm(a), repeat)
    b = jnp.ones((16 * 2**20,), jnp.float32)
    add = jax.jit(lambda b: b + 1.0)
    return flops, 2 * b.nbytes / _median_time(lambda: add(b), repeat)


class Candidate:
    """One plan's step, compiled; its figures and its times."""

    def __init__(self, name: str, model: Any, x: Any, layers: list[str] | None):
        step, params, target = grad_step(model, x)
        compiled = step.lower(params, x, target).compile()
        cost = compiled.cost_analysis()
        cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
        memory = compiled.memory_analysis()
        self.name, self.layers = name, layers
        self.flops, self.bytes = float(cost["flops"]), float(cost.get("bytes accessed", 0.0))
        self.temp = memory.temp_size_in_bytes if memory is not None else 0
        self.run = lambda: compiled(params, x, target)
        jax.block_until_ready(self.run())
        jax.block_until_ready(self.run())
        self.times: list[float] = []

    def once(self) -> None:
        t0 = time.perf_counter()
        jax.block_until_ready(self.run())
        self.times.append(time.perf_counter() - t0)


def block_times(blocks: list, inputs: list, repeat: int) -> list[dict[str, float]]:
    """Per block, per policy: the median time of the gradient (w.r.t. its parameters and input)
    of the squared sum of its output, the block under that policy, on its own input."""
    out = []
    for block, x in zip(blocks, inputs):
        row = {}
        for p in POLICIES:
            b = Ckpt(block, UNIFORM[p]) if p != "none" else block
            f = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(jnp.square(m(x)))))
            row[p] = _median_time(lambda: f(b, x), repeat)
        out.append(row)
    return out


def _block_inputs(model: Any, where, x: Any) -> list:
    """The input each block of `where(model)` sees in the model's forward (recorded by wrapping)."""
    seen: list = []

    class Record(eqx.Module):
        block: Any

        def __call__(self, *a):
            seen.append(a[0])
            return self.block(*a)

    recorded = eqx.tree_at(where, model, [Record(b) for b in where(model)])
    recorded(x)
    return seen


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def report(name: str, size: str, n_random: int, repeat: int, seed: int, F: float, B: float) -> None:
    case = build(name, size)
    where = case.where
    if where is None:
        raise SystemExit(f"{name}: its own call is its one block; choose a model with blocks (tutorial, gpt, resnet)")
    n = len(list(where(case.model)))
    rng = random.Random(seed)
    known = {tuple(p) for p in [[q] * n for q in POLICIES] + [["full" if i % 2 == 0 else "none" for i in range(n)]]}
    plans: list[list[str]] = []
    for _ in range(50 * n_random):  # distinct, and none a fixed strategy
        p = [rng.choice(POLICIES) for _ in range(n)]
        if tuple(p) not in known and len(plans) < n_random:
            known.add(tuple(p))
            plans.append(p)
    layers = {s: [s] * n for s in UNIFORM} | {"alternate": ["full" if i % 2 == 0 else "none" for i in range(n)]}
    cands = [Candidate(s, strategy(case.model, s, where), case.x, layers.get(s)) for s in FIXED]
    cands.append(Candidate("none (again)", case.model, case.x, ["none"] * n))
    cands += [Candidate("/".join(p), mixed(case.model, where, [None if q == "none" else q for q in p]),
                        case.x, p) for p in plans]
    for _ in range(repeat):
        for c in cands:
            c.once()
    per_block = block_times(list(where(case.model)), _block_inputs(case.model, where, case.x), repeat)
    t = [statistics.median(c.times) for c in cands]
    noise = abs(t[0] - t[len(FIXED)]) / t[0]
    print(f"\n== {case.label} == noise (no remat twice): {noise:.3f}")
    print(f"{'plan':>32} | {'time ms':>8} | {'GFLOP':>8} | {'GB':>6} | {'temp MB':>8} | {'roofline ms':>11} | {'blocks ms':>9}")
    rows = []
    for c, tc in zip(cands, t):
        roof = c.flops / F + c.bytes / B
        bl = sum(r[p] for r, p in zip(per_block, c.layers)) if c.layers else float("nan")
        rows.append((tc, c.flops, c.bytes, roof, bl, c.temp))
        print(f"{c.name:>32} | {tc * 1e3:8.1f} | {c.flops / 1e9:8.3f} | {c.bytes / 1e9:6.3f} | {c.temp / 2**20:8.1f} | "
              f"{roof * 1e3:11.1f} | {bl * 1e3:9.1f}")
    times = [r[0] for r in rows]
    for label, k in (("compiled FLOPs", 1), ("bytes accessed", 2), ("roofline", 3), ("temp bytes", 5)):
        print(f"{name}: Spearman {label} {spearman([r[k] for r in rows], times):+.3f} over {len(rows)}")
    has = [r for r in rows if not np.isnan(r[4])]
    print(f"{name}: Spearman block times {spearman([r[4] for r in has], [r[0] for r in has]):+.3f} "
          f"over {len(has)} (plans with one policy per block)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tutorial", "gpt", "resnet"])
    parser.add_argument("--random", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", default="quick", help="quick (benchmarks/run.py --quick) or tiny")
    args = parser.parse_args()
    F, B = machine_constants(args.repeat)
    print(f"jax {jax.__version__}, backend {jax.default_backend()} ({jax.devices()[0].device_kind}), "
          f"{os.cpu_count()} cores, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(f"machine: {F / 1e9:.1f} GFLOP/s (2048^3 f32 matmul), {B / 1e9:.1f} GB/s (64 MB f32 add)")
    for name in args.models:
        report(name, args.size, args.random, args.repeat, args.seed, F, B)


if __name__ == "__main__":
    main()
