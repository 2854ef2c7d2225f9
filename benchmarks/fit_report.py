"""Fit report: at five budgets between full and no remat, the plan against the compiler.

For each model and budget it prints smartremat's modelled peak beside the compiled temp bytes
of the planned training step, and the plan's compiled FLOPs beside those of the cheapest
uniform plan (one policy on every block) that fits; both for the compiler-verified plan
(the default) and for the model alone (`verify=False`).

    python benchmarks/fit_report.py [--models tutorial tutorial_stack transformer] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (sets the CPU flag before JAX starts)

import jax
import jax.numpy as jnp
import numpy as np

import smartremat
from benchmarks.models import GPTBlock, Stack, TutorialBlock, TutorialStack
from benchmarks.strategies import UNIFORM, exact, figures, strategy

MB = smartremat.MB


def models():
    key = jax.random.key(0)
    return {
        "tutorial": (TutorialBlock(512, 8192, key), jnp.ones((64, 512)), None),
        "tutorial_stack": (TutorialStack(4, 512, 8192, key), jnp.ones((64, 512)), lambda m: m.layers),
        "transformer": (Stack([GPTBlock(256, 4, k) for k in jax.random.split(key, 4)]),
                        jnp.ones((8, 256, 256)), lambda m: m.blocks),
        # the GPU reference model of docs/facts.md: 4 layers, B=8, T=512, D=1024, 16 heads
        "transformer_large": (Stack([GPTBlock(1024, 16, k) for k in jax.random.split(key, 4)]),
                              jnp.ones((8, 512, 1024)), lambda m: m.blocks),
    }


def report(name, model, x, where):
    unif = {n: figures(strategy(model, n, where), x) for n in UNIFORM}
    lo, hi = sorted((unif["none"][0], unif["full"][0]))
    rows = []
    for budget in np.linspace(hi, lo, 5):
        row = {"budget_mb": budget / MB}
        fitting = [(f, n) for n, (t, f) in unif.items() if t <= int(budget)]
        row["uniform_best"], row["uniform_best_gflops"] = (fitting and min(fitting)[1]), (fitting and min(fitting)[0] / 1e9)
        for verify in (True, False):
            tag = "verified" if verify else "model_only"
            try:
                # verified on exactly the loss of the step whose figures are read below
                wrapped = smartremat.smartremat(budget_mb=budget / MB, verify=verify, **exact(model, x))(model)
                t0 = time.perf_counter()
                plan = smartremat.explain(wrapped, x)
                temp, flops = figures(wrapped, x)
                row[tag] = {"predicted_mb": plan.predicted_peak_bytes / MB, "compiled_mb": temp / MB,
                            "fits": temp <= plan.budget_bytes, "gflops": flops / 1e9,
                            "plan": "/".join(plan.policies.values()),
                            "plan_s": round(time.perf_counter() - t0, 2)}
            except ValueError as e:
                row[tag] = {"error": str(e)[:100]}
        rows.append(row)
    return {"model": name, "uniform": {n: {"temp_mb": t / MB, "gflops": f / 1e9} for n, (t, f) in unif.items()},
            "rows": rows}


def show(res):
    print(f"\n== {res['model']} ==  uniform plans: " + ", ".join(
        f"{n} {u['temp_mb']:.2f} MB {u['gflops']:.3f} GF" for n, u in res["uniform"].items()))
    print(f"{'budget MB':>9} | {'verified: model MB':>18} {'compiled MB':>11} {'GFLOP':>8} | "
          f"{'best uniform GFLOP':>18} | {'model-only: model MB':>20} {'compiled MB':>11} {'fits':>5} {'GFLOP':>8}")
    for r in res["rows"]:
        v, m = r["verified"], r["model_only"]
        mo = (f"{m['predicted_mb']:20.2f} {m['compiled_mb']:11.2f} {str(m['fits']):>5} {m['gflops']:8.3f}"
              if "error" not in m else f"{'infeasible (model)':>46}")
        print(f"{r['budget_mb']:9.2f} | {v['predicted_mb']:18.2f} {v['compiled_mb']:11.2f} {v['gflops']:8.3f} | "
              f"{r['uniform_best_gflops']:11.3f} ({r['uniform_best']:>5}) | {mo}   plan {v['plan']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=["tutorial", "tutorial_stack", "transformer"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()} ({jax.devices()[0].device_kind}), "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    out = []
    for name in args.models:
        model, x, where = models()[name]
        t0 = time.perf_counter()
        out.append(report(name, model, x, where))
        show(out[-1])
        print(f"({name}: {time.perf_counter() - t0:.1f} s)", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"jax": jax.__version__, "backend": jax.default_backend(),
                           "device": jax.devices()[0].device_kind, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
