"""The GPU check: a GPT-2-small training step on one accelerator, every fixed remat strategy against
`smartremat.filter_jit` at three budgets, in a few minutes.

    python benchmarks/gpu_check.py [--size gpt2-small|tiny] [--batch B] [--out docs/results] [--repeat 20]

`--batch` takes the first B of the size's sequences (GPT-2-small has 8: no remat's step needs about
26 GB, more than a 16 GB accelerator holds, so run it there with `--batch 2`).

The step is the one a user runs: next-token cross-entropy (`benchmarks.models.gpt_loss`), its
gradient by `eqx.filter_value_and_grad`, and an SGD update; it returns the loss, the gradients and
the updated model. For each fixed strategy (`benchmarks.strategies.strategy`: no remat, full remat,
`dots_saveable`, `dots_with_no_batch_dims_saveable`, every other block, sqrt(n) segments): the
compiled temp bytes and the median step time. Then `smartremat.filter_jit` at the budgets a quarter,
half and three quarters of the way from full remat's temp bytes to no remat's, with the default
objective (fewest compiled FLOPs) and with `tune=True` (the fastest candidate by the clock): whether
the compiled step fits (temp bytes <= budget), its step time against the fastest fixed strategy that
fits, the first call's planning and compile time against the plain step's compile, and the largest
difference of the loss, gradients and update from no remat's (relative to each leaf's largest value).

All steps are timed in interleaved rounds, each in a fresh order (`smartremat.internal.round_orders`).
The figures go to `<out>/gpu_check_<device>.json` and `.md`, with the device and jax version. On the
CPU (`--size tiny`, as the test suite runs it) `benchmarks.common` sets the CPU barrier flag; on a GPU
it does not (it breaks XLA:GPU).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (the CPU flag, only where there is no GPU)

import argparse
import contextlib
import dataclasses
import json
import pathlib
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import smartremat
from benchmarks.models import gpt_loss
from benchmarks.run import FIXED, build, rel_diff
from benchmarks.strategies import strategy
from smartremat.internal import round_orders

MB = smartremat.MB
LR = 1e-3
SHARES = (0.25, 0.5, 0.75)  #: budgets between full remat's temp bytes (0) and no remat's (1)


def step(model: Any, tokens: jax.Array) -> tuple[jax.Array, Any, Any]:
    """The training step: loss, gradients, and the model after one SGD update."""
    loss, grads = eqx.filter_value_and_grad(gpt_loss)(model, tokens)
    return loss, grads, eqx.apply_updates(model, jax.tree.map(lambda g: -LR * g, grads))


@dataclass
class Run:
    """One step on the check's arguments: `call` runs it; `first_s`, the seconds until its first
    result (compiling it; for smartremat, planning too); its compiled temp bytes and first output."""

    call: Callable[[], Any]
    first_s: float
    temp: int
    out: Any
    times: list[float] = field(default_factory=list)

    def once(self) -> None:
        t0 = time.perf_counter()
        jax.block_until_ready(self.call())
        self.times.append(time.perf_counter() - t0)

    def leaves(self) -> list:
        return [x for x in jax.tree.leaves(self.out) if eqx.is_array(x)]


def fixed_runs(case: Any, names: list[str]) -> dict[str, Run]:
    """Each fixed strategy's step (`eqx.filter_jit`), lowered, compiled and run once."""
    runs = {}
    for name in names:
        model = strategy(case.model, name, case.where)
        t0 = time.perf_counter()
        compiled = eqx.filter_jit(step).lower(model, case.x).compile()
        out = jax.block_until_ready(compiled(model, case.x))
        temp = int(compiled.compiled.memory_analysis().temp_size_in_bytes)  # jax's, inside Equinox's wrapper
        runs[name] = Run(lambda c=compiled, m=model: c(m, case.x), time.perf_counter() - t0, temp, out)
        print(f"{name:>10}: temp {temp / MB:9.2f} MB, compile {runs[name].first_s:6.2f} s", flush=True)
    return runs


def smart_runs(case: Any, budgets: list[float], tune: bool) -> list[tuple[float, Run, smartremat.Plan]]:
    """`smartremat.filter_jit(step)` at each budget, its first call timed (planning, compiling and
    running it once). Its temp bytes are the compiler's for the chosen plan's whole step, as
    verification compiled it (`Plan.compiled_peak_bytes`: the same program, tests/test_step_api.py)."""
    out = []
    args = (case.model, case.x)
    for mb in budgets:
        smartremat.clear_caches()
        planned = smartremat.filter_jit(step, budget_mb=mb, tune=tune)
        t0 = time.perf_counter()
        first = jax.block_until_ready(planned(*args))
        seconds = time.perf_counter() - t0
        plan = planned.plan(*args)
        out.append((mb, Run(lambda p=planned: p(*args), seconds, int(plan.compiled_peak_bytes), first), plan))
        print(f"smartremat{' tune' if tune else ''} @ {mb:9.2f} MB: temp {plan.compiled_peak_bytes / MB:9.2f} MB, "
              f"first call {seconds:6.2f} s", flush=True)
    return out


def time_all(runs: list[Run], repeat: int) -> None:
    for order in round_orders(len(runs), repeat):
        for i in order:
            runs[i].once()


def rows(smart: list, fixed: dict[str, Run], plain_compile: float, tune: bool) -> list[dict]:
    none = fixed["none"].leaves()
    out = []
    for mb, run, plan in smart:
        fitting = [statistics.median(r.times) for r in fixed.values() if r.temp <= mb * MB]
        t = statistics.median(run.times)
        out.append({"budget_mb": mb, "tune": tune, "temp_mb": run.temp / MB, "fits": run.temp <= mb * MB,
                    "step_s": t, "vs_fastest_fitting_fixed": t / min(fitting) if fitting else None,
                    "first_call_s": run.first_s, "first_call_vs_plain_compile": run.first_s / plain_compile,
                    "rel_diff_vs_no_remat": rel_diff(run.leaves(), none),
                    "predicted_mb": plan.predicted_peak_bytes / MB, "compiles": plan.compiles,
                    "policies": {b.path: b.policy for b in plan.blocks}})
    return out


def check(size: str, repeat: int, out: pathlib.Path, names: list[str] = FIXED,
          shares: tuple[float, ...] = SHARES, tunes: tuple[bool, ...] = (False, True),
          batch: int | None = None, command: str | None = None) -> dict:
    """Run the check and write its JSON and Markdown (`gpu_check_<device>[_batch<B>][_<precision>]`);
    returns the JSON's content. The test suite runs it tiny, on fewer strategies, budgets and
    objectives (`names` holds "none" and "full")."""
    case = build("gpt", size)
    if batch is not None:
        if not 0 < batch <= case.x.shape[0]:
            raise SystemExit(f"--batch {batch}: the {size} case has {case.x.shape[0]} sequences; "
                             f"choose 1 to {case.x.shape[0]}")
        case = dataclasses.replace(case, x=case.x[:batch], label=re.sub(r"batch \d+", f"batch {batch}", case.label))
    device = jax.devices()[0]
    fixed = fixed_runs(case, names)
    full, none = fixed["full"].temp, fixed["none"].temp
    budgets = [(full + s * (none - full)) / MB for s in shares]
    smart = {tune: smart_runs(case, budgets, tune) for tune in tunes}
    time_all(list(fixed.values()) + [r for runs in smart.values() for _, r, _ in runs], repeat)
    plain = fixed["none"].first_s
    result = {
        "device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
        "smartremat_version": smartremat.__version__, "command": command or " ".join(sys.argv),
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "model": case.label,
        "repeat": repeat, "matmul_precision": jax.config.jax_default_matmul_precision, "plain_compile_s": plain,
        "fixed": {n: {"temp_mb": r.temp / MB, "step_s": statistics.median(r.times), "compile_s": r.first_s,
                      "rel_diff_vs_no_remat": rel_diff(r.leaves(), fixed["none"].leaves())} for n, r in fixed.items()},
        "smartremat": [row for tune, runs in smart.items() for row in rows(runs, fixed, plain, tune)],
    }
    precision = jax.config.jax_default_matmul_precision
    name = f"{device.platform} {device.device_kind} {f'batch{batch}' if batch else ''} {precision or ''}"
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu_check_{slug}.json").write_text(json.dumps(result, indent=1))
    (out / f"gpu_check_{slug}.md").write_text(markdown(result))
    return result


def markdown(r: dict) -> str:
    lines = [f"# GPU check: {r['model']}", "",
             f"{r['device']} ({r['platform']}), jax {r['jax']}, smartremat {r['smartremat_version']}, "
             f"XLA_FLAGS=`{r['xla_flags']}`; plain step compile {r['plain_compile_s']:.2f} s; "
             f"median of {r['repeat']} interleaved rounds", "", f"    {r['command']}", "",
             "| strategy | temp MB | step ms | rel diff |", "|---|---|---|---|"]
    lines += [f"| {n} | {f['temp_mb']:.2f} | {f['step_s'] * 1e3:.2f} | {f['rel_diff_vs_no_remat']:.1e} |"
              for n, f in r["fixed"].items()]
    lines += ["", "| smartremat | budget MB | temp MB | predicted MB | fits | step ms | / fastest fitting fixed "
              "| first call s | / plain compile | rel diff |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in r["smartremat"]:
        ratio = "-" if s["vs_fastest_fitting_fixed"] is None else f"{s['vs_fastest_fitting_fixed']:.3f}"
        lines.append(f"| {'tune=True' if s['tune'] else 'default'} | {s['budget_mb']:.2f} | {s['temp_mb']:.2f} "
                     f"| {s['predicted_mb']:.2f} | {s['fits']} | {s['step_s'] * 1e3:.2f} | {ratio} "
                     f"| {s['first_call_s']:.2f} "
                     f"| {s['first_call_vs_plain_compile']:.1f} | {s['rel_diff_vs_no_remat']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--size", default="gpt2-small", choices=["gpt2-small", "tiny"])
    ap.add_argument("--batch", type=int, default=None, help="the first B sequences (default: all of the size's)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--strategies", default=",".join(FIXED), help="fixed strategies (none and full are needed)")
    ap.add_argument("--shares", default=",".join(map(str, SHARES)), help="budgets, from full remat (0) to none (1)")
    ap.add_argument("--objectives", default="default,tune", help="comma-separated: default, tune")
    ap.add_argument("--precision", default=None, choices=["default", "high", "highest"],
                    help="jax.default_matmul_precision for every step (a TPU multiplies float32 in bfloat16 "
                         "passes by default, so remat changes rounding: 'highest' checks gradients exactly)")
    ap.add_argument("--out", default="docs/results")
    args = ap.parse_args(argv)
    if jax.default_backend() == "cpu" and args.size != "tiny":
        print("no accelerator: this is the CPU; --size tiny runs the check's machinery here", flush=True)
    names, objectives, shares = args.strategies.split(","), args.objectives.split(","), args.shares.split(",")
    if not {"none", "full"} <= set(names) or not set(names) <= set(FIXED):
        raise SystemExit(f"--strategies {args.strategies}: name none, full and any of {', '.join(FIXED)}")
    if not set(objectives) <= {"default", "tune"}:
        raise SystemExit(f"--objectives {args.objectives}: name default, tune or both, comma-separated")
    if not all(re.fullmatch(r"[0-9.]+", x) and 0 <= float(x) <= 1 for x in shares):
        raise SystemExit(f"--shares {args.shares}: numbers from 0 (full remat's temp) to 1 (no remat's), "
                         "comma-separated")
    command = None if argv is None else " ".join(["benchmarks/gpu_check.py", *argv])
    precision = contextlib.nullcontext() if args.precision is None else jax.default_matmul_precision(args.precision)
    with precision:
        result = check(args.size, args.repeat, pathlib.Path(args.out), names, tuple(map(float, shares)),
                       tuple(o == "tune" for o in objectives), args.batch, command)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
