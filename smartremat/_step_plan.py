"""Plan a whole training step: join the models of its module calls, hold candidates against the
compiled step, and say what went wrong in terms of the step (`smartremat.filter_jit`'s planner)."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from . import _disk, _planner
from ._plan import MB, Plan
from ._solve import min_peak, solve
from ._spec import planning_step, shardings_hidden
from ._step import Signature, StepFigures, compile_quietly, lower_step, record, root_classes, step_figures, step_key, step_name
from ._tune import Timed, timings


@dataclass(frozen=True)
class StepOptions:
    """`filter_jit`'s own options: an automatic budget, and which arguments are donated."""

    auto: bool = False
    donate: str = "none"


def joined_model(models: list[_planner.MemoryModel], labels: list[str]) -> _planner.MemoryModel:
    """The models of several module calls as one, in call order; paths start with the label of
    the argument each module came from (no prefix for a single call)."""
    if len(models) == 1:
        return models[0]
    calls, profiles, stages, owner, menus, fixed = [], [], [], [], [], 0
    for model, label in zip(models, labels):
        offset = 1 + max((st.group for st in stages), default=-1)
        run_offset = 1 + max((st.run for st in stages if st.run is not None), default=-1)
        owner += [o + len(calls) for o in model.owner]
        calls += [dataclasses.replace(c, path=(("attr", label),) + c.path) for c in model.calls]
        stages += [dataclasses.replace(st, group=st.group + offset,
                                       run=None if st.run is None else st.run + run_offset) for st in model.stages]
        profiles += model.profiles
        menus += model.menus
        fixed += model.fixed_bytes
    return _planner.MemoryModel(tuple(calls), tuple(profiles), tuple(stages), fixed, tuple(owner), tuple(menus))


def split_assignment(model: _planner.MemoryModel, choice: tuple[int, ...], labels: list[str]) -> tuple:
    """One assignment per module call (paths relative to that module)."""
    assignment = _planner.assignment_of(model, choice)
    if len(labels) == 1:
        return (assignment,)
    return tuple(tuple((path[1:], pol) for path, pol in assignment if path[0] == ("attr", label))
                 for label in labels)


def _device_limit(sig: Signature) -> int | None:
    """`bytes_limit` of the device the step's first argument lives on (None if not reported)."""
    sharding = next((a.sharding for a in sig.avals if getattr(a, "sharding", None) is not None), None)
    device = min(sharding.device_set, key=lambda d: d.id) if sharding is not None else jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return (stats or {}).get("bytes_limit")


#: Share of the device's memory left to the allocator's fragmentation under `budget_mb="auto"`.
AUTO_RESERVE = 0.05


def auto_budget(sig: Signature, base: StepFigures, name: str) -> int:
    """The device's memory minus the step's arguments, outputs (not aliased), code and a reserve."""
    limit = _device_limit(sig)
    if not limit:
        raise ValueError(
            f"`{name}(budget_mb=\"auto\")` needs the device's memory limit, and the "
            f"{jax.default_backend()} backend reports none (`device.memory_stats()` has no "
            "\"bytes_limit\"). Give the budget as a number of megabytes instead, e.g. `budget_mb=4096`.")
    budget = int(limit * (1 - AUTO_RESERVE)) - base.arguments - base.outputs + base.alias - base.code
    if budget <= 0:
        raise ValueError(
            f"`{name}(budget_mb=\"auto\")`: the step's arguments and outputs alone take "
            f"{(base.arguments + base.outputs - base.alias) / MB:.1f} MB of the device's {limit / MB:.1f} MB, "
            "leaving nothing for activations. Shard or shrink the arguments (parameters, optimizer state, batch).")
    return budget


@dataclass(frozen=True)
class Entry:
    """One planned signature: the plan, the assignment per module call, the classes to watch."""

    plan: Plan
    assignments: tuple
    classes: frozenset
    sig: Signature


def plan_step(fun: Callable, sig: Signature, roots: list[tuple[str, Any]], config: _planner.Config,
              options: StepOptions) -> Entry:
    """The step's plan from the disk cache (`_disk`) if it holds one for this key, else a new
    plan, stored there."""
    with planning_step():
        return _stored_or_planned(fun, sig, roots, config, options)


def _stored_or_planned(fun: Callable, sig: Signature, roots: list[tuple[str, Any]], config: _planner.Config,
                       options: StepOptions) -> Entry:
    t0 = time.perf_counter()
    calls, jaxpr = record(sig, roots)
    if not calls:
        raise ValueError(_no_module_call(fun, roots, "smartremat.filter_jit"))
    limit = _device_limit(sig) if options.auto else None  # an automatic budget depends on it
    text = _disk.step_key(sig, jaxpr, config, (options, limit, AUTO_RESERVE))
    stored = _disk.load(text)
    if stored is not None:
        plan, assignments = stored
        return Entry(_disk.loaded(plan, time.perf_counter() - t0), assignments,
                     root_classes(roots), sig)
    entry = _plan_step(fun, sig, roots, calls, config, options)
    _disk.store(text if not _planner.untimed(config, entry.plan) else None, entry.plan, entry.assignments)
    return entry


def _plan_step(fun: Callable, sig: Signature, roots: list[tuple[str, Any]], calls: list,
               config: _planner.Config, options: StepOptions) -> Entry:
    """Record the module calls, build and join their models, verify candidates on the step."""
    t0 = time.perf_counter()
    labels = [c.label for c in calls]
    progress = _planner.progress_log(step_name(fun), t0)
    model = joined_model([_planner.build_model(c.call, c.spec, c.spec.rebuild(c.spec.dynamic)[0], config, progress)
                          for c in calls], labels)
    classes = root_classes(roots)
    stages = model.stages

    name = "smartremat.filter_jit"

    def measure(choice: tuple[int, ...]) -> tuple[int, float]:
        f = step_figures(sig, (classes, split_assignment(model, choice, labels)), options.donate)
        return f.temp, f.flops

    none = (0,) * len(stages)
    base = step_figures(sig, (classes, split_assignment(model, none, labels)), options.donate)
    if options.auto:
        budget = auto_budget(sig, base, name)
        config = dataclasses.replace(config, budget_bytes=budget, budget_mb=budget / MB)
    model = with_tail(model, base.temp)
    stages = model.stages
    lowest = min_peak(stages)
    sol = solve(stages, config.budget_bytes - model.fixed_bytes) or lowest

    def time_of(choices: list) -> list[tuple[float, ...]]:
        return timings([_timed_entry(fun, sig, (classes, split_assignment(model, c, labels)), options.donate)
                        for c in choices])

    reasons = _planner.unplanned(model)
    sol, outcome = _planner.verified(model, config, measure,
                                     lambda floor: _too_low(fun, config, floor, name, options.auto,
                                                            reasons + _no_saving(floor, base.temp)),
                                     sol, lowest, progress, time_of=time_of if config.tune else None)
    plan = _planner.assemble(model, config, sol, lowest, outcome, time.perf_counter() - t0,
                             _signature(fun, sig))
    if any(shardings_hidden(c.spec) for c in calls) and any(_sharded(a) for a in sig.avals):
        plan = dataclasses.replace(plan, notes=plan.notes + (HIDDEN_NOTE,))
    return Entry(plan, split_assignment(model, sol.choice, labels), classes, sig)


def _timed_entry(fun: Callable, sig: Signature, entry_of: tuple, donate: str) -> Timed:
    """The whole step under `entry_of`, as `_tune.timings` times it: lowered and compiled as it
    runs, its donated arguments consumed by each call."""
    build = lambda: compile_quietly(lower_step(sig, entry_of, donate)[0])  # noqa: E731
    return Timed(step_key(sig, entry_of, donate), build, sig.avals, sig.donated(donate))


def with_tail(model: _planner.MemoryModel, temp: int) -> _planner.MemoryModel:
    """`model` calibrated on the compiled step without remat (`temp` bytes): the rest of the step
    (what follows the last block, the loss, the update) is a tail whose backward runs first,
    while every block's kept bytes are alive, not a constant beside every block (docs/facts.md,
    fact 16). The tail is what the step takes beyond the glue's residuals and every block's kept
    bytes without remat; under each option, the last stage's own peak is raised to at least its
    kept bytes plus the tail, so the step without remat is predicted at its compiled bytes (or
    above, where the blocks' own peaks are higher: the glue's residuals are then on top)."""
    stages = model.stages
    if not stages:  # every call a scan of length 0: the whole step is the rest
        return dataclasses.replace(model, fixed_bytes=max(temp, 0))
    tail = temp - model.fixed_bytes - sum(st.saved[0] for st in stages)
    last = stages[-1]
    peak = tuple(max(p, s + tail) for p, s in zip(last.peak, last.saved))
    return dataclasses.replace(model, stages=stages[:-1] + (dataclasses.replace(last, peak=peak),))


HIDDEN_NOTE = (
    "the step's arguments are sharded over several devices, but inside `jit` JAX hides the shardings "
    "of the module's values (a mesh with Auto axes): smartremat's predicted figures count one device "
    "doing all the work, while the compiled figures, which chose this plan, are per device")


def _sharded(aval: jax.ShapeDtypeStruct) -> bool:
    sharding = getattr(aval, "sharding", None)
    return sharding is not None and len(sharding.device_set) > 1


def _signature(fun: Callable, sig: Signature) -> str:
    text = repr((step_name(fun), _disk.without_addresses(str(sig.treedef)),
                 [(a.shape, str(a.dtype)) for a in sig.avals], jax.default_backend()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _no_saving(floor: int, plain: int) -> tuple[str, ...]:
    """Where no plan saves anything, a sentence saying so (the error then states the plain temp)."""
    if floor < plain:
        return ()
    return (f"no remat plan takes this step below its temp without remat ({plain / MB:.3f} MB): its peak "
            "is set outside the module calls smartremat checkpoints (the loss, the optimizer update, or "
            "work inside a loop of the step)",)


def _too_low(fun: Callable, config: _planner.Config, floor: int, name: str, auto: bool,
             reasons: tuple[str, ...] = ()) -> ValueError:
    up = -(-floor * 100 // MB) / 100
    asked = f'"auto"` ({config.budget_mb:.1f} MB of the device left for it)' if auto else f"{config.budget_mb:g})`"
    return ValueError(
        f"`{name}(budget_mb={asked} is below the lowest temp memory any remat plan reaches "
        f"for the step `{step_name(fun)}` on these arguments: {floor / MB:.3f} MB (compiled "
        f"temp bytes of the whole step, per device). Raise `budget_mb` to at least {up:.2f}, lower the "
        "batch size, or shard the batch over more devices." + _planner.unplanned_text(reasons))


def _no_module_call(fun: Callable, roots: list[tuple[str, Any]], name: str) -> str:
    found = ", ".join(f"{n} ({type(m).__name__})" for n, m in roots) or "none"
    return (
        f"`{name}` found no call of an Equinox module among the arguments of "
        f"`{step_name(fun)}` (modules among its arguments: {found}). It plans the "
        "modules the step calls (`model(x)`, possibly under `jax.vmap` or `eqx.filter_grad`): pass the "
        "model as an argument of the step and call it there, or use `eqx.filter_jit` for a step "
        "without one.")
