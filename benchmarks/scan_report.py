"""Scanned vs unrolled: a 12-layer transformer written both ways, planned at the same budgets.

    python benchmarks/scan_report.py [--layers 12] [--d 128] [--seq 256] [--batch 8] [--out PATH]

Nested options are off for both, so the comparison isolates what the scan itself costs. Part 1 plans with
smartremat's model alone (`calibrate=False, verify=False`, so both models are planned from the same
kind of figures) at budgets between the lowest reachable peak and
no remat: predicted peak and recompute of the unrolled model, of the scanned model with
`scan_segments=2` (the default) and with `scan_segments=1` (one policy for the whole scan).
Part 2 plans the scanned model as the decorator does by default (calibrated, verified) at
budgets between the compiled temp of full remat and of no remat, and holds each plan against
the compiler. Part 3 times compiling the training step: the plain scan, the unrolled loop, and
the scan as planned (split into pieces), each median of `--repeat` fresh compiles. The training
step is the gradient of the mean squared error against a target (an input of the step) w.r.t. the
model's parameters, compiled with the options smartremat measures with (`measuring_options`); its
budgets run from the temp of the scan under full remat (`jax.checkpoint(policy=nothing_saveable)`
around each block's call) to that of the plain scan.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (sets the CPU flag before JAX starts)

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import smartremat
from benchmarks.models import GPTBlock, Stack
from smartremat.internal import measuring_options

MB = smartremat.MB


class ScannedStack(eqx.Module):
    """`Stack` of the same blocks, stacked with `eqx.filter_vmap` and run by `jax.lax.scan`; with
    `policy`, each block's call under `jax.checkpoint` with it (a fixed strategy)."""

    blocks: GPTBlock
    policy: Any = eqx.field(static=True, default=None)

    def __call__(self, x):
        params, static = eqx.partition(self.blocks, eqx.is_array)
        call = lambda block, h: block(h)  # noqa: E731
        if self.policy is not None:
            call = eqx.filter_checkpoint(call, policy=self.policy)
        x, _ = jax.lax.scan(lambda h, p: (call(eqx.combine(p, static), h), None), x, params)
        return x


def build(layers: int, d: int):
    keys = jax.random.split(jax.random.key(0), layers)
    unrolled = Stack([GPTBlock(d, 4, k) for k in keys])
    scanned = ScannedStack(eqx.filter_vmap(lambda k: GPTBlock(d, 4, k))(keys))
    return unrolled, scanned


def planned(model, x, budget_mb, segments=2, model_only=True) -> tuple[smartremat.Plan, Any]:
    """`(plan, the model under it)`."""
    wrapped = smartremat.smartremat(budget_mb=budget_mb, calibrate=not model_only, verify=not model_only,
                                    scan_segments=segments, nested=False)(model)
    return smartremat.explain(wrapped, x), wrapped


def plan(model, x, budget_mb, segments=2, model_only=True) -> smartremat.Plan:
    return planned(model, x, budget_mb, segments, model_only)[0]


def pieces(p) -> str:
    return " ".join(f"{b.path.split('[', 1)[-1].rstrip(']') if '[' in b.path else 'all'}:{b.policy[:8]}"
                    for b in p.blocks)


def model_table(unrolled, scanned, x) -> list[str]:
    u0, s0 = plan(unrolled, x, 1e9), plan(scanned, x, 1e9)
    lo = max(u0.min_peak_bytes, s0.min_peak_bytes) / MB
    hi = min(u0.no_remat_peak_bytes, s0.no_remat_peak_bytes) / MB
    rows = ["| budget MB | unrolled peak | unrolled GFLOP | scan peak | scan GFLOP | peak diff | GFLOP diff | scan pieces | one-piece scan GFLOP |",
            "|---|---|---|---|---|---|---|---|---|"]
    for b in np.linspace(lo, hi, 8)[1:-1]:
        u, s, one = plan(unrolled, x, b), plan(scanned, x, b), plan(scanned, x, b, segments=1)
        dp = (s.predicted_peak_bytes - u.predicted_peak_bytes) / u.predicted_peak_bytes
        dc = (s.recompute_flops - u.recompute_flops) / max(u.recompute_flops, 1)
        rows.append(f"| {b:.2f} | {u.predicted_peak_bytes / MB:.2f} | {u.recompute_flops / 1e9:.3f} | "
                    f"{s.predicted_peak_bytes / MB:.2f} | {s.recompute_flops / 1e9:.3f} | {100 * dp:+.1f}% | "
                    f"{100 * dc:+.1f}% | {pieces(s)} | {one.recompute_flops / 1e9:.3f} |")
    return rows


def compile_seconds(model, x, repeat: int) -> tuple[float, int]:
    """`(median seconds of --repeat fresh compiles, temp bytes)` of `model`'s training step (the
    module docstring), on abstract values."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, x, jax.eval_shape(model, x)))

    def step(p, x, target):
        return jax.grad(lambda p: jnp.mean((eqx.combine(p, static)(x).astype(jnp.float32) - target) ** 2))(p)

    times, temp = [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        compiled = jax.jit(step).lower(*avals).compile(measuring_options())
        temp = compiled.memory_analysis().temp_size_in_bytes
        times.append(time.perf_counter() - t0)
    return statistics.median(times), temp


def verified_table(unrolled, scanned, x, repeat: int) -> list[str]:
    t_scan, none = compile_seconds(scanned, x, repeat)
    t_unrolled, _ = compile_seconds(unrolled, x, repeat)
    _, full = compile_seconds(ScannedStack(scanned.blocks, jax.checkpoint_policies.nothing_saveable), x, 1)
    rows = [f"compile, plain scan (no remat): {t_scan:.2f} s; unrolled loop (no remat): {t_unrolled:.2f} s "
            f"(median of {repeat})", "",
            "| budget MB | pieces | predicted MB | compiled MB | fits | compile s |", "|---|---|---|---|---|---|"]
    for b in np.linspace(full, none, 6)[1:-1] / MB:
        p, wrapped = planned(scanned, x, b, model_only=False)
        t, temp = compile_seconds(wrapped, x, repeat)
        rows.append(f"| {b:.2f} | {pieces(p)} | {p.predicted_peak_bytes / MB:.2f} | {temp / MB:.2f} | "
                    f"{'yes' if temp <= p.budget_bytes else 'NO'} | {t:.2f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    unrolled, scanned = build(args.layers, args.d)
    x = jax.random.normal(jax.random.key(1), (args.batch, args.seq, args.d))
    head = [f"# Scanned vs unrolled {args.layers}-layer transformer (d={args.d}, T={args.seq}, "
            f"batch {args.batch}), jax {jax.__version__} on {jax.devices()[0].device_kind}", "",
            "## Model alone, same budgets", ""]
    lines = head + model_table(unrolled, scanned, x) + ["", "## Scanned model, verified plans", ""]
    lines += verified_table(unrolled, scanned, x, args.repeat)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
