"""The one planning pipeline, for a decorated module and a whole training step alike:
discover -> profile -> model (`Target.model`: `_discover`, `_profile`, `_model`) -> refine
(`Target.refined`: `_model.after_stage`) -> solve (`_solve`) -> verify (`verified`: `_search`,
`_tune`) -> assemble (`assemble`: the `Plan`).

A `Target` is what differs between the two paths: what is compiled as "the step" (the module's
call under the losses, `_module_plan`; the user's whole step, `_step_plan`) and how a failure to
fit is worded. `planned` adds the caches: one plan per target key in this process, and the disk.
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from collections.abc import Callable
from typing import NamedTuple, Protocol

import jax

from . import _disk
from ._cache import KeyedCache
from ._key import PlanKey
from ._env import CPU_NOTE, MB, cpu_barrier_missing
from ._jax_private import carrying_config
from ._memory import cost_of, objective_of, peak_at, peak_of
from ._model import (Config, MemoryModel, assignment_of, choices_of, described, every_option, full_remat, stage_figures,
                     uniform, unplanned, working_sets_matter)
from ._paths import path_str
from ._plan import Plan, PlanBlock, PolicyFigures
from ._refused import Refused, over_budget
from ._search import UNBUILT, CandidateFigures, Estimates, Outcome, candidates, checked_pair, search
from ._solve import Solution, frontier, min_peak, solve
from ._share import shared, timing_together
from ._tune import Timed, pool, timings, tuned

logger = logging.getLogger("smartremat")

#: The FLOPs recorded for a candidate the compiler refused: it wins no comparison, and the search
#: leaves it out of its compiled/predicted ratios (`_search._ratios`).
REFUSED_FLOPS = float("inf")

Runs = tuple  #: what runs: one assignment per module call (`((path, option), ...)` each)


class Target(Protocol):
    """What one planning compiles as "the step", and how it words what it finds."""

    @property
    def name(self) -> str: ...  # what progress and the log call it
    def key(self) -> PlanKey: ...
    def model(self, config: Config, progress: Callable[[str], None], scans: bool = True) -> MemoryModel: ...
    def refined(self, model: MemoryModel, config: Config) -> tuple[MemoryModel, Config]: ...
    def runs(self, model: MemoryModel, choice: tuple[int, ...]) -> Runs: ...
    def measure(self, runs: Runs, config: Config, every_loss: bool) -> tuple[int, float]: ...
    def losses(self, config: Config) -> int: ...
    def timed(self, runs: Runs, config: Config) -> Timed: ...
    def too_low(self, config: Config, model: MemoryModel, floor: int, compiled: bool) -> Exception: ...
    def notes(self, model: MemoryModel) -> tuple[str, ...]: ...
    @property
    def stands_in(self) -> bool: ...  # its programs stand in for a step the user compiles (the decorator's)
    @property
    def refines_scans(self) -> bool: ...  # `refined` may raise a scan's last iteration (the step's)


class Planned(NamedTuple):
    """A plan and what runs: one assignment per module call of the step."""

    plan: Plan
    runs: Runs


_PLANS: KeyedCache[Planned] = KeyedCache()


def planned(target: Target, config: Config) -> Planned:
    """The plan of `target` under `config`: made once per key in this process, read from the disk
    cache (`_disk`) where it holds one, else made and stored there; in a `jax.distributed` job,
    by process 0 only, and shared with the others (`_share`)."""
    key = target.key()
    time_runs = lambda candidates: _timings(target, config, candidates)  # noqa: E731
    made = lambda: shared(key, config.policies, lambda: _stored_or_made(target, key, config), time_runs)  # noqa: E731
    return _PLANS.get((key.memory, config), lambda: Planned(*made()))


def _stored_or_made(target: Target, key: PlanKey, config: Config) -> Planned:
    t0 = time.perf_counter()
    text = key.text(config) if _disk.folder() is not None else None  # its text traces: not when off
    stored = _disk.load(text)
    if stored is not None:
        plan = _disk.loaded(stored[0], time.perf_counter() - t0)
        _log(target.name, plan)
        return Planned(plan, stored[1])
    made = make_plan(target, config)
    untimed = config.tune and not made.plan.timed  # `tune=True` could not time it (`_fastest`): not stored
    unconfirmed = config.verify and made.plan.compiled_peak_bytes is None  # the device refused every candidate
    _disk.store(None if untimed or unconfirmed else text, made.plan, made.runs)
    return made


def make_plan(target: Target, config: Config) -> Planned:
    """discover, profile, model, refine, solve, verify, assemble: the plan for `target`."""
    t0 = time.perf_counter()
    progress = progress_log(target.name, t0)
    model, config = refined_model(target, config, progress)
    lowest = min_peak(model.stages)
    sol = solve(model.stages, config.budget_bytes - model.fixed_bytes)
    outcome = None
    if config.verify:
        sol, outcome = verified(model, config, target, sol or lowest, lowest, progress)
    elif sol is None:
        raise target.too_low(config, model, lowest.peak + model.fixed_bytes, compiled=False)
    plan = assemble(model, config, sol, lowest, outcome, time.perf_counter() - t0, target)
    if cpu_barrier_missing():
        warnings.warn("smartremat: " + CPU_NOTE + ".", stacklevel=2)
    _log(target.name, plan)
    return Planned(plan, target.runs(model, sol.choice))


def refined_model(target: Target, config: Config, progress: Callable[[str], None]) -> tuple[MemoryModel, Config]:
    """model -> refine: the target's model, refined (`Target.refined`). A scan's body is first
    modelled from its jaxpr where the target's refinement may raise it, and calibrated by the
    compiler (then the model refined again: its programs are cached) only where its working set
    could set a predicted peak (`_model.working_sets_matter`)."""
    raw = target.model(config, progress, scans=not target.refines_scans)
    model, refined = target.refined(raw, config)
    if config.calibrate and target.refines_scans and working_sets_matter(raw, model):
        progress("calibrating the scanned blocks' bodies")
        model, refined = target.refined(target.model(config, progress, scans=True), config)
    return model, refined


_QUIET_SECONDS = 2.0


def progress_log(name: str, t0: float) -> Callable[[str], None]:
    """Say what planning `name` is doing on the `smartremat` logger (INFO), once it has taken
    more than `_QUIET_SECONDS`; quicker plans stay quiet."""

    def say(what: str) -> None:
        elapsed = time.perf_counter() - t0
        if elapsed >= _QUIET_SECONDS:
            logger.info("smartremat planning %s, %.1f s: %s", name, elapsed, what)

    return say


_MAX_FRONTIER_STAGES = 64


def verified(model: MemoryModel, config: Config, target: Target, sol: Solution, lowest: Solution,
             progress: Callable[[str], None] = logger.debug) -> tuple[Solution, Outcome]:
    """The cheapest candidate whose compiled temp bytes fit the budget (within `_search.TIE_MARGIN`,
    the one of fewest temp bytes), found by `_search.search`
    with few whole-step compiles.

    Candidates are the model's Pareto frontier (`_search.candidates`: points spread evenly, and
    more near the budget;
    above `_MAX_FRONTIER_STAGES` stages, where enumerating it is too slow, only the lowest-peak
    choice `lowest` and the model's choice `sol`) and the uniform plans the model does not rule
    out (`_search`); where none of them fits, the programs the model was refined on
    (`MemoryModel.refined_on`: the device compiled one, which the refined model may rule out), and
    where none of those fits, each option on every block that has it (`_model.every_option`: the
    model may rule out a plan the compiler takes lower).
    "Cheapest" is the fewest compiled FLOPs, or the model's FLOPs when a block is scanned (XLA's cost analysis counts a loop body once, docs/facts.md fact 7), plus on an
    accelerator the model's charge for the bytes the plan keeps (`_objective`, fact 22).

    With `tune=True`, the fitting candidates of `_tune.pool` are timed by it, and the
    one of the lowest median time replaces that choice (`_fastest`, `_tune.tuned`).

    Where the device refuses every candidate of a target whose programs stand in for the user's
    step (the decorator's: `Target.stands_in`), `_unconfirmed`.
    """
    refused: list[Refused] = []  # what the device refused, candidate by candidate
    measure, confirm, time_of = _measures(model, config, target, refused)
    stages = model.stages
    front = frontier(stages) if len(stages) <= _MAX_FRONTIER_STAGES else sorted({lowest, sol}, key=lambda s: s.peak)
    points = [p.choice for p in candidates(front, lambda p: p.peak + model.fixed_bytes, config.budget_bytes)]
    looped = any(st.run is not None for st in stages)

    def rank(choice: tuple[int, ...], flops: float) -> float:  # the compiled FLOPs, charged for kept bytes
        return objective_of(stages, choice) + (0 if looped else flops - cost_of(stages, choice))

    def peak(choice: tuple[int, ...]) -> float:
        return peak_of(stages, choice) + model.fixed_bytes

    def objective(choice: tuple[int, ...]) -> float:
        return objective_of(stages, choice)

    uniforms = list(dict.fromkeys(uniform(model, p) for p in config.policies))

    def error(floor: float) -> Exception:
        if not math.isfinite(floor):  # nothing compiled: every candidate refused (or not built)
            e = no_plan_fits(target.name, refused)
            return _Unconfirmed(e) if target.stands_in and refused else e
        e = target.too_low(config, model, int(floor), compiled=True)
        return ValueError(f"{e}{REFUSED_NOTE.format(n=len(refused))}") if refused and isinstance(e, ValueError) else e

    built: list[tuple[int, ...]] = []  # the candidates compiled (or refused), not those that could not be built

    def measure_built(choice: tuple[int, ...]) -> tuple[int, float]:
        figures = measure(choice)  # raises `Unbuildable` for a candidate that cannot be built
        built.append(choice)
        got = (f"compiled {figures[0] / MB:.1f} MB, {figures[1] / 1e9:.1f} GFLOP" if math.isfinite(figures[1])
               else f"refused ({figures[0] / MB:.1f} MB)")
        progress(f"candidate {described(model, choice)}: predicted {peak(choice) / MB:.1f} MB, {got}")
        return figures

    try:
        estimates = Estimates(peak, objective, step_flops(model))
        out = search(points, uniforms, estimates, config.budget_bytes, measure_built, rank,
                     error, progress, confirm, fallback=(model.refined_on, every_option(model)))
    except _Unconfirmed:
        return _unconfirmed(model, config, target, lowest, tuple(dict.fromkeys(built)), refused)
    if config.tune:
        out = _fastest(out, points, uniforms, config, measure, confirm, time_of, peak, progress)
    return Solution(out.choice, peak_of(stages, out.choice), objective_of(stages, out.choice)), out


def step_flops(model: MemoryModel) -> float:
    """A lower estimate of the FLOPs of a step through the model's blocks, besides what a plan
    recomputes: each block call's forward, and its backward at twice that."""
    return 3.0 * sum(model.profiles[c].forward.flops for c in model.owner)


class _Unconfirmed(Exception):
    """Every candidate of a target that stands in for the user's step was refused by the device."""


def _unconfirmed(model: MemoryModel, config: Config, target: Target, lowest: Solution,
                 built: tuple[tuple[int, ...], ...], refused: list[Refused]) -> tuple[Solution, Outcome]:
    """The plan where the device refused every candidate `built` of a target that stands in for
    the user's step: the model's lowest plan (the lowest-peak one built, where it could not be),
    unconfirmed, with a warning; the infeasible budget's error where the model puts that plan
    above the budget."""
    stages = model.stages
    choice = lowest.choice if lowest.choice in built or not built else min(built, key=lambda c: peak_of(stages, c))
    peak = peak_of(stages, choice) + model.fixed_bytes
    if peak > config.budget_bytes:
        raise target.too_low(config, model, peak, compiled=False)
    untimed = " With `tune=True`, nothing was timed: no candidate compiled." if config.tune else ""
    warnings.warn(UNCONFIRMED.format(name=target.name, refused=_refusals(refused)) + untimed, stacklevel=2)
    solution = Solution(choice, peak_of(stages, choice), objective_of(stages, choice))
    return solution, Outcome(choice, None, built, checked=(None,) * len(built))


#: Warned where the device refused every candidate of the decorator: the plan is the model's lowest.
UNCONFIRMED = ("smartremat: no remat plan for {name} is confirmed by the compiler: the device refused its "
               "gradient under every plan tried ({refused}). These programs are "
               "the module's gradient under its losses, with their own arguments and outputs: they stand in for "
               "the step that calls the module, which the device may still hold. The plan is the model's plan of "
               "lowest peak (unconfirmed). If that step does not fit, lower the batch size or shard it, or plan the whole "
               "step with `smartremat.filter_jit`, whose candidates are the step itself.")


#: Said after an infeasible budget's error when the device refused candidates for memory.
REFUSED_NOTE = (" Besides, {n} candidate plan(s) did not fit the device's memory (its compiler refused them, or "
                "they compiled to more than it holds): no budget makes those run.")


def no_plan_fits(name: str, refused: list[Refused]) -> ValueError:
    """Every candidate compiled was refused by the device: no budget helps; what each needed."""
    first = refused[0].message if refused else "no candidate could be built"
    return ValueError(
        f"smartremat: the step of {name} does not fit the device's memory under any remat plan tried: "
        f"{_refusals(refused)}; the compiler said: "
        f"{first} No budget changes that: lower the batch size, shard the batch or the parameters over more "
        "devices, or keep the optimizer state off the device.")


def _refusals(refused: list[Refused]) -> str:
    """How many candidates the device refused, and the least bytes a refusal named."""
    needs = sorted({r.needed for r in refused if r.needed})
    least = f" (the least any needed: {needs[0] / MB:.{1 if needs[0] >= MB else 4}f} MB)" if needs else ""
    return f"{len(refused)} candidate plan(s), full remat among them, did not fit it{least}"


def _measures(model: MemoryModel, config: Config, target: Target,
              refused: list | None = None) -> tuple[Callable, Callable | None, Callable]:
    """`(measure, confirm, time_of)` of candidate choices on the target's step: compiled under its
    first loss, under all of them (`None` where it has one), timed (`_tune.timings`). A candidate
    the device's compiler refuses for memory is over budget: its figures are the bytes the refusal
    names (above the budget whatever it names) and `REFUSED_FLOPS`."""
    def measured(choice: tuple[int, ...], every_loss: bool) -> tuple[int, float]:
        try:
            return target.measure(target.runs(model, choice), config, every_loss)
        except Refused as e:  # the device's compiler refused it for memory: it does not fit
            logger.debug("smartremat: candidate %s refused by the compiler (%s)", choice, e.message)
            if refused is not None:
                refused.append(e)
            return over_budget(e, config.budget_bytes), REFUSED_FLOPS

    measure = lambda choice: measured(choice, False)  # noqa: E731
    confirm = lambda choice: measured(choice, True)  # noqa: E731

    def time_of(choices: list) -> list[tuple[float, ...]]:
        runs = [target.runs(model, c) for c in choices]
        timing_together(runs)  # the job's other processes run them with this one
        return _timings(target, config, runs)

    # `_search` compiles candidates in worker threads: they lower under this thread's JAX configuration
    return carrying_config(measure), confirm if target.losses(config) > 1 else None, time_of


def _timings(target: Target, config: Config, candidates: list[Runs]) -> list[tuple[float, ...]]:
    """`_tune.timings` of the target's step under each of `candidates` (what runs)."""
    return timings([target.timed(r, config) for r in candidates])


#: The warning when `tune=True` cannot run its candidates.
TUNE_FAILED = ("smartremat: `tune=True` could not time its candidate plans ({error}); the plan the "
               "search chose (by its objective, untimed) is used, and not stored in the disk cache, so the next "
               "process tries again. Timing holds a second copy of the step's inputs on the device: free memory "
               "for it, or pass `tune=False` to plan without timing.")


def _fastest(out: Outcome, points: list, uniforms: list, config: Config, measure: Callable,
             confirm: Callable | None, time_of: Callable, peak: Callable, progress: Callable[[str], None]) -> Outcome:
    """`tune=True`: the search's outcome with its choice replaced by the fastest fitting candidate
    (`_tune.tuned`), the candidates it compiled and timed added. Where running them fails (out of
    device memory: timing holds a second copy of the inputs), a warning says so and the search's
    outcome stays, with no times (`Plan.timed` empty: such a plan is not stored on disk)."""
    compiled = CandidateFigures(measure, progress, confirm)
    try:
        choice, timed = tuned(out, pool(points, uniforms, out.choice), config.budget_bytes, compiled, time_of,
                              progress)
    except (jax.errors.JaxRuntimeError, Refused) as e:
        warnings.warn(TUNE_FAILED.format(error=str(e).splitlines()[0] if str(e) else type(e).__name__),
                      stacklevel=2)
        return out
    checked = dict(zip(out.measured, out.checked))
    for c, figures in compiled.figures.items():
        if figures != UNBUILT:  # counted in `skipped`, not as refused
            checked.setdefault(c, checked_pair(peak(c), figures))
    return Outcome(choice, compiled.figures[choice], tuple(checked),
                   tuple(dict.fromkeys([*out.confirmed, *compiled.confirmed])),  # each once: the choice is in both
                   tuple(checked.values()), timed, out.skipped + compiled.skipped)


def _blocks(model: MemoryModel, config: Config, choice: tuple[int, ...]) -> tuple[PlanBlock, ...]:
    """One row per distinct block; a scan split into pieces gives one row per piece."""
    chosen = choices_of(model, choice)
    counts: dict = {}
    first: dict = {}
    for c, prof in zip(model.calls, model.profiles):
        counts[c.path] = counts.get(c.path, 0) + (c.scan.length if c.scan else 1)
        first.setdefault(c.path, (c, prof))
    out = []
    for path, (c, prof) in first.items():
        rows = chosen[path].rows(path_str(path))
        used = {q for _, _, q in rows}
        shown = [o for o in prof.options if o.option in config.policies or used & {o.option, *o.merged}]
        saved, peak, cost = stage_figures(shown, scanned=c.scan is not None)
        figures = tuple(PolicyFigures(o.name, s, pk, f, tuple(m.name for m in o.merged))
                        for o, s, pk, f in zip(shown, saved, peak, cost))
        out += [PlanBlock(label, c.type_name, counts[path] if n is None else n, q.name, figures)
                for label, n, q in rows]
    return tuple(out)


def assemble(model: MemoryModel, config: Config, sol: Solution, lowest: Solution,
             outcome: Outcome | None, seconds: float, target: Target) -> Plan:
    """The `Plan` of choice `sol`; its compile count is the search's: each candidate under the
    first loss, the confirmed ones under the others too."""
    stages, fixed = model.stages, model.fixed_bytes
    compiled = None if outcome is None else outcome.compiled
    return Plan(
        budget_bytes=config.budget_bytes,
        predicted_peak_bytes=sol.peak + fixed,
        no_remat_peak_bytes=peak_of(stages, (0,) * len(stages)) + fixed,
        full_remat_peak_bytes=peak_of(stages, uniform(model, full_remat(config.policies))) + fixed,
        min_peak_bytes=lowest.peak + fixed,
        recompute_flops=cost_of(stages, sol.choice),
        forward_flops=sum(p.forward.flops * (c.scan.length if c.scan else 1)
                          for c, p in zip(model.calls, model.profiles)),
        blocks=_blocks(model, config, sol.choice),
        compiled_peak_bytes=None if compiled is None else int(compiled[0]),
        compiled_flops=None if compiled is None else float(compiled[1]),
        fixed_bytes=fixed,
        planning_seconds=seconds,
        compiles=0 if outcome is None else len(outcome.measured) + len(outcome.confirmed) * (target.losses(config) - 1),
        checked=() if outcome is None else tuple(pair for pair in outcome.checked if pair is not None),
        timed=() if outcome is None else outcome.timed,
        backend=jax.default_backend(),
        notes=tuple(_notes(model, sol)) + _skipped_note(outcome) + _refused_note(outcome) + unplanned(model)
        + target.notes(model),
        assignment=assignment_of(model, sol.choice),
        stages=stages,
        menu=tuple(p.name for p in config.policies),
        signature=target.key().signature,
    )


def _skipped_note(outcome: Outcome | None) -> tuple[str, ...]:
    if outcome is None or not outcome.skipped:
        return ()
    return (f"{outcome.skipped} candidate plan(s) could not be built (a scan split into pieces whose "
            "operands differ between policies) and were skipped",)


def _refused_note(outcome: Outcome | None) -> tuple[str, ...]:
    """The plan's note counting the candidates the device refused (left out of `Plan.checked`)."""
    refused = 0 if outcome is None else sum(pair is None for pair in outcome.checked)
    if not refused:
        return ()
    unconfirmed = ("; none fitted, so this is the model's lowest plan, unconfirmed (the module's gradient under its "
                   "losses stands in for the step that calls it, which the device may hold)"
                   if outcome is not None and outcome.compiled is None else "")
    return (f"{refused} candidate plan(s) did not fit the device's memory (its compiler refused them, or they "
            f"compiled to more than it holds){unconfirmed}",)


def _notes(model: MemoryModel, sol: Solution) -> list[str]:
    notes = [CPU_NOTE] if cpu_barrier_missing() else []
    shown = set()
    for c, prof in zip(model.calls, model.profiles):
        for option, why in prof.skipped:
            if (c.path, option) not in shown:
                shown.add((c.path, option))
                notes.append(f"{path_str(c.path)} ({c.type_name}): {option} left out for this block, "
                             f"which failed under it ({why})")
    _, at, prior = peak_at(model.stages, sol.choice)
    earlier = (f"{prior / MB:.2f} MB kept by earlier blocks are alive" if prior >= 0 else
               f"earlier blocks' gradient buffers hold {-prior / MB:.2f} MB more of later blocks' activations "
               "than those blocks keep")
    notes.append(f"the peak is reached in the backward of {path_str(model.calls[model.owner[at]].path)} "
                 f"({model.calls[model.owner[at]].type_name}), while {earlier}")
    return notes


def _log(name: str, plan: Plan) -> None:
    """INFO on the `smartremat` logger; with SMARTREMAT_LOG=1 printed even without logging set up.
    The table is rendered only when someone will read it."""
    printed = os.environ.get("SMARTREMAT_LOG", "") not in ("", "0")
    if not (printed or logger.isEnabledFor(logging.INFO)):
        return
    message = f"smartremat planned {name}:\n{plan}"
    if printed and not logger.isEnabledFor(logging.INFO):
        print(message, flush=True)
    logger.info(message)


