"""smartremat against every fixed remat strategy, measured by the compiler and the clock.

    python benchmarks/run.py [--quick] [--models tutorial gpt resnet] [--strategies ...]
                             [--budgets N] [--repeat N] [--out DIR]

For each model: every fixed strategy (no remat, full remat of every block, uniform
`dots_saveable`, uniform `dots_with_no_batch_dims_saveable`, full remat of every other block,
Chen's sqrt(n) segments) is compiled and timed once; then smartremat is planned, compiled and
timed at N budgets spread from full remat's compiled temp bytes to no remat's (plus the budget
halfway between them). Every step is the gradient of a real loss (`benchmarks.strategies.output_loss`:
squared error against targets, or next-token cross-entropy), and smartremat verifies its plans on
exactly that loss (`loss=`), so "fits" is read off the very step that is timed. A fixed strategy
"fits" a budget when its compiled temp bytes are <= it.
On the CPU the script sets XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander itself,
before JAX starts (docs/facts.md, fact 1), and says so.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (sets the CPU flag before JAX starts)
from benchmarks.strategies import compile_step, exact, strategy

import argparse
import json
import math
import pathlib
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import smartremat
from benchmarks import models as M
from smartremat.internal import round_orders

MB = smartremat.MB
FIXED = ["none", "full", "dots", "dots_nb", "alternate", "sqrt"]


@dataclass
class Case:
    name: str
    label: str
    model: Any
    x: Any
    where: Callable | None


def build(name: str, size: str) -> Case:
    key = jax.random.key(0)
    if name == "tutorial":
        n, b, d, h = {"tiny": (3, 8, 32, 128)}.get(size, (8, 64, 512, 8192))
        return Case(name, f"tutorial block stack of {n} (batch {b}, {d} -> {h} -> {d})",
                    M.TutorialStack(n, d, h, key), jax.random.normal(key, (b, d)), lambda m: m.layers)
    if name == "tutorial_block":
        b, d, h = {"tiny": (8, 32, 128)}.get(size, (64, 512, 8192))
        return Case(name, f"tutorial block alone (batch {b}, {d} -> {h} -> {d}; its own call is the block)",
                    M.TutorialBlock(d, h, key), jax.random.normal(key, (b, d)), None)
    if name == "gpt":
        n, d, heads, t, b, v = {"quick": (4, 256, 4, 256, 8, 1024), "gpt2-small": (12, 768, 12, 1024, 8, 50257),
                                "tiny": (2, 32, 2, 16, 2, 64)}[size]
        return Case(name, f"GPT {n} layers, d={d}, {heads} heads, T={t}, batch {b}, vocab {v}",
                    M.GPT(n, d, heads, t, v, key), jax.random.randint(key, (b, t), 0, v), lambda m: m.blocks)
    if name == "resnet":
        n, c, b = {"tiny": (2, 8, 2)}.get(size, (8, 16, 16))
        return Case(name, f"ResNet {n} residual blocks, {c} channels, GroupNorm, batch {b} of 32x32x3",
                    M.ResNet(n, c, 10, key), jax.random.normal(key, (b, 3, 32, 32)), lambda m: m.blocks)
    raise SystemExit(f"unknown model {name!r}: choose from tutorial, tutorial_block, gpt, resnet")


class Progress:
    """One live line on a terminal; plain lines otherwise."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.tty = sys.stdout.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        line = f"[{self.done}/{self.total} {time.perf_counter() - self.t0:6.1f} s] {what}"
        print(("\r" + line.ljust(100)) if self.tty else line, end="" if self.tty else "\n", flush=True)

    def close(self) -> None:
        if self.tty:
            print(flush=True)


class Timer:
    """A compiled gradient step, warmed up (its gradients kept for the correctness check)."""

    def __init__(self, model: Any, x: Any):
        self.step, self.params, self.temp, self.flops, self.program = compile_step(model, x, program=True)
        self.x = x
        self.grads = jax.tree.leaves(jax.block_until_ready(self.step(self.params, x)))
        jax.block_until_ready(self.step(self.params, x))
        self.times: list[float] = []

    def run(self) -> float:
        """Seconds of one call, not recorded."""
        t0 = time.perf_counter()
        jax.block_until_ready(self.step(self.params, self.x))
        return time.perf_counter() - t0

    def once(self) -> None:
        self.times.append(self.run())

    @property
    def median(self) -> float:
        return statistics.median(self.times)


#: Short steps get more rounds than `--repeat`: as many as take about `SECONDS` per program, up to
#: `MAX_REPEAT`. A median of 20 rounds of 20 ms steps is noisy (the lone tutorial block's two
#: compiles of one program differed by 3.4% in docs/benchmarks.md at 54cd647).
SECONDS = 4.0
MAX_REPEAT = 400


def repeat_for(timers: list[Timer], repeat: int, seconds: float = SECONDS) -> int:
    """`repeat` rounds, or more where the steps are short: about `seconds` per program, sized on
    one untimed call of each (the median), at most `MAX_REPEAT`."""
    return max(repeat, min(MAX_REPEAT, math.ceil(seconds / max(statistics.median(t.run() for t in timers), 1e-9))))


def time_all(timers: list[Timer], repeat: int) -> None:
    """`repeat` rounds, each running every step once: drift (allocator state, heat, other
    load) then falls on every strategy alike instead of on whichever ran last. Each round runs
    in a fresh order, as `tune=True` times (`smartremat.internal.round_orders`): no step always runs
    right after the same one (after the step without remat, a step usually runs slower, by up to 23%)."""
    for order in round_orders(len(timers), repeat):
        for i in order:
            timers[i].once()


def rel_diff(got: list, want: list) -> float:
    """Max over leaves of max|got - want| / max|want|."""
    out = 0.0
    for a, b in zip(got, want, strict=True):
        scale = float(jnp.max(jnp.abs(b))) or 1.0
        out = max(out, float(jnp.max(jnp.abs(a - b))) / scale)
    return out


def measure_fixed(case: Case, names: list[str], progress: Progress) -> tuple[dict, dict[str, Timer]]:
    out, timers, ref = {}, {}, None
    for name in ["none"] + [n for n in names if n != "none"]:
        timers[name] = Timer(strategy(case.model, name, case.where), case.x)
        temp, flops = timers[name].temp, timers[name].flops
        ref = timers[name].grads if ref is None else ref
        out[name] = {"temp_mb": temp / MB, "gflops": flops / 1e9,
                     "grad_rel_diff": rel_diff(timers[name].grads, ref)}
        progress.step(f"{case.name}: {name:9s} {temp / MB:9.2f} MB compiled")
    return out, timers


def measure_smart(case: Case, budgets: list[float], ref: list, progress: Progress, tune: bool,
                  programs: dict[str, Timer], names: dict[str, str]) -> list[dict]:
    """smartremat planned (with `tune`) and compiled at each budget. A plan whose compiled program
    is one already compiled (a fixed strategy's, or an earlier budget's) is that program: it
    shares its `Timer` (`programs`, keyed by `strategies.program_text`) and is timed once, so that a
    ratio of 1 means the same program, not two draws of the noise. `names` maps a fixed
    strategy's program to its name."""
    rows, by_policies = [], {}
    for budget in budgets:
        # the benchmark's loss is known exactly, so plans are verified on it (the step timed below)
        wrapped = smartremat.smartremat(budget_mb=budget / MB, tune=tune, **exact(case.model, case.x))(case.model)
        t0 = time.perf_counter()
        plan = smartremat.explain(wrapped, case.x)
        planning = time.perf_counter() - t0
        key = tuple(plan.policies.items())
        if key not in by_policies:  # the same policies compile to the same program at any budget
            timer = Timer(wrapped, case.x)
            by_policies[key] = programs.setdefault(timer.program, timer)
        timer = by_policies[key]
        rows.append({"budget_mb": budget / MB, "predicted_mb": plan.predicted_peak_bytes / MB,
                     "temp_mb": timer.temp / MB, "fits": timer.temp <= plan.budget_bytes, "gflops": timer.flops / 1e9,
                     "grad_rel_diff": rel_diff(timer.grads, ref), "planning_s": planning,
                     "policies": plan.policies, "same_as": names.get(timer.program), "_program": timer.program})
        progress.step(f"{case.name}: smartremat{' tune=True' if tune else ''} @ {budget / MB:9.2f} MB -> "
                      f"{timer.temp / MB:9.2f} MB")
    return rows


def headlines(fixed: dict, smart: list, half_mb: float, none_again_s: float) -> dict:
    """The headline figures of one model; `none_again_s` is the no-remat step's median time from a
    second compile of the same program, timed in the same rounds: the noise."""
    speed = []
    for r in smart:
        fitting = [f["step_s"] for f in fixed.values() if f["temp_mb"] <= r["budget_mb"]]
        speed.append(r["step_s"] / min(fitting) if fitting else None)
    half = min(smart, key=lambda r: abs(r["budget_mb"] - half_mb))
    t_full, t_none = fixed["full"]["step_s"], fixed["none"]["step_s"]
    recovered = (t_full - half["step_s"]) / (t_full - t_none) if t_full != t_none else None
    fitting = [f["step_s"] for f in fixed.values() if f["temp_mb"] <= half["budget_mb"]]
    gap = max(fitting) - min(fitting) if fitting else 0.0
    known = [s for s in speed if s is not None]
    return {
        "fit_share": sum(r["fits"] for r in smart) / len(smart),
        "speed_vs_best_fitting_fixed": speed,
        "speed_worst": max(known, default=None),
        "speed_median": statistics.median(known) if known else None,
        # the issue's measure: how much of the slowest-to-fastest fitting fixed gap the plan closes
        "gap_recovered_at_half": (max(fitting) - half["step_s"]) / gap if gap else None,
        "noise": abs(none_again_s - t_none) / t_none,
        "none_again_step_s": none_again_s,
        "overhead_recovered_at_half": recovered,
        "half_budget_mb": half["budget_mb"],
        "tightness": [r["temp_mb"] / r["budget_mb"] for r in smart],
        "model_error": [abs(r["predicted_mb"] - r["temp_mb"]) / r["temp_mb"] for r in smart],
    }


def show(case: Case, result: dict) -> str:
    fixed = result["fixed"]
    lines = [f"\n== {case.name}: {case.label} ({result.get('rounds', '?')} interleaved rounds) ==",
             f"{'strategy':>10} {'temp MB':>10} {'GFLOP':>9} {'step ms':>9} {'grad rel diff':>14}"]
    for name, f in fixed.items():
        lines.append(f"{name:>10} {f['temp_mb']:10.2f} {f['gflops']:9.3f} {f['step_s'] * 1e3:9.1f} {f['grad_rel_diff']:14.2e}")
    for tune, (rows_key, head_key) in KEYS.items():
        if rows_key in result:
            lines += _show_rows(result[rows_key], result[head_key], tune)
    return "\n".join(lines)


def _show_rows(smart: list, head: dict, tune: bool) -> list[str]:
    lines = [f"smartremat{' tune=True' if tune else ' (default: fewest compiled FLOPs)'}:",
             f"{'budget MB':>10} {'predicted':>10} {'compiled':>9} {'fits':>5} {'GFLOP':>9} {'step ms':>9} "
             f"{'/best fixed':>11} {'grad diff':>10} {'plan s':>7}  same program as"]
    for r, s in zip(smart, head["speed_vs_best_fitting_fixed"]):
        lines.append(f"{r['budget_mb']:10.2f} {r['predicted_mb']:10.2f} {r['temp_mb']:9.2f} {str(r['fits']):>5} "
                     f"{r['gflops']:9.3f} {r['step_s'] * 1e3:9.1f} {'-' if s is None else f'{s:.3f}':>11} "
                     f"{r['grad_rel_diff']:10.1e} {r['planning_s']:7.2f}  {r.get('same_as') or '-'}")
    rec, gap = head["overhead_recovered_at_half"], head.get("gap_recovered_at_half")
    lines += [
        f"fit: {head['fit_share']:.0%} of budgets; speed vs fastest fitting fixed: median "
        f"{_num(head.get('speed_median'))}, worst {_num(head['speed_worst'])} (noise: the same no-remat "
        f"program compiled and timed twice differs by {head['noise']:.3f}); at {head['half_budget_mb']:.2f} MB "
        f"gap recovered (slowest to fastest fitting fixed): {_num(gap, 2)}, overhead recovered (full to none): "
        f"{_num(rec, 2)}",
        f"tightness (compiled/budget): {min(head['tightness']):.3f}..{max(head['tightness']):.3f}; "
        f"model error |pred-compiled|/compiled: median {statistics.median(head['model_error']):.3f}, "
        f"max {max(head['model_error']):.3f}",
    ]
    return lines


def _num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def plot(case: Case, fixed: dict, smart: dict, path: pathlib.Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping plots (pip install 'smartremat[bench]')")
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, f in fixed.items():
        ax.scatter(f["temp_mb"], f["step_s"] * 1e3, zorder=3)
        ax.annotate(name, (f["temp_mb"], f["step_s"] * 1e3), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for tune, rows in smart.items():
        pts = sorted((r["temp_mb"], r["step_s"] * 1e3) for r in rows)
        ax.plot(*zip(*pts), "r.-" if tune else "k.-", zorder=2,
                label=f"smartremat{' tune=True' if tune else ''} (budget sweep)")
    ax.set_xlabel("compiled peak activation memory (temp MB)")
    ax.set_ylabel("step time (ms, median)")
    ax.set_title(case.label, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def tutorial_printout(repeat: int) -> str:
    """The tutorial's own comparison (standard vs checkpointed gradient of one block, its loss
    `mean(block(x) ** 2)`), and the same step through `smartremat.filter_jit` at the
    checkpointed step's compiled temp bytes: loss, time, compiled temp, gradient differences."""
    key = jax.random.key(0)
    block = M.TutorialBlock(512, 8192, key)
    x = jax.random.normal(key, (64, 512))
    loss = lambda b, x: jnp.mean(b(x) ** 2)
    ckpt = lambda b, x: jnp.mean(jax.checkpoint(lambda b, x: b(x))(b, x) ** 2)
    steps = {name: jax.jit(jax.value_and_grad(fn)) for name, fn in (("standard", loss), ("checkpointed", ckpt))}
    temps = {name: s.lower(block, x).compile().memory_analysis().temp_size_in_bytes for name, s in steps.items()}
    budget = temps["checkpointed"] / MB
    planned = smartremat.filter_jit(jax.value_and_grad(loss), budget_mb=budget)
    steps["smartremat"] = planned
    temps["smartremat"] = planned.lower(block, x).compile().memory_analysis().temp_size_in_bytes
    out = []
    for name, step in steps.items():
        jax.block_until_ready(step(block, x))  # warm-up (compile; plans smartremat's)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            value, grads = jax.block_until_ready(step(block, x))
            times.append(time.perf_counter() - t0)
        out.append((name, float(value), statistics.median(times), grads))
    g0 = out[0][3]
    lines = [f"{n:>12} gradient: loss {v:.6f}, {t * 1e3:.2f} ms, compiled temp {temps[n] / MB:.3f} MB"
             for n, v, t, _ in out]
    lines[-1] += (f" (smartremat.filter_jit, budget_mb={budget:.3f}: "
                  f"{smartremat.explain(planned, block, x).policies['<self>']})")
    for n, _, _, g in out[1:]:
        lines.append(f"{n}: max |dW1 difference| = {float(jnp.max(jnp.abs(g0.w1 - g.w1))):.3e}, "
                     f"max |dW2 difference| = {float(jnp.max(jnp.abs(g0.w2 - g.w2))):.3e}")
    return "\n".join(lines)


#: `--tune`: which smartremat plans each budget gets: the default (fewest compiled FLOPs), `tune=True`, or both.
TUNES = {"off": (False,), "on": (True,), "both": (False, True)}
#: The result's keys for the rows and headlines of each.
KEYS = {False: ("smartremat", "headlines"), True: ("tuned", "headlines_tuned")}


def run_model(case: Case, names: list[str], n_budgets: int, repeat: int, out: pathlib.Path,
              tunes: tuple[bool, ...] = (False, True), seconds: float = SECONDS) -> dict:
    """Every fixed strategy of `names` and smartremat's plans (`tunes`) at `n_budgets` budgets
    (and the halfway one) compiled and timed in the same rounds: `repeat`, or about `seconds` per
    program where steps are short; the result written to `out` as JSON and a plot, and printed."""
    if case.where is None:  # one block: alternate and sqrt segments are no remat and full remat again
        names = [n for n in names if n not in ("alternate", "sqrt")]
    progress = Progress(len(names) + len(tunes) * n_budgets + 2)
    fixed, fixed_timers = measure_fixed(case, names if "full" in names else names + ["full"], progress)
    programs: dict[str, Timer] = {}  # one timer per distinct program (two strategies may compile to one)
    fixed_timers = {n: programs.setdefault(t.program, t) for n, t in fixed_timers.items()}
    names_of = {t.program: n for n, t in reversed(list(fixed_timers.items()))}
    again = Timer(case.model, case.x)  # the no-remat step compiled again: the noise between identical programs
    lo, hi = sorted((fixed["full"]["temp_mb"], fixed["none"]["temp_mb"]))
    half = (lo + hi) / 2
    budgets = sorted(set(np.linspace(hi, lo, n_budgets).tolist()) | {half}, reverse=True)
    progress.total = len(fixed) + len(tunes) * len(budgets) + 1
    smart = {tune: measure_smart(case, [b * MB for b in budgets], fixed_timers["none"].grads, progress, tune,
                                 programs, names_of) for tune in tunes}
    timers = list(programs.values()) + [again]
    repeat = repeat_for(timers, repeat, seconds)
    time_all(timers, repeat)
    progress.step(f"{case.name}: timed {len(programs) + 1} distinct programs x {repeat} rounds")
    progress.close()
    for name, f in fixed.items():
        f["step_s"] = fixed_timers[name].median
    result = {"model": case.name, "label": case.label, "fixed": fixed, "env": environment(), "rounds": repeat}
    for tune, rows in smart.items():
        for r in rows:
            r["step_s"] = programs[r.pop("_program")].median
        rows_key, head_key = KEYS[tune]
        result[rows_key], result[head_key] = rows, headlines(fixed, rows, half, again.median)
    (out / f"{case.name}.json").write_text(json.dumps(result, indent=1))
    plot(case, fixed, smart, out / f"{case.name}.png")
    print(show(case, result), flush=True)
    return result


def environment() -> dict:
    return {"jax": jax.__version__, "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "xla_flags": os.environ.get("XLA_FLAGS", "")}


def markdown(results: list[dict], tutorial: str | None) -> str:
    env = results[0]["env"] if results else environment()
    lines = ["# smartremat benchmark\n", f"jax {env['jax']} on {env['device']} ({env['machine']}); "
             f"XLA_FLAGS=`{env['xla_flags']}`\n"]
    if tutorial:
        lines += ["## Tutorial block\n", "```", tutorial, "```\n"]
    lines += ["## Headlines\n", "| model | plans | fit | speed vs fastest fitting fixed: median | worst | "
              "noise (same program twice) | gap recovered at half | tightness | median model error |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for tune, (rows_key, head_key) in KEYS.items():
            if head_key not in r:
                continue
            h = r[head_key]
            noise = "-" if h.get("noise") is None else f"{h['noise']:.3f}"
            lines.append(f"| {r['model']} | {'tune=True' if tune else 'default'} | {h['fit_share']:.0%} | "
                         f"{_num(h.get('speed_median'))} | {_num(h['speed_worst'])} | {noise} | "
                         f"{_num(h.get('gap_recovered_at_half'), 2)} | {min(h['tightness']):.2f}..{max(h['tightness']):.2f} | "
                         f"{statistics.median(h['model_error']):.3f} |")
    for r in results:
        lines += [f"\n## {r['model']}: {r['label']}\n", f"![{r['model']}]({r['model']}.png)\n", "```",
                  show(Case(r["model"], r["label"], None, None, None), r).strip(), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes that finish in minutes on a CPU")
    ap.add_argument("--size", default=None, help="model size: tiny, quick (default with --quick) or full")
    ap.add_argument("--models", nargs="+", default=["tutorial_block", "tutorial", "gpt", "resnet"])
    ap.add_argument("--strategies", nargs="+", default=FIXED, choices=FIXED)
    ap.add_argument("--budgets", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default="results")
    ap.add_argument("--tune", choices=sorted(TUNES), default="both",
                    help="smartremat's plans per budget: the default, tune=True, or both (timed in the same rounds)")
    args = ap.parse_args(argv)
    size = args.size or ("quick" if args.quick else "gpt2-small")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    print(f"jax {env['jax']} on {env['device']} ({env['machine']}); XLA_FLAGS={env['xla_flags']!r}"
          + (" (set by this script: on the CPU remat needs it, docs/facts.md, fact 1)" if env["backend"] == "cpu" else ""))
    tutorial = None
    if {"tutorial", "tutorial_block"} & set(args.models) and size != "tiny":
        tutorial = tutorial_printout(args.repeat)
        print("\n" + tutorial, flush=True)
    results = [run_model(build(m, "gpt2-small" if (m == "gpt" and size == "full") else size), args.strategies,
                         args.budgets, args.repeat, out, TUNES[args.tune]) for m in args.models]
    (out / "summary.md").write_text(markdown(results, tutorial))
    print(f"\nwrote {out}/summary.md and {', '.join(m + '.json' for m in args.models)}")
    return results


if __name__ == "__main__":
    main()
