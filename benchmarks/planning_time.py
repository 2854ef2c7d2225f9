"""Planning time: first-call planning of the benchmark models against their plain compile, with
the disk cache in a second process; profile + solve (no compile) for a 24-layer transformer; the
solver alone.

    python benchmarks/planning_time.py [--models tutorial_block tutorial gpt resnet] [--layers 24] [--repeat 3]
    python benchmarks/planning_time.py --breakdown [--models ...]
    python benchmarks/planning_time.py --flops [--models ...]
    python benchmarks/planning_time.py --profiling-options [--models ...]
    python benchmarks/planning_time.py --real [gpt2-small 24-layer]

First call (per quick benchmark model, `benchmarks/run.py --quick` sizes): the plain training
step's compile time; smartremat's first-call planning at the budget halfway between full remat's
and no remat's compiled temp bytes, verified on the benchmark's loss (`loss=`), with empty caches
and the disk cache off; its whole-step compiles; the model error |predicted - compiled| /
compiled over the four uniform plans and every candidate the search compiled (`Plan.checked`,
which holds the chosen plan); the planning time of a second process that reads the plan from the
disk cache written by a first; and first-call planning with the decorator's default losses (no
`loss=`: squared error and two cross-entropies), with its compiles.
Then, per model, the compile time of its no-remat and `dots_saveable` steps with the default
options and with the options smartremat measures with (`smartremat.internal.measuring_options`), and whether
the two give the same temp bytes and FLOPs.

With `--breakdown`, only the first call of each model, split into the small compiles that profile
blocks and the whole-step compiles of the search (count and seconds, summed over threads, by
wrapping `smartremat.internal.compiled_temp`: a call from the module that defines it profiles a block,
any other compiles a whole step), and the search's steps (candidates
compiled together, from its "compiling N candidate plan(s)" log lines, which start once planning
has taken two seconds, so quicker searches show none); then the time to enumerate
the model's frontier of that plan's stages with `frontier` (one pass, without scan runs)
and by solving once per point (`frontier_by_solving`).

With `--profiling-options`, per model, its block-profile programs compiled one after another with
the options whole steps are measured with (`measuring_options`) and with those blocks are
profiled with (`profiling_options`): seconds, and whether every temp agrees; then each
uniform plan's whole step under both: temp bytes and FLOPs moved.

With `--real`, at GPT-2-small size (12 layers, d=768, 12 heads, T=1024, batch 8, vocab 50257) and
at 24 layers (d=1024, 16 heads, T=1024, batch 4): a whole SGD step's plain compile (where an
accelerator refuses it, the compile of the step with every block under dots_nb), then
`smartremat.filter_jit`'s first plan of it at half its no-remat temp bytes (compile only), split
into its compiles by what each is for (read off the smartremat frames on the compiling thread's
stack: block profiles, the plain step for the tail, candidate steps, the head, timing, the step
that runs), with their seconds summed and the wall time they cover; the rest of the wall time is
tracing, lowering, solving and Python. `--raw` plans with `calibrate=False` (no block compiled).

With `--flops`, per model and at the budgets a quarter, half and three quarters of the way from full
remat's compiled temp bytes to no remat's: each uniform plan's compiled FLOPs against the chosen
plan's, beside the model's difference (recompute FLOPs), both as a share of the chosen plan's
compiled FLOPs; their largest gap is how far fusion moves FLOPs against the model (the search's
`WIN_MARGIN` allows 2%).

The model is built with `eqx.filter_eval_shape`, so no parameter memory is allocated: the
whole plan is made on abstract values. `calibrate=False, verify=False` is the compile-free
planner; `calibrate=True` adds up to three small compiles per distinct block and policy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (sets the CPU flag before JAX starts)

import equinox as eqx
import jax
import jax.numpy as jnp

import smartremat
from benchmarks.common import replaced
from benchmarks.models import GPT, GPTBlock, Stack, gpt_loss
from benchmarks.run import build
from benchmarks.strategies import compile_step, exact, grad_step, strategy
from smartremat.internal import (Stage, compiled_temp, compiled_temps, frontier, frontier_by_solving,
                                 measuring_options, profiling_options, solve)

MB = smartremat.MB
MENU_NAME = {"none": "none", "dots": "dots_saveable", "dots_nb": "dots_with_no_batch_dims_saveable",
             "full": "nothing_saveable"}


def _planned(name: str, budget_mb: float, own_loss: bool = True) -> tuple[float, smartremat.Plan]:
    """`(seconds, plan)` of planning the quick model `name` at `budget_mb` in this process, on
    the benchmark's loss (`loss=`) or on the decorator's default losses."""
    case = build(name, "quick")
    options = exact(case.model, case.x) if own_loss else {}
    wrapped = smartremat.smartremat(budget_mb=budget_mb, **options)(case.model)
    t0 = time.perf_counter()
    plan = smartremat.explain(wrapped, case.x)
    return time.perf_counter() - t0, plan


def second_process(name: str, budget_mb: float) -> tuple[float, int]:
    """Plan in one process with the disk cache on (a fresh folder), then time a second's plan."""
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "SMARTREMAT_DISK_CACHE": "1", "SMARTREMAT_CACHE_DIR": folder}
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name, str(budget_mb)]
        out = [subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout for _ in range(2)]
    seconds, compiles = json.loads(out[1].strip().splitlines()[-1])
    return seconds, compiles


def first_call(name: str) -> dict:
    """The first-call figures of one quick benchmark model (see the module docstring)."""
    case = build(name, "quick")
    t0 = time.perf_counter()
    compile_step(case.model, case.x)
    plain = time.perf_counter() - t0
    temps = {p: compile_step(strategy(case.model, p, case.where), case.x)[2] for p in MENU_NAME}
    budget_mb = (temps["none"] + temps["full"]) / 2 / MB
    smartremat.clear_caches()
    os.environ["SMARTREMAT_DISK_CACHE"] = "0"
    seconds, plan = _planned(name, budget_mb)
    predicted = {p: plan.uniform()[MENU_NAME[p]][0] * MB for p in MENU_NAME}
    errors = [abs(predicted[p] - temps[p]) / temps[p] for p in MENU_NAME]
    errors += [abs(p - c) / c for p, c in plan.checked]  # every candidate the search compiled
    again, again_compiles = second_process(name, budget_mb)
    smartremat.clear_caches()
    default_s, default_plan = _planned(name, budget_mb, own_loss=False)
    return {"default_losses_s": default_s, "default_losses_compiles": default_plan.compiles,"model": name, "plain_compile_s": plain, "budget_mb": budget_mb, "planning_s": seconds,
            "ratio": seconds / plain, "compiles": plan.compiles, "model_error_median": statistics.median(errors),
            "model_error_max": max(errors), "second_process_s": again, "second_process_compiles": again_compiles,
            "fits": plan.compiled_peak_bytes <= plan.budget_bytes}


def breakdown(name: str) -> str:
    """The first call's time, its block-profile compiles and its whole-step compiles (see the module
    docstring)."""
    import threading

    case = build(name, "quick")
    temps = {p: compile_step(strategy(case.model, p, case.where), case.x)[2] for p in ("none", "full")}
    budget_mb = (temps["none"] + temps["full"]) / 2 / MB
    lock, figures = threading.Lock(), {"profile": [0, 0.0], "step": [0, 0.0]}

    def counted(*args):
        caller = sys._getframe(1).f_globals.get("__name__")  # the profiler's own calls profile blocks
        kind = "profile" if caller == compiled_temp.__module__ else "step"
        t0 = time.perf_counter()
        out = compiled_temp(*args)
        with lock:
            figures[kind][0] += 1
            figures[kind][1] += time.perf_counter() - t0
        return out

    class Steps(logging.Handler):  # the search's "compiling N candidate plan(s)" lines: one per step
        def __init__(self) -> None:
            super().__init__(logging.DEBUG)
            self.sizes: list[int] = []

        def emit(self, record: logging.LogRecord) -> None:
            if m := re.search(r"compiling (\d+) candidate plan\(s\)", record.getMessage()):
                self.sizes.append(int(m.group(1)))

    log, steps = logging.getLogger("smartremat"), Steps()
    level = log.level
    log.addHandler(steps)
    log.setLevel(logging.DEBUG)
    try:
        with replaced(compiled_temp, counted):
            smartremat.clear_caches()
            seconds, plan = _planned(name, budget_mb)
    finally:
        log.removeHandler(steps)
        log.setLevel(level)
    (pn, ps), (sn, ss) = figures["profile"], figures["step"]
    times = {}
    for how, fn in (("frontier", frontier), ("solving once per point", frontier_by_solving)):
        smartremat.clear_caches()  # the planner made this frontier: time it made again, not read
        t0 = time.perf_counter()
        points = fn(plan.stages)
        times[how] = (time.perf_counter() - t0, len(points))
    enumerated = "; ".join(f"{how} {t:.3f} s ({n} points)" for how, (t, n) in times.items())
    return (f"{name}: first call {seconds:.2f} s; block-profile compiles {pn} ({ps:.2f} s summed over threads); "
            f"whole-step compiles {sn} ({ss:.2f} s) in {len(steps.sizes)} steps of {steps.sizes}; "
            f"Plan.compiles {plan.compiles}; "
            f"the model's frontier of {len(plan.stages)} stages: {enumerated}")


def flops_rows(name: str) -> list[str]:
    """Compiled against modelled FLOPs of the uniform plans, at three budgets (module docstring)."""
    case = build(name, "quick")
    compiled = {p: compile_step(strategy(case.model, p, case.where), case.x)[2:] for p in MENU_NAME}
    rows, worst = [], 0.0
    for share in (0.25, 0.5, 0.75):
        budget_mb = (compiled["full"][0] + share * (compiled["none"][0] - compiled["full"][0])) / MB
        smartremat.clear_caches()
        _, plan = _planned(name, budget_mb)
        chosen, model = plan.compiled_flops, plan.recompute_flops
        for p, (_, flops) in compiled.items():
            gap = ((flops - chosen) - (plan.uniform()[MENU_NAME[p]][1] - model)) / chosen
            worst = max(worst, abs(gap))
            rows.append(f"{name} at {budget_mb:.2f} MB, {p}: compiled {(flops - chosen) / chosen:+.4f}, "
                        f"model {(plan.uniform()[MENU_NAME[p]][1] - model) / chosen:+.4f} of the chosen plan's "
                        f"{chosen / 1e9:.4f} GFLOP")
    return rows + [f"{name}: largest gap {worst:.4f} of the step"]


def measuring_compile(name: str) -> list[str]:
    """Per uniform plan (no remat, `dots_saveable`) of a quick model: the step's compile time with
    the default options and with smartremat's measuring options, and whether their temp bytes and
    FLOPs agree."""
    case, rows = build(name, "quick"), []
    for p in ("none", "dots"):
        step, params, target = grad_step(strategy(case.model, p, case.where), case.x)
        lowered = step.lower(params, case.x, target)
        figures, seconds = [], []
        for options in (None, measuring_options()):
            t0 = time.perf_counter()
            c = lowered.compile(options)
            seconds.append(time.perf_counter() - t0)
            figures.append((c.memory_analysis().temp_size_in_bytes, c.cost_analysis()["flops"]))
        rows.append(f"{name} {p}: compile {seconds[0]:.2f} s default, {seconds[1]:.2f} s measuring "
                    f"{measuring_options()}; same temp and FLOPs: {figures[0] == figures[1]}")
    return rows


def profiling_options_rows(name: str) -> list[str]:
    """Per quick model: its block-profile programs compiled one after another with the measuring
    options and with the profiling options (seconds, and whether every temp agrees), then each
    uniform plan's whole step under both (temp bytes and FLOPs moved)."""
    case, jobs = build(name, "quick"), []
    with replaced(compiled_temps, lambda js: jobs.extend(js) or compiled_temps(js)):
        smartremat.clear_caches()
        _planned(name, 1e6)
    seconds, temps = {}, {}
    for label, options in (("measuring", measuring_options()), ("profiling", profiling_options())):
        jax.clear_caches()  # JAX keeps the executables planning compiled: compile afresh
        t0 = time.perf_counter()
        temps[label] = [compiled_temp(fn, avals, options)[0] for fn, avals in jobs]
        seconds[label] = time.perf_counter() - t0
    rows = [f"{name}: {len(jobs)} block-profile programs, {seconds['measuring']:.2f} s with the measuring options, "
            f"{seconds['profiling']:.2f} s with the profiling options {profiling_options()}; same temp bytes: "
            f"{temps['measuring'] == temps['profiling']}"]
    for p in MENU_NAME:
        step, params, target = grad_step(strategy(case.model, p, case.where), case.x)
        lowered = step.lower(params, case.x, target)
        (t1, f1), (t2, f2) = ((c.memory_analysis().temp_size_in_bytes, c.cost_analysis()["flops"])
                              for c in (lowered.compile(measuring_options()), lowered.compile(profiling_options())))
        rows.append(f"{name} {p} whole step: temp {t1} B measuring, {t2 - t1:+d} B profiling; FLOPs {(f2 - f1) / f1:+.6f}")
    return rows


REAL = {"gpt2-small": (12, 768, 12, 1024, 8, 50257), "24-layer": (24, 1024, 16, 1024, 4, 50257)}


def _kind(frames: list[tuple[str, str]]) -> str:
    """What a compile is for, from the smartremat frames `(module, function)` on its thread's stack."""
    modules = {m for m, _ in frames}
    functions = {f for _, f in frames}
    if "smartremat._profile" in modules:
        return "block profiles"
    if "smartremat._tune" in modules or "timed" in functions:
        return "timing (tune=True)"
    if "in_place" in functions:
        return "head"
    if "plain" in functions or "reference" in functions:
        return "reference step (tail, auto budget)"
    if "measure" in functions or "smartremat._verify" in modules:
        return "candidate steps (verify)"
    if "smartremat._filter_jit" in modules:
        return "the step that runs"
    return "other"


def _recording_compiles(record: list) -> Any:
    """`jax.stages.Lowered.compile`, recording `(kind, start, end)` of every compile."""
    original = jax.stages.Lowered.compile

    def compile(self, *args, **kwargs):
        frame, frames = sys._getframe(1), []
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            if module.startswith("smartremat"):
                frames.append((module, frame.f_code.co_name))
            frame = frame.f_back
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            record.append((_kind(frames), t0, time.perf_counter()))

    return original, compile


@contextlib.contextmanager
def recorded_compiles() -> Iterator[list[tuple[str, float, float]]]:
    """Within it, every `jax.stages.Lowered.compile` is recorded as `(kind, start, end)` (`_kind`)."""
    record: list = []
    original, recording = _recording_compiles(record)
    jax.stages.Lowered.compile = recording
    try:
        yield record
    finally:
        jax.stages.Lowered.compile = original


def compile_breakdown(record: list[tuple[str, float, float]]) -> dict[str, list]:
    """`{kind: [compiles, seconds summed, wall seconds covered]}` of a `recorded_compiles` record,
    and `"all"`: every compile."""
    kinds: dict[str, list] = {}
    for kind, a, z in record:
        kinds.setdefault(kind, []).append((a, z))
    kinds["all"] = [(a, z) for _, a, z in record]
    return {k: [len(iv), sum(z - a for a, z in iv), _covered(iv)] for k, iv in kinds.items()}


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of `intervals` (compiles run in threads at once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def real_breakdown(size: str, share: float = 0.5, with_floor: bool = True, calibrate: bool = True) -> str:
    """At a real size (`REAL`), compile only: the plain SGD step's compile, then
    `smartremat.filter_jit`'s first plan (and compile) at half the no-remat temp bytes (`share`), split into
    its compiles by what they are for (seconds summed over threads, and the wall time they cover),
    the rest (tracing, lowering, solving, Python) being the wall time no compile covers; then, unless
    not `with_floor`, the time to the infeasible budget's error. Where the device refuses the plain
    step, against `baseline_compile`'s. Not `calibrate`: planned with `calibrate=False` (no block
    compiled)."""
    n, d, heads, t, b, v = REAL[size]
    model = GPT(n, d, heads, t, v, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (b, t), 0, v)

    def step(model, tokens):
        loss, grads = eqx.filter_value_and_grad(gpt_loss)(model, tokens)
        return loss, eqx.apply_updates(model, jax.tree.map(lambda g: -1e-3 * g, grads))

    baseline, plain_s, none_temp = baseline_compile(step, model, tokens)
    smartremat.clear_caches()
    with recorded_compiles() as record:
        t0 = time.perf_counter()
        plan = smartremat.filter_jit(step, budget_mb=none_temp * share / MB, calibrate=calibrate).plan(model, tokens)
        wall = time.perf_counter() - t0
    kinds = compile_breakdown(record)
    covered = kinds.pop("all")[2]
    parts = "; ".join(f"{k}: {n} compiles, {summed:.2f} s summed, {w:.2f} s wall" for k, (n, summed, w) in kinds.items())
    error = abs(plan.predicted_peak_bytes - plan.compiled_peak_bytes) / plan.compiled_peak_bytes
    floor = _floor_error(step, model, tokens, plain_s) if with_floor else "floor not timed"
    return (f"{size}{'' if calibrate else ' (calibrate=False)'} (GPT {n} layers, d={d}, {heads} heads, T={t}, batch {b}, vocab {v}) on "
            f"{jax.devices()[0].device_kind}: {baseline} compile "
            f"{plain_s:.2f} s (no remat's temp {none_temp / MB:.1f} MB); first plan at {none_temp * share / MB:.1f} MB "
            f"{wall:.2f} s = x{wall / plain_s:.1f}, compiled {plan.compiled_peak_bytes / MB:.1f} MB "
            f"(fits: {plan.compiled_peak_bytes <= none_temp * share}), plan {' | '.join(f'{blk.path} {blk.policy}' for blk in plan.blocks)}, "
            f"model error {error:.3f}, Plan.compiles "
            f"{plan.compiles}; compiles cover {covered:.2f} s of the wall time, the rest {wall - covered:.2f} s; "
            f"{parts}; {floor}")


def baseline_compile(step: Callable, model: Any, tokens: Any) -> tuple[str, float, int]:
    """`(what, seconds, no remat's temp bytes)` of the compile a first plan is judged against: the
    plain step's; where the device refuses it for memory (an accelerator at real size), the step with
    every block under `dots_with_no_batch_dims_saveable` (the fastest fitting fixed policy of the TPU
    check, docs/fit.md), no remat's temp bytes then read off the refusal (XLA:TPU's `(19.40G)`)."""
    t0 = time.perf_counter()
    try:
        plain = eqx.filter_jit(step).lower(model, tokens).compile()
        return "plain", time.perf_counter() - t0, plain.compiled.memory_analysis().temp_size_in_bytes
    except Exception as e:  # noqa: BLE001 - a refusal is the baseline's answer; anything else is raised
        figure = re.search(r"temporaries \(([0-9.]+)([GMK])\)", str(e))
        if "RESOURCE_EXHAUSTED" not in str(e) or figure is None:
            raise
    none_temp = int(float(figure.group(1)) * {"G": 2**30, "M": 2**20, "K": 2**10}[figure.group(2)])
    fixed = strategy(model, "dots_nb", lambda m: m.blocks)
    t0 = time.perf_counter()
    eqx.filter_jit(step).lower(fixed, tokens).compile()
    return "no remat refused; dots_nb's", time.perf_counter() - t0, none_temp


def _floor_error(step: Callable, model: Any, tokens: Any, plain_s: float) -> str:
    """The time until `filter_jit` at a 1 MB budget raises the infeasible-budget error (the floor), in
    the same process after the first plan (smartremat's caches cleared, JAX's own left warm)."""
    smartremat.clear_caches()
    t0 = time.perf_counter()
    try:
        smartremat.filter_jit(step, budget_mb=1).plan(model, tokens)
        return "a 1 MB budget did not raise"
    except ValueError as e:
        seconds = time.perf_counter() - t0
        floor = re.search(r"at least ([0-9.]+)", str(e))
        return (f"infeasible budget (1 MB): the error after {seconds:.2f} s = x{seconds / plain_s:.1f}, "
                f"stating at least {floor.group(1) if floor else '?'} MB")


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
    ap.add_argument("--models", nargs="*", default=["tutorial_block", "tutorial", "gpt", "resnet"])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # the second process of `second_process`
    ap.add_argument("--breakdown", action="store_true", help="only split each first call into its compiles")
    ap.add_argument("--flops", action="store_true", help="only compare compiled and modelled FLOPs")
    ap.add_argument("--profiling-options", action="store_true",
                    help="only compare block-profile compiles with the measuring and the profiling options")
    ap.add_argument("--real", nargs="*", choices=sorted(REAL),
                    help="only the first plan of a whole SGD step through filter_jit at a real size, split into its compiles")
    ap.add_argument("--no-floor", action="store_true", help="with --real: skip the infeasible budget's error")
    ap.add_argument("--raw", action="store_true", help="with --real: plan with calibrate=False (no block compiled)")
    args = ap.parse_args()
    if args.real is not None:
        os.environ["SMARTREMAT_DISK_CACHE"] = "0"
        for size in args.real or sorted(REAL, reverse=True):
            print(real_breakdown(size, with_floor=not args.no_floor, calibrate=not args.raw), flush=True)
        return
    if args.profiling_options:
        os.environ["SMARTREMAT_DISK_CACHE"] = "0"
        for name in args.models:
            print("\n".join(profiling_options_rows(name)), flush=True)
        return
    if args.flops:
        os.environ["SMARTREMAT_DISK_CACHE"] = "0"
        for name in args.models:
            print("\n".join(flops_rows(name)), flush=True)
        return
    if args.breakdown:
        os.environ["SMARTREMAT_DISK_CACHE"] = "0"
        for name in args.models:
            print(breakdown(name), flush=True)
        return
    if args.child:
        seconds, plan = _planned(args.child[0], float(args.child[1]))
        print(json.dumps([seconds, plan.compiles]))
        return
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {os.cpu_count()} cores")
    print(f"{'model':>15} {'plain s':>8} {'budget MB':>10} {'plan s':>8} {'ratio':>6} {'compiles':>9} "
          f"{'err median':>10} {'err max':>8} {'2nd proc s':>10} {'fits':>5} {'default losses s':>16} {'compiles':>8}")
    for name in args.models:
        r = first_call(name)
        print(f"{r['model']:>15} {r['plain_compile_s']:8.2f} {r['budget_mb']:10.2f} {r['planning_s']:8.2f} "
              f"{r['ratio']:6.1f} {r['compiles']:9d} {r['model_error_median']:10.3f} {r['model_error_max']:8.3f} "
              f"{r['second_process_s']:10.3f} {str(r['fits']):>5} {r['default_losses_s']:16.2f} "
              f"{r['default_losses_compiles']:8d}", flush=True)
    for name in args.models:
        print("\n".join(measuring_compile(name)), flush=True)
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
