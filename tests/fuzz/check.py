"""Hold one fuzz case against smartremat's invariants.

For a case (`grammar.Case`) the plain step `eqx.filter_jit(step)` gives the reference answer and
the temp bytes without remat; `smartremat.filter_jit(step, budget_mb=TINY)` gives the stated floor
(the documented `ValueError`, "... Raise `budget_mb` to at least X"); the budget is drawn between
the two (`case.budget`), and then:

- (a) `exception`: nothing raises but the documented errors (a `ValueError` stating a minimum);
- (b) `mismatch`: every array the planned step returns equals the plain step's
  (`tests.helpers.tree_mismatches`); where it reports a difference, rule 6 judges whether it is
  float32 rounding: the same plan (the same assignment for each module call, not a plan made
  anew for other dtypes) and the plain step are both run again in float64 from the same inputs
  cast up (the grammar computes in float64 there: `grammar.working`), and the difference passes
  if these two float64 answers agree to `RTOL64` (1e-12) of each leaf's scale, by
  `tree_mismatches`' rules (zero up to rounding included) at that tolerance. A plan that
  computes another function (a wrong gradient) differs in float64 as well; a differently
  ordered float32 sum does not. In a case whose blocks compute in bfloat16 or float16, the
  float64 answers still round there: they are held to those ulps, as in float32. Only where
  every difference reported is one of float values: never a structure, dtype, integer or NaN
  difference;
- (c) `over budget`: the compiled temp bytes of the planned step fit the budget;
- (d) `unreachable`: `smartremat.explain`'s "compiled" figure is not below the step's (a figure
  it printed as "lowest reachable" would be held to the compiled floor), and a budget at or above
  the stated floor is planned (with `case.budget == 0` the budget is the stated "at least" figure
  itself, so the statement is held to its word), and on a chip some plan fits it;
- (e) `over budget`, on a chip: the planned step compiles there (its temp bytes, arguments and
  outputs not aliased fit the chip): the chip refusing it is this failure too.

The budget lies between the floor (its exact figure, given to 3 decimals, plus the half unit
of rounding) and the plain temp. Exceptions end a case; the other failures are all collected.

With `case.chip` other than "none" the case runs on a simulated accelerator
(`tests/simulated_chip.py`), which refuses a compile larger than itself as XLA:TPU does
(`RESOURCE_EXHAUSTED`). The reference and the floor are computed off it and size it
(`chip.chip_bytes`: the floor plan fits, the step without remat does not). Planning, the planned
step's compile and run, and `explain` happen on it: "tight" plans at the drawn budget, "auto" at
`budget_mb="auto"`, whose fit (c) is to the plan's own `budget_bytes`. Rule 6's float64 runs
happen off it (float64 doubles the bytes), under the plan made on it (taken there: leaving the
chip clears smartremat's caches).

With `case.path == "decorator"` the model is wrapped by `smartremat.smartremat(budget_mb=...)`
and run in the plain `eqx.filter_jit` step: (a) and (b) are checked. The wrapper plans per input
signature, so float64 inputs would be planned anew: rule 6 records the plan of each of its calls
in float32 (`smartremat.explain` on the call's own arguments) and runs the float64 step with those.
It takes a number of MB only: no "auto" chip (`grammar.normalise` makes it "tight"). On a chip its
candidates meet the chip's refusals; (e) is not checked: its budget counts the module only, and a
plain `eqx.filter_jit` call compiles without `jax.stages.Lowered.compile`, which the chip holds.
"""

from __future__ import annotations

import contextlib
import re
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import smartremat
from smartremat import MB
from tests.fuzz.chip import chip_bytes, on_chip, total
from tests.fuzz.grammar import DTYPES, LR, Built, Case, build
from tests.helpers import MISMATCH_RTOL, tree_mismatches

#: The budget (MB) that is below every step's floor: planning at it states the floor.
TINY_MB = 1e-6

#: Rule 6's tolerance: the share of a leaf's scale by which the same plan run in float64 may
#: differ from the plain step run in float64 (about 4500 float64 ulps). Rounding of a sum
#: ordered otherwise is a few ulps of the leaf's scale, a few tens where terms cancel (float32
#: showed up to 33 ulps, 3.9e-6, on Adam's second moment: about 7e-15 in float64); a plan that
#: computed another function is off by far more (1e-4 and up).
RTOL64 = 1e-12

#: Failure classes: `grammar` (the plain step failed: a case the grammar should not build) and
#: `harness` (the checker itself raised) are the fuzzer's own; the others are the library's.
CLASSES = ("grammar", "harness", "exception", "unreachable", "over budget", "mismatch")


@dataclass
class Outcome:
    """What checking a case found: `failures` holds one `Failed` per invariant broken (empty:
    passed); each names its class (`CLASSES`) and, more finely, a key (for an exception its type
    and message with numbers masked)."""

    case: Case
    failures: list[Failed] = field(default_factory=list)
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    def fail(self, failure: Failed) -> None:
        self.failures.append(failure)

    def report(self) -> str:
        return "\n".join(f"[{f.kind}] {f.key}\n{f.detail}" for f in self.failures)


class Failed(Exception):
    """An invariant failed: `kind` is one of `CLASSES`."""

    def __init__(self, kind: str, key: str, detail: str):
        super().__init__(detail)
        self.kind, self.key, self.detail = kind, key, detail

    def __reduce__(self) -> tuple:  # pickled by `make fuzz JOBS=n`'s worker processes
        return Failed, (self.kind, self.key, self.detail)


def check_case(case: Case) -> Outcome:
    """Check `case`; never raises for a failure of the library (the `Outcome` says it)."""
    t0 = time.perf_counter()
    outcome = Outcome(case)
    try:
        with promotion(case), warnings.catch_warnings():
            # a donated input or target that no output can reuse: JAX's notice, not a failure
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            if case.path == "decorator" and case.chip != "none":  # its candidates stand in for the step:
                # a chip that holds only the step refuses them all (`_planner.UNCONFIRMED`), and (a)-(b) judge
                warnings.filterwarnings("ignore", message="smartremat: no remat plan for .* is confirmed by the compiler")
            _check(case, outcome)
    except Failed as f:
        outcome.fail(f)
    except Exception as e:  # a bug of the fuzzer itself, reported as such
        outcome.fail(Failed("harness", _key(e), _trace(e)))
    outcome.seconds = time.perf_counter() - t0
    return outcome


def assert_case(case: Case) -> Outcome:
    """`check_case`, raising `AssertionError` with the case and what failed (for tests, reproducers)."""
    outcome = check_case(case)
    assert outcome.ok, f"{case}\n{outcome.report()}"
    return outcome


@contextlib.contextmanager
def promotion(case: Case) -> Iterator[None]:
    """Standard dtype promotion for cases whose third-party code needs it (optax's Adam bias
    correction), set globally as `tests/conftest.py`'s fixture does; strict otherwise."""
    before = _set_promotion("standard" if case.step in ("adam", "adamw") else "strict")
    try:
        yield
    finally:
        _set_promotion(before)


def _set_promotion(value: str) -> str:
    """Set JAX's dtype promotion (globally); the setting it had."""
    before = getattr(jax.config, "jax_numpy_dtype_promotion")  # a flag attribute type checkers do not see
    jax.config.update("jax_numpy_dtype_promotion", value)
    return before


def _check(case: Case, outcome: Outcome) -> None:
    built, _, plain, expected = _reference(case)
    donate = "all" if case.donate else "none"
    floor_mb, floor_up = _floor(built, donate)
    budget = budget_of(case.budget, floor_mb, floor_up, plain.temp_size_in_bytes / MB)
    hbm = chip_bytes(case.chip, plain, floor_mb)
    auto = case.chip == "auto"
    outcome.figures.update(plain_mb=plain.temp_size_in_bytes / MB, floor_mb=floor_mb, budget_mb=None if auto
                           else budget, chip_mb=hbm and hbm / MB)
    if case.path == "decorator":
        _soft(outcome, lambda: _check_decorator(case, built, budget, expected, outcome.figures, hbm))
        return
    with on_chip(hbm) as chip:  # planning, the planned step's compile and run, and explain meet the chip
        planned, memory, plan = _planned(built, "auto" if auto else budget, donate)
        budget = plan.budget_bytes / MB if auto else budget  # "auto": the plan's own budget
        temp = memory.temp_size_in_bytes
        outcome.figures.update(budget_mb=budget, planned_mb=temp / MB)
        what = " (at the stated floor)" if case.budget == 0 and not auto else ""
        _soft(outcome, lambda: _check_fit(temp, budget, what))
        _soft(outcome, lambda: _check_chip(memory, hbm))
        actual = _guard(lambda: planned(*fresh(built.args)))
        entry = _guard(lambda: planned_entry(planned, built.args))  # the chip's plan: its caches go with it
    if chip is not None:
        outcome.figures["chip_refused"] = len(chip.refused)
    _soft(outcome, lambda: _compare(case, actual, expected, lambda: float64_answers(  # float64: off the chip
        built, lambda args: same_plan(built.step, args, *entry)), outcome.figures))
    _soft(outcome, lambda: _check_figures(plan, temp, floor_mb))


def _planned(built: Built, budget: float | Literal["auto"],
             donate: Literal["none", "all"]) -> tuple[Any, Any, smartremat.Plan]:
    """The planned step, its compiled `memory_analysis()` and its plan (`smartremat.explain`)."""
    planned = _guard(lambda: smartremat.filter_jit(built.step, budget_mb=budget, donate=donate))
    memory = _guard(lambda: planned.lower(*built.args).compile().memory_analysis())
    return planned, memory, _guard(lambda: smartremat.explain(planned, *built.args))


def _check_chip(memory: Any, hbm: int | None) -> None:
    """(e): the planned step fits the chip (temp, arguments and outputs not aliased)."""
    if hbm is not None and total(memory) > hbm:
        raise Failed("over budget", "the planned step does not fit the chip", f"temp + arguments + outputs "
                     f"- aliased: {total(memory)} bytes > chip {hbm} bytes (temp {memory.temp_size_in_bytes})")


def budget_of(frac: float, floor_mb: float, floor_up: float, plain_mb: float) -> float:
    """The budget `frac` of the way from the floor to the plain temp; at 0, the stated "at least"
    figure. The exact floor is given to 3 decimals: half a unit is added, so it is not below."""
    if frac == 0 or floor_up == 0:
        return floor_up if floor_up else plain_mb
    low = floor_mb + 0.0005
    return low + frac * max(plain_mb - low, 0.0)


def _soft(outcome: Outcome, check: Any) -> None:
    """Run an invariant check; its failure is recorded and the case goes on."""
    try:
        check()
    except Failed as f:
        outcome.fail(f)


def _reference(case: Case) -> tuple[Built, Any, Any, Any]:
    """The built case, the plain step, its compiled `memory_analysis()` and its outputs; a failure
    here is the fuzzer's own (`grammar`)."""
    try:
        built = build(case)
        plain: Any = eqx.filter_jit(built.step, donate="all" if case.donate else "none")
        compiled = plain.lower(*built.args).compile()  # run as compiled: the same program, one compile
        memory = compiled.compiled.memory_analysis()
        expected = compiled(*fresh(built.args))
    except Exception as e:  # the plain step must run: otherwise the grammar built something invalid
        raise Failed("grammar", _key(e), _trace(e)) from e
    return built, plain, memory, expected


def fresh(args: tuple) -> tuple:
    """Copies of the arrays in `args` (a donating step consumes its arguments)."""
    return jax.tree.map(lambda a: jnp.array(a, copy=True) if isinstance(a, jax.Array) else a, args)


def _floor(built: Built, donate: str) -> tuple[float, float]:
    """`(exact floor MB, floor MB rounded up)` stated by the error for a tiny budget; (0, 0) when a
    tiny budget plans."""
    step = smartremat.filter_jit(built.step, budget_mb=TINY_MB, donate=donate)
    try:
        step.lower(*built.args)
    except ValueError as e:
        exact = re.search(r"on these arguments: ([0-9.]+) MB", str(e))
        up = re.search(r"at least ([0-9.]+)", str(e))
        if not (exact and up):
            raise Failed("exception", _key(e), _trace(e)) from e
        return float(exact.group(1)), float(up.group(1))
    except Exception as e:
        raise Failed("exception", _key(e), _trace(e)) from e
    return 0.0, 0.0


def _guard(fun: Any) -> Any:
    """`fun()`; an exception is a failure: see `_failure`."""
    try:
        return fun()
    except Exception as e:
        raise _failure(e) from e


def _failure(e: Exception) -> Failed:
    """The failure an exception of the planned step is: (a), a documented `ValueError` included,
    but for (d)'s: a refusal stating a floor (every budget the fuzzer asks for is at least the
    stated floor) or no plan fitting the chip (it holds the floor plan); the chip refusing the
    planned step is (e)'s."""
    if isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e):
        return Failed("over budget", "the chip refused the planned step", _trace(e))
    if isinstance(e, ValueError) and "at least" in str(e):
        return Failed("unreachable", "a budget at or above the stated floor was refused", _trace(e))
    if isinstance(e, ValueError) and "does not fit the device's memory under any remat plan" in str(e):
        return Failed("unreachable", "the chip holds the floor plan, but no plan fits it", _trace(e))
    return Failed("exception", _key(e), _trace(e))


def _check_fit(temp: int, budget: float, what: str) -> None:
    if temp > budget * MB:
        raise Failed("over budget", f"compiled temp above the budget{what}",
                     f"compiled temp {temp / MB:.4f} MB > budget {budget:.4f} MB{what}")


def _compare(case: Case, actual: Any, expected: Any, answers64: Callable[[], tuple[Any, Any]],
             figures: dict | None = None) -> None:
    """(b); `answers64()` gives `(planned, plain)`: the same plan and the plain step run in float64,
    computed only where the float32 answers differ (rule 6). A difference rule 6 judges rounding
    goes to `figures["rule 6"]`: `(the float32 differences, (leaf, worst relative difference in
    float64))`."""
    actual, expected = _unwrap(actual), _unwrap(expected)
    found = _mismatches(case, actual, expected, MISMATCH_RTOL, DTYPES[case.dtype])
    if not found:
        return
    if any(_relative(m) == float("inf") for m in found):  # structure, dtype, integers, NaN: never rounding
        beyond = ["(not a float value: rule 6 does not apply)"]
    else:
        try:
            planned64, plain64 = answers64()
        except Exception as e:  # no float64 answers: the float32 difference stands
            beyond = [f"(no float64 answer: {_key(e)})"]
        else:
            planned64, plain64 = _unwrap(planned64), _unwrap(plain64)
            beyond = beyond_rounding(case, planned64, plain64)
            if not beyond and figures is not None:
                figures["rule 6"] = (found, worst_leaf(planned64, plain64))
    if beyond:  # not float32 rounding (rule 6)
        worst = max(_relative(m) for m in found)
        size = "by at most 1e-5" if worst <= 1e-5 else "by more than 1e-5"
        raise Failed("mismatch", f"outputs differ from the plain step's {size} of a leaf's scale",
                     "\n".join(found[:12] + ["beyond float32 rounding (rule 6: the same plan in float64 "
                                              "differs from the plain step in float64):"] + beyond[:12]))


def beyond_rounding(case: Case, planned64: Any, plain64: Any) -> list[str]:
    """Rule 6: how the same plan run in float64 differs from the plain step run in float64 (empty:
    the float32 difference is rounding). Every float leaf must be float64 there, and is held to
    `RTOL64` of its scale; in a case whose blocks compute in bfloat16 or float16, the float64
    answers still round in that dtype, so they are held to its ulps (rule 2's tolerance)."""
    if case.dtype != "f32":
        return _mismatches(case, planned64, plain64, MISMATCH_RTOL, DTYPES[case.dtype])
    flat = jax.tree_util.tree_flatten_with_path(plain64)[0]
    narrow = [f"{jax.tree_util.keystr(p)} is {x.dtype}" for p, x in flat
              if eqx.is_inexact_array_like(x) and np.dtype(x.dtype) != np.float64]
    if narrow:  # rounding left in the float64 run: it cannot judge at RTOL64
        return [f"(the float64 run computed in another dtype: {', '.join(narrow[:4])})"]
    # `tree_mismatches` takes `rtol` in float32 ulps and scales it by the leaf dtype's epsilon
    rtol = RTOL64 * float(jnp.finfo(jnp.float32).eps) / float(jnp.finfo(jnp.float64).eps)
    return _mismatches(case, planned64, plain64, rtol, None)


def worst_leaf(actual: Any, expected: Any) -> tuple[str, float]:
    """The float leaf where `actual` is furthest from `expected`, over its scale: `(path, share)`."""
    worst = ("(no float leaf)", 0.0)
    for (path, a), e in zip(jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected)):
        if eqx.is_inexact_array_like(a) and np.size(a):
            a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
            share = float(np.max(np.abs(a - e))) / max(float(np.max(np.abs(e))), 1e-300)
            if share > worst[1] or worst[0] == "(no float leaf)":
                worst = (jax.tree_util.keystr(path) or "(root)", share)
    return worst


def _mismatches(case: Case, actual: Any, expected: Any, rtol: float, compute: Any) -> list[str]:
    """`tree_mismatches` of the step's outputs at `rtol` (in float32 ulps, as it takes it)."""
    grads = _grads_like(case, actual, expected)
    if case.step in ("adam", "adamw"):  # new parameters: rule 5 (Adam's normalised step); the rest tightly
        found = tree_mismatches(actual[1], expected[1], grads=grads, rtol=rtol, compute_dtype=compute,
                                step_size=LR[case.step])
        rest = lambda out: out[:1] + out[2:]  # noqa: E731
        return [f"[1]{m}" for m in found] + tree_mismatches(  # nu squares the gradient: twice its ulps
            rest(actual), rest(expected), grads=grads, compute_dtype=compute, rtol=2 * rtol)
    return tree_mismatches(actual, expected, grads=grads, rtol=rtol, compute_dtype=compute)


def _unwrap(tree: Any) -> Any:
    """`tree` with each `smartremat.SmartRemat` replaced by the module it wraps."""
    return jax.tree.map(lambda x: x.module if isinstance(x, smartremat.SmartRemat) else x, tree,
                        is_leaf=lambda x: isinstance(x, smartremat.SmartRemat))


@contextlib.contextmanager
def float64() -> Iterator[None]:
    """float64 enabled, with standard promotion (the float64 run mixes float64 with the dtypes the
    model casts to)."""
    before = _set_promotion("standard")
    try:
        with jax.enable_x64(True):
            yield
    finally:
        _set_promotion(before)


def up(tree: Any) -> Any:
    """`tree` with its float32 arrays cast to float64 (lower-precision ones stay)."""
    return jax.tree.map(lambda a: a.astype(jnp.float64) if eqx.is_array(a) and a.dtype == jnp.float32 else a, tree)


def float64_answers(built: Built, planned: Callable[[tuple], Any]) -> tuple[Any, Any]:
    """`(planned(args), plain step(args))` with `args` the step's arguments cast up to float64: the
    exact answers up to float64 rounding (the grammar computes in float64 then, `grammar.working`)."""
    with float64():
        planned64 = jax.device_get(planned(up(fresh(built.args))))
        plain64 = jax.device_get(eqx.filter_jit(built.step)(*up(fresh(built.args))))
    return planned64, plain64


def same_plan(step: Callable, args: tuple, classes: frozenset, assignments: tuple) -> Any:
    """`step(*args)` run under a plan made for other arguments (float32 ones), not planned again:
    the k-th call of a module of `classes` under `assignments[k]` (a `smartremat.filter_jit` step's
    entry, `planned_entry`, or the decorator's plans, recorded: a `SmartRemat` runs the module it
    wraps under it, as in a planned step). Compiled as `smartremat.filter_jit` compiles a planned
    step, without donation (it changes no value).

    With `planned_entry`, the only use of smartremat's private API in the fuzzer (its modules may
    be reorganised: mend these two functions alone): `PlannedStep._entry` (the planned `Entry` of a
    signature, with its `classes` and `assignments`) and `smartremat._step`'s `bind`, `split_args`,
    `lower_step` and `compile_quietly`.
    """
    from smartremat._step import bind, compile_quietly, lower_step, split_args

    sig, dynamic = split_args(step, *bind(step, args, {}))
    lowered, box = lower_step(sig, (classes, assignments), "none")
    return eqx.combine(compile_quietly(lowered)(*dynamic), box.value)


def planned_entry(planned: Any, args: tuple) -> tuple[frozenset, tuple]:
    """`(classes, assignments)` of the plan `planned` (a `smartremat.filter_jit` step) runs for
    `args` (the entry cached for them, not a new plan), for `same_plan`."""
    with jax.enable_x64(False):  # the entry cached for the float32 arguments
        (entry, _, _), _ = planned._entry(args, {})
    return entry.classes, entry.assignments


def _relative(mismatch: str) -> float:
    """The worst difference of a `tree_mismatches` line over its leaf's scale (inf when it has none)."""
    m = re.search(r"x ([0-9.e+-]+) \(.*worst at [^:]*: ([0-9.e+-]+|nan|inf|-inf) vs ([0-9.e+-]+|nan|inf|-inf)", mismatch)
    if m is None:
        return float("inf")
    scale, a, b = (float(g) for g in m.groups())
    return abs(a - b) / scale if scale and abs(a - b) == abs(a - b) else float("inf")


def _grads_like(case: Case, actual: Any, expected: Any) -> tuple[Any, Any] | None:
    """Trees proportional to the two runs' gradients: the gradient, or the optimizer's first
    moment / momentum (one step from zero)."""
    def pick(out: Any) -> Any:
        if case.step == "grad":
            return out[0]
        if case.step in ("value_and_grad", "jax_grad", "tutorial"):
            return out[1]
        first = out[2][0]
        return first.trace if case.step == "sgd" else first.mu

    return pick(actual), pick(expected)


def _check_figures(plan: smartremat.Plan, temp: int, floor_mb: float) -> None:
    """(d): the printed "compiled" figure is not below the step's compiled temp. `explain` prints
    the lowest peak as the model's ("lowest X MB (the model's; the compiler decides fit)"), which
    claims nothing; were it printed as "lowest reachable" again, it is held to what the compiler
    reaches (the stated floor, given to 3 decimals, and that plan's own compiled temp)."""
    text = str(plan)
    claims = "lowest reachable" in text  # a figure printed as the model's alone claims nothing
    lowest = plan.min_peak_bytes / MB  # printed as "lowest reachable" (2 decimals)
    if claims and floor_mb > 0 and lowest + 0.0005 < floor_mb:
        raise Failed("unreachable", "explain's lowest reachable is below the compiled floor",
                     f"explain prints lowest reachable {lowest:.4f} MB; the compiled floor stated by the "
                     f"error is {floor_mb:.3f} MB (+{100 * (floor_mb / max(lowest, 1e-9) - 1):.0f}%)\n{text}")
    for predicted, compiled in plan.checked:  # the lowest plan, where the search compiled it
        if claims and predicted == plan.min_peak_bytes and compiled > predicted:
            raise Failed("unreachable", "explain's lowest reachable is below the compiled temp of that plan",
                         f"explain prints lowest reachable {predicted / MB:.4f} MB; that plan compiles to "
                         f"{compiled / MB:.4f} MB (+{100 * (compiled / max(predicted, 1) - 1):.0f}%)\n{text}")
    if plan.compiled_peak_bytes is not None and plan.compiled_peak_bytes < temp:
        raise Failed("unreachable", "explain's compiled figure is below the step's compiled temp",
                     f"explain: compiled {plan.compiled_peak_bytes / MB:.4f} MB; step: {temp / MB:.4f} MB\n{text}")


def _check_decorator(case: Case, built: Built, budget: float, expected: Any, figures: dict,
                     hbm: int | None = None) -> None:
    """The instance wrapper in a plain `eqx.filter_jit` step: runs (or refuses with the
    documented error) and gives the plain answer. With a chip (`hbm`), the wrapper plans (its
    candidates meet the chip's refusals) and the step runs there, and the plan of each call is
    recorded there (the chip's caches go with it); rule 6 runs off the chip."""
    wrap = smartremat.smartremat(budget_mb=budget)
    with on_chip(hbm) as chip:
        actual = _run_decorated(case, built, wrap)
        plans = None if actual is None or chip is None else _recorded(built, wrap)
    if chip is not None:
        figures["chip_refused"] = len(chip.refused)
    if actual is None:  # the documented refusal
        return
    _compare(case, actual, expected, lambda: float64_answers(built, lambda args: same_plan(
        built.step, _with_model(built, wrap(args[0]), args), frozenset([smartremat.SmartRemat]),
        _recorded(built, wrap) if plans is None else plans)), figures)


def _run_decorated(case: Case, built: Built, wrap: Callable) -> Any:
    """The step's outputs with the model wrapped by `wrap`; `None` where it refuses the budget
    with the documented error (the decorator's budget counts the module only)."""
    args = fresh(built.args)  # the model's arrays too: a donating step consumes them
    args = _with_model(built, wrap(args[0]), args)
    try:
        return eqx.filter_jit(built.step, donate="all" if case.donate else "none")(*args)
    except ValueError as e:
        if "at least" in str(e):
            return None
        raise _failure(e) from e
    except Exception as e:
        raise _failure(e) from e


def _recorded(built: Built, wrap: Callable) -> tuple:
    """The plan of each call of the wrapper, as it runs on the step's (float32) arguments: traced
    with float64 off, also when rule 6 asks from within its float64 run (there the grammar computes
    in float64, and a BatchNorm's float32 state would refuse its float64 update: fuzz seed
    20261208, case 36)."""
    plans = _Plans()
    with jax.enable_x64(False):
        eqx.filter_eval_shape(built.step, *_with_model(built, _Recording(wrap(built.model), plans), built.args))
    return tuple(plans.assignments)


def _with_model(built: Built, model: Any, args: tuple) -> tuple:
    """The step's arguments `args` with `model` as the model, and (as a user would) the optimizer
    state of `model`."""
    values = dict(zip(built.names, (model,) + tuple(args[1:])))
    if built.opt is not None:
        values["opt_state"] = built.opt.init(eqx.filter(model, eqx.is_array))
    return tuple(values.values())


class _Plans:
    """The assignments `_Recording` saw, in call order."""

    def __init__(self) -> None:
        self.assignments: list = []


class _Recording(eqx.Module):
    """A `smartremat.smartremat(...)` wrapper that records the plan of each of its calls: the one
    it runs, `smartremat.explain` on the call's own arguments (the same cached plan)."""

    wrapped: smartremat.SmartRemat
    plans: _Plans = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.plans.assignments.append(smartremat.explain(self.wrapped, *args, **kwargs).assignment)
        return self.wrapped(*args, **kwargs)


def _key(e: BaseException) -> str:
    """The exception's type and first line, numbers and addresses masked: one key per failure class."""
    line = next((s for s in str(e).splitlines() if s.strip()), "")
    line = re.sub(r"0x[0-9a-f]+", "0x…", line)
    line = re.sub(r"\d+(\.\d+)?", "N", line)
    return f"{type(e).__name__}: {line[:160]}"


def _trace(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
