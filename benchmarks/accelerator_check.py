"""The accelerator check: a training step that does not fit the chip without remat, planned by
`smartremat.filter_jit` against every fixed per-block policy, on one accelerator.

    python benchmarks/accelerator_check.py [--layout unrolled|scanned] [--dtype float32|bfloat16]
        [--batch 8] [--budgets auto,9500,9500/flat,auto/raw] [--strategies none,full,dots_nb,dots] [--steps 10]
        [--merge] [--out docs/results] [--size gpt2-medium|tiny]

The model is GPT-2-medium-shaped and written the ordinary Equinox way (`benchmarks.models.SequenceGPT`:
24 pre-norm blocks of `eqx.nn.LayerNorm`, `eqx.nn.MultiheadAttention` under a causal mask and a 4x
MLP of `eqx.nn.Linear`; d=1024, 16 heads, T=1024, vocabulary 32,768; 370 M parameters; one sequence
per call, batched by `jax.vmap` in the loss; `--layout scanned`: blocks stacked by `eqx.filter_vmap`
and run by `jax.lax.scan`). The step is the user's: next-token cross-entropy, its gradient, an Adam
update, every argument donated. At batch 8 in float32 its step without remat needs 19.4 GB of
temporaries, more than a TPU v5e's 15.75 GiB (docs/facts.md, fact 21).

Each run (smartremat at the first budget first, `"auto"` where asked, so that the process's peak
memory after it is its own; then each fixed strategy, the reference first; then the other budgets)
starts from the same parameters, copied onto
the device, compiles (a compile the chip refuses is a row with the compiler's message and figure),
runs one step whose loss, gradient (Adam's first moment) and new parameters are kept on the host,
then `--steps` more steps fed with the previous outputs, timed one by one (median; "host" is the
part before the call returns: the Python wrapper's work and the dispatch, before the device waits),
then `--steps` more back to back, as a training loop dispatches them (the mean, from the first call
to the last step's outputs: the host's work overlaps the chip's but for the first); its state is then
freed, so runs are sequential: one training state of this model takes 4.5 GB of the chip. Then
(`--rounds`) the runs' steps are timed interleaved on one shared training state (their states have
the same leaves): each round calls every step once, in an order rotated round by round; a run's
"interleaved" time is its median, its ratio the median over rounds of its time over the fastest
fixed strategy's in the same round, so a drift of the chip or host over the call cancels. Rows: compiled temp bytes, compile (or first call) seconds, step time, model FLOPs utilisation
(6 N + 12 L T d FLOPs per token against the chip's peak, `--peak-tflops`), the process's
`peak_bytes_in_use`, and the largest difference from the reference run (full remat) of the loss,
gradients and parameters, per leaf over its largest value, and whether they are within the
gradient standard (`benchmarks/answers.py`, in ulps of the least precise dtype the step computes in:
bfloat16 on a TPU unless `--precision highest`). For smartremat also: the plan, its
budget, predicted and compiled figures, the lowest reachable figure, the first call against the
fastest fitting fixed strategy's compile, and the first call's compiles by what they are for (block
profiles, reference step, candidate steps, the step that runs: `benchmarks.planning_time.compile_breakdown`,
count, seconds summed over threads and wall seconds covered).

The answers are compared last, after the interleaved rounds, each with its wall time (on the TPU
host a comparison took 63 s unrolled and 212 s scanned, whose stacked leaves leave memory for one
thread; `kill -USR1` prints every thread's stack, e.g. `timeout -s USR1 -k 20 530 python
benchmarks/accelerator_check.py ...`).
The figures go to `<out>/accelerator_check_<device>_<layout>_<dtype>_batch<B>.json` and `.md`;
`--merge` adds this call's runs to that file's (a check larger than one device call, run in parts;
differences are from the reference run of the same call). The file is written after each run, after
the interleaved rounds, and after the comparisons.
A strategy may also be a plan placed by hand, one policy per block in order
(`benchmarks.strategies.mixed`, e.g. `"attn:dots_nb*3+dots_nb*18+none*3"`: `attn:` puts the block's
attention alone under the policy), to time smartremat's plan against the same plan without smartremat.
A strategy named `<name>@<k>` is `<name>` compiled once more, apart (one program compiled twice: how far
two compiles of it time apart). `--no-answers` times only. `--size tiny` runs the same machinery on a
tiny model on the CPU (tests/test_benchmark.py).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (the CPU flag, only where there is no accelerator)

import argparse
import contextlib
import faulthandler
import gc
import hashlib
import json
import logging
import pathlib
import re
import signal
import statistics
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import smartremat
from smartremat import internal
from benchmarks.accelerator_report import markdown
from benchmarks.answers import tree_mismatches
from benchmarks.common import replaced
from benchmarks.planning_time import compile_breakdown, recorded_compiles
from benchmarks.models import SequenceGPT, sequence_gpt_loss
from benchmarks.strategies import program_text, strategy

MB = smartremat.MB
LR = 1e-4
OPT = optax.adam(LR)
SIZES = {"gpt2-medium": dict(layers=24, d=1024, heads=16, seq=1024, vocab=32768),
         "tiny": dict(layers=3, d=32, heads=2, seq=32, vocab=64)}
#: Peak dense bf16 FLOP/s per chip, by `device_kind` (Google's figures); others need --peak-tflops.
PEAK_TFLOPS = {"TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v4": 275.0, "TPU v6 lite": 918.0}
REFERENCE = "full"


def step(model: Any, opt_state: Any, tokens: jax.Array) -> tuple[jax.Array, Any, Any]:
    """The user's step: loss, gradient, Adam update."""
    loss, grads = eqx.filter_value_and_grad(sequence_gpt_loss)(model, tokens)
    updates, opt_state = OPT.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return loss, eqx.apply_updates(model, updates), opt_state


def refused(e: Exception) -> str | None:
    """The compiler's out-of-memory message (first line), or None for any other error."""
    text = str(e)
    return text.strip().splitlines()[0] if "RESOURCE_EXHAUSTED" in text else None


def on_host(tree: Any) -> list[np.ndarray]:
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))]


def first_moment(opt_state: Any) -> Any:
    """Adam's first moment after one step: the gradient times (1 - b1)."""
    return opt_state[0].mu


class Check:
    """The model's parameters on the host, the tokens, and the runs made so far."""

    def __init__(self, size: str, layout: str, dtype: str, batch: int):
        shape = SIZES[size]
        model = SequenceGPT(**shape, key=jax.random.key(0), scanned=layout == "scanned",
                            dtype=jnp.dtype(dtype))
        self.params, self.static = eqx.partition(model, eqx.is_array)
        self.params = jax.tree.map(np.asarray, self.params)  # on the host: each run copies them over
        self.tokens = jax.random.randint(jax.random.key(1), (batch, shape["seq"] + 1), 0, shape["vocab"])
        n = sum(x.size for x in jax.tree.leaves(self.params))
        tokens = batch * shape["seq"]
        self.flops = 6 * n * tokens + 12 * shape["layers"] * shape["seq"] * shape["d"] * tokens
        self.parameters = n
        self.kept: dict[str, tuple] = {}
        self.steps: dict[str, tuple[Any, Any]] = {}  # name: (step, its state's treedef), for `interleaved`
        self.keep_steps = False
        self.keep_answers = True  # the host copies `_compare_kept` compares (3 GB a run at 370 M parameters)
        self.compute = compute_dtype(dtype)

    def fresh(self, name: str) -> tuple[Any, Any]:
        """The run's model on the device (a fixed strategy's placed by hand: `<name>` or `<name>@<k>`,
        or a smartremat budget's `/placed=<name>`) and Adam's state for it."""
        model = eqx.combine(jax.tree.map(jnp.asarray, self.params), self.static)
        placed = re.search(r"/placed=([^/]+)", name) if name.startswith("smartremat") else None
        policy = name.split("@")[0] if not name.startswith("smartremat") else placed and placed.group(1)
        model = strategy(model, policy, lambda m: _blocks(m)) if policy else model
        return model, OPT.init(eqx.filter(model, eqx.is_array))

    def run(self, name: str, make: Any, steps: int) -> dict:
        """One run: `make()` gives `(compile seconds or None, callable step)`; see the module docstring."""
        model, opt_state = self.fresh(name)
        if not name.startswith("smartremat"):  # compiled apart: not an executable JAX kept from another run
            jax.clear_caches()
        t0 = time.perf_counter()
        try:
            jitted = make(model, opt_state)
            loss, model, opt_state = jax.block_until_ready(jitted(model, opt_state, self.tokens))
        except Exception as e:  # noqa: BLE001 - a refusal is a row; anything else is raised
            message = refused(e)
            if message is None:
                raise
            del model, opt_state
            return {"refused": message, "first_s": time.perf_counter() - t0}
        first = time.perf_counter() - t0
        if self.keep_answers:
            self.kept[name] = (float(loss), on_host(first_moment(opt_state)), on_host(model))
        if self.keep_steps:
            self.steps[name] = (jitted, jax.tree.structure((model, opt_state)))
        times, host = [], []
        for _ in range(steps):
            t1 = time.perf_counter()
            out = jitted(model, opt_state, self.tokens)
            host.append(time.perf_counter() - t1)
            _, model, opt_state = jax.block_until_ready(out)
            times.append(time.perf_counter() - t1)
        t2 = time.perf_counter()
        for _ in range(steps):  # back to back, as a training loop dispatches: the host's work overlaps the chip's
            _, model, opt_state = jitted(model, opt_state, self.tokens)
        jax.block_until_ready((model, opt_state))
        through = (time.perf_counter() - t2) / steps if steps else None
        stats = jax.devices()[0].memory_stats() or {}
        del model, opt_state, jitted
        gc.collect()
        return {"first_s": first, "step_s": statistics.median(times) if times else None,
                "host_s": statistics.median(host) if host else None, "back_to_back_s": through,
                "peak_bytes_in_use": stats.get("peak_bytes_in_use")}


def interleaved(check: Check, rounds: int) -> dict[str, dict]:
    """`{name: {"interleaved_s": median, "interleaved_vs_fastest_fixed": median ratio}}` of the kept
    steps called in turn on one training state, `rounds` rounds after an untimed one (module docstring)."""
    names = list(check.steps)
    if not names or rounds <= 0:
        return {}
    model, opt_state = check.fresh("smartremat")
    leaves = jax.tree.leaves((model, opt_state))
    del model, opt_state
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        for name in names[r % len(names):] + names[: r % len(names)]:
            jitted, treedef = check.steps[name]
            t = time.perf_counter()
            _, model, opt_state = jax.block_until_ready(jitted(*jax.tree.unflatten(treedef, leaves), check.tokens))
            if r:
                times[name].append(time.perf_counter() - t)
            leaves = jax.tree.leaves((model, opt_state))
            del model, opt_state
    del leaves
    check.steps.clear()
    gc.collect()
    fixed = [n for n in names if not n.startswith("smartremat") and "@" not in n]
    out: dict[str, dict] = {n: {"interleaved_s": statistics.median(times[n])} for n in names}
    if fixed:
        fastest = min(fixed, key=lambda n: statistics.median(times[n]))
        for n in names:
            ratios = [a / b for a, b in zip(times[n], times[fastest])]
            out[n].update(interleaved_vs_fastest_fixed=statistics.median(ratios), interleaved_against=fastest)
    return out


def _blocks(model: SequenceGPT) -> list:
    return [model.blocks] if model.scanned else model.blocks


def compiled_fixed(check: Check, row: dict) -> Any:
    """`make` for a fixed strategy: the donated step lowered and compiled, its temp bytes in `row`."""

    def make(model: Any, opt_state: Any) -> Any:
        t0 = time.perf_counter()
        compiled = eqx.filter_jit(step, donate="all").lower(model, opt_state, check.tokens).compile()
        row["compile_s"] = time.perf_counter() - t0
        row["temp_mb"] = compiled.compiled.memory_analysis().temp_size_in_bytes / MB
        row["program"] = program_hash(compiled.compiled.as_text())
        return compiled

    return make


def planned_step(budget: str, row: dict) -> Any:
    """`make` for smartremat: `filter_jit(step, budget_mb=...)`, planned on the first call; a budget
    with `/flat` plans with `nested=False` (whole blocks only); one with `/raw` with `calibrate=False`
    (no block compiled: every option's figures from the jaxpr); one with `/placed=<strategy>` plans
    the model with that fixed strategy placed by hand (`Check.fresh`: at a budget no plan needs, the
    hand-placed policy run through smartremat's step); one with `/tie=<share>` plans with that tie
    margin (`margin_of`)."""

    def make(model: Any, opt_state: Any) -> Any:
        amount, *suffixes = budget.split("/")
        mb: Any = "auto" if amount == "auto" else float(amount)
        planned = smartremat.filter_jit(step, budget_mb=mb, donate="all", nested="flat" not in suffixes,
                                        calibrate="raw" not in suffixes)
        row["planned"] = planned
        return planned

    return make


def margin_of(name: str) -> contextlib.AbstractContextManager:
    """The search's tie margin while a run named `smartremat <budget>/tie=<share>` plans (its
    first call): `smartremat.internal.TIE_MARGIN` replaced; no change for any other run."""
    tie = re.search(r"/tie=([0-9.]+)", name)
    return contextlib.nullcontext() if tie is None else replaced(internal.TIE_MARGIN, float(tie.group(1)))


def program_hash(hlo: str) -> str:
    """A digest of `benchmarks.strategies.program_text`: equal for one program compiled twice."""
    return hashlib.sha256(program_text(hlo).encode()).hexdigest()[:16]


def plan_row(row: dict, check: Check, name: str) -> None:
    """A smartremat run's plan figures in `row` (read off its `Plan` for the run's own model and
    arguments, and the digest of the executable it ran), `row["planned"]` dropped."""
    planned = row.pop("planned", None)
    if planned is None or "refused" in row:
        return
    args = (*check.fresh(name), check.tokens)
    plan = planned.plan(*args)
    row["program"] = program_hash(planned.lower(*args).compile().as_text())  # the executable that ran: no compile
    del args
    row.update(temp_mb=plan.compiled_peak_bytes / MB, budget_mb=plan.budget_bytes / MB,
               predicted_mb=plan.predicted_peak_bytes / MB, lowest_mb=plan.min_peak_bytes / MB,
               full_predicted_mb=plan.full_remat_peak_bytes / MB, none_predicted_mb=plan.no_remat_peak_bytes / MB,
               compiles=plan.compiles, planning_s=plan.planning_seconds,
               policies=" ".join(b.policy for b in plan.blocks), explain=str(plan),
               options=" ".join(sorted({o.name for b in plan.blocks for o in b.options})))  # what planning weighed


def compute_dtype(dtype: str) -> str:
    """The least precise dtype the step computes in: a TPU multiplies float32 in bfloat16 passes
    unless the matmul precision is `highest`."""
    precision = jax.config.jax_default_matmul_precision or ""
    tpu = jax.default_backend() == "tpu" and precision not in ("highest", "float32")
    return "bfloat16" if tpu else dtype


def differences(check: Check, name: str) -> dict:
    """The largest differences from the reference run (per leaf over its largest value), and
    whether they are within the gradient standard (`benchmarks.answers.tree_mismatches`: loss,
    Adam's first moment, new parameters; in ulps of `compute_dtype`)."""
    if name not in check.kept or REFERENCE not in check.kept:
        return {}
    (l0, g0, p0), (l1, g1, p1) = check.kept[REFERENCE], check.kept[name]
    worst = lambda a, b: max(float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)) for x, y in zip(a, b))  # noqa: E731
    mismatches = tree_mismatches((np.float32(l1), g1, p1), (np.float32(l0), g0, p0), grads=(g1, g0),
                                 compute_dtype=check.compute, step_size=LR)
    return {"loss_diff": abs(l1 - l0) / abs(l0), "grad_diff": worst(g1, g0), "param_diff": worst(p1, p0),
            "answer": "same" if not mismatches else f"{len(mismatches)} leaves differ; {mismatches[0]}"}


def derived(result: dict, check_flops: float, peak: float | None) -> None:
    """Step time against the fastest fitting fixed strategy, MFU, first call against its compile."""
    rows = result["runs"]
    fixed = {n: r for n, r in rows.items() if not n.startswith("smartremat") and r.get("step_s")}
    fastest = min((n for n in fixed if "@" not in n), key=lambda n: fixed[n]["step_s"], default=None)  # not a copy
    result["fastest_fitting_fixed"] = fastest
    for name, r in rows.items():
        if r.get("step_s"):
            r["mfu"] = check_flops / r["step_s"] / (peak * 1e12) if peak else None
            if fastest is not None:
                r["vs_fastest_fixed"] = r["step_s"] / fixed[fastest]["step_s"]
            ahead = [f["back_to_back_s"] for n, f in fixed.items() if f.get("back_to_back_s") and "@" not in n]
            if r.get("back_to_back_s") and ahead:
                r["back_to_back_vs_fastest_fixed"] = r["back_to_back_s"] / min(ahead)
        if name.startswith("smartremat") and r.get("program"):
            same = [n for n, f in fixed.items() if f.get("program") == r["program"]] + [
                n for n, f in rows.items() if n != name and n.startswith("smartremat") and f.get("program") == r["program"]]
            r["same_program_as"] = same[0] if same else None  # a fixed strategy's first, else another plan's
        if name.startswith("smartremat") and fastest is not None and "first_s" in r:
            r["first_call_vs_fastest_fixed_compile"] = r["first_s"] / fixed[fastest]["compile_s"]


def check(size: str, layout: str, dtype: str, batch: int, budgets: list[str], names: list[str], steps: int,
          out: pathlib.Path, merge: bool, peak: float | None, command: str, rounds: int = 0,
          answers: bool = True) -> dict:
    device = jax.devices()[0]
    precision = jax.config.jax_default_matmul_precision or ""
    name = f"{device.platform} {device.device_kind} {layout} {dtype} batch{batch} {precision}"
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower())
    path = out / f"accelerator_check_{slug.strip('_')}.json"
    result = json.loads(path.read_text()) if merge and path.exists() else {"runs": {}, "commands": []}
    c = Check(size, layout, dtype, batch)
    c.keep_steps, c.keep_answers = rounds > 0, answers
    peak = peak or PEAK_TFLOPS.get(device.device_kind)
    result.update(device=device.device_kind, platform=device.platform, jax=jax.__version__,
                  equinox=eqx.__version__, smartremat_version=smartremat.__version__,
                  bytes_limit=(device.memory_stats() or {}).get("bytes_limit"), xla_flags=os.environ.get("XLA_FLAGS", ""),
                  matmul_precision=precision or "default", compute_dtype=c.compute,
                  model=f"SequenceGPT {size} ({layout}, {dtype}), {c.parameters / 1e6:.0f} M parameters, batch {batch}, "
                        "Adam, donated", flops_per_step=c.flops, peak_tflops=peak, steps=steps)
    result["commands"].append(command)
    for name, maker in _runs(c, budgets, names):  # written after each run: a call cut short keeps what it measured
        row: dict = {}
        with recorded_compiles() as record, margin_of(name):  # what smartremat's first call compiles, by what for
            row.update(c.run(name, maker(row), steps))
        if name.startswith("smartremat"):
            row["compiles_by_kind"] = compile_breakdown(record)
        plan_row(row, c, name)
        result["runs"][name] = row
        print(f"{name}: {_short(row)}", flush=True)
        derived(result, c.flops, peak)
        write(path, result)
    for name, figures in interleaved(c, rounds).items():
        result["runs"][name].update(figures, rounds=rounds)
        print(f"{name}: interleaved {figures['interleaved_s'] * 1e3:.1f} ms, "
              f"{figures.get('interleaved_vs_fastest_fixed', float('nan')):.4f} of {figures.get('interleaved_against')}", flush=True)
    write(path, result)
    _compare_kept(c, result, lambda: write(path, result))  # last: slow on the TPU host (docs/fit.md)
    return result


def _runs(c: Check, budgets: list[str], names: list[str]) -> list[tuple[str, Any]]:
    """The first budget (`"auto"` where asked) on a fresh process, then the fixed strategies (the
    reference first), then the other budgets: a call cut short has the comparison that matters."""
    planned = [(f"smartremat {b}", lambda row, b=b: planned_step(b, row))
               for b in sorted(budgets, key=lambda b: not b.startswith("auto"))]
    fixed = [(n, lambda row: compiled_fixed(c, row)) for n in sorted(names, key=lambda n: n != REFERENCE)]
    return planned[:1] + fixed + planned[1:]


def _compare_kept(c: Check, result: dict, written: Any) -> None:
    """Each kept run's differences from the reference, once the reference has run, the file written
    (`written()`) after each; the run's host copies are then dropped (a 370 M-parameter run keeps 3 GB
    of the host's memory)."""
    if REFERENCE not in c.kept:
        return
    for other in [n for n in c.kept if n != REFERENCE]:
        print(f"{other}: comparing with {REFERENCE} at {time.strftime('%H:%M:%S')}", flush=True)
        t = time.perf_counter()
        result["runs"][other].update(differences(c, other))
        print(f"{other}: {result['runs'][other].get('answer', '-')} ({time.perf_counter() - t:.1f} s)", flush=True)
        del c.kept[other]
        written()


def write(path: pathlib.Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    path.with_suffix(".md").write_text(markdown(result, REFERENCE))


def _short(row: dict) -> str:
    keep = ("refused", "temp_mb", "compile_s", "first_s", "step_s", "back_to_back_s", "peak_bytes_in_use", "policies")
    return ", ".join(f"{k}={row[k]:.4g}" if isinstance(row[k], float) else f"{k}={row[k]}" for k in keep if k in row)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--size", default="gpt2-medium", choices=sorted(SIZES))
    ap.add_argument("--layout", default="unrolled", choices=["unrolled", "scanned"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--budgets", default="auto,9500", help="smartremat's budgets: auto and/or MB, comma-separated; "
                    "one with /flat plans whole blocks only (nested=False), one with /raw without block "
                    "compiles (calibrate=False), one with /placed=<strategy> on the model under that fixed "
                    "strategy, one with /tie=<share> with that "
                    "tie margin of the search (default smartremat.internal.TIE_MARGIN)")
    ap.add_argument("--strategies", default="none,full,dots_nb,dots", help=f"fixed strategies ({REFERENCE} is needed)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps after the first")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved rounds of every run's step after the runs "
                    "(0: none)")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--merge", action="store_true", help="add these runs to the file's")
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--precision", default=None, choices=["default", "high", "highest"],
                    help="jax.default_matmul_precision for every run (a TPU multiplies float32 in bfloat16 passes "
                         "by default, so remat changes rounding: 'highest' checks the answers exactly)")
    ap.add_argument("--no-answers", action="store_true", help="time only: compare no answers (then "
                    f"{REFERENCE} is not needed)")
    ap.add_argument("--verbose", action="store_true", help="log what planning does, with the time")
    args = ap.parse_args(argv)
    if hasattr(faulthandler, "register"):  # `kill -USR1` prints every thread's stack (a call that stalls)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.verbose:
        logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
        logging.getLogger("smartremat").setLevel(logging.INFO)
    names, budgets = _checked(args)
    command = " ".join(["benchmarks/accelerator_check.py", *(sys.argv[1:] if argv is None else argv)])
    precision = contextlib.nullcontext() if args.precision is None else jax.default_matmul_precision(args.precision)
    with precision:
        result = check(args.size, args.layout, args.dtype, args.batch, budgets, names, args.steps,
                       pathlib.Path(args.out), args.merge, args.peak_tflops, command, args.rounds,
                       not args.no_answers)
    print(markdown(result, REFERENCE))
    return result


def _checked(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """`(strategies, budgets)` of the command line, each checked before any run (a call's runs take
    minutes): the reference where answers are compared, the budgets' form, and every strategy named
    (fixed, `@<k>` copies and `/placed=`) placed on the model, abstract."""
    names = [n for n in args.strategies.split(",") if n]
    budgets = [b for b in args.budgets.split(",") if b]
    if names and REFERENCE not in names and not args.no_answers:
        raise SystemExit(f"--strategies {args.strategies}: the reference of the differences, {REFERENCE}, is needed")
    if not all(re.fullmatch(r"(auto|[0-9.]+)(/flat)?(/raw)?(/placed=[\w:*+]+)?(/tie=[0-9.]+)?", b) for b in budgets):
        raise SystemExit(f"--budgets {args.budgets}: auto or numbers of MB, each optionally followed by /flat "
                         "(nested=False), /raw (calibrate=False), /placed=<strategy> (the model under a fixed "
                         "strategy) and /tie=<share> (the search's tie margin), in that order, comma-separated")
    model = eqx.filter_eval_shape(lambda: SequenceGPT(**SIZES[args.size], key=jax.random.key(0),
                                                     scanned=args.layout == "scanned"))
    placed = [m.group(1) for b in budgets if (m := re.search(r"/placed=([^/]+)", b))]
    for name in [n.split("@")[0] for n in names] + placed:
        try:
            strategy(model, name, _blocks)
        except ValueError as e:
            raise SystemExit(f"--strategies/--budgets: {e}; a fixed strategy is none, full, dots, dots_nb, "
                             "alternate, sqrt or per-block policies (`benchmarks.strategies.mixed`)") from e
    return names, budgets


if __name__ == "__main__":
    main()
