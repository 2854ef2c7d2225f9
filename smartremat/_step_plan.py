"""A whole training step as the planning pipeline's `Target` (`smartremat.filter_jit`): "the
step" is the user's step itself, its module calls (recorded by one abstract trace, `_step.record`)
each under its own assignment, compiled as it runs; the rest of the step after the last block
refines the model (`tail`), and a failure to fit is worded in terms of the step."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from ._cache import Identity
from ._env import MB
from ._key import PlanKey, step_key
from ._model import Config, MemoryModel, after_stage, as_notes, build_model, joined, split_assignment, unplanned
from ._plan import Plan
from ._cost import aval_bytes
from ._refused import Refused
from ._memory import peak_at, peak_of
from ._search import FLOOR_SCOPE, Unbuildable
from ._solve import min_peak
from ._planner import Runs, planned
from ._spec import planning_step, shardings_hidden
from ._step import (Signature, StepFigures, compiled_key, compiled_step, record, root_classes, step_figures,
                    step_name)
from ._tune import Timed

logger = logging.getLogger("smartremat")


@dataclass(frozen=True)
class StepOptions:
    """`filter_jit`'s own options: an automatic budget, and which arguments are donated."""

    auto: bool = False
    donate: str = "none"


class StepTarget:
    """The step `fun` on arguments of signature `sig`, its modules `roots` among them: one
    abstract trace records its module calls (`calls`) and its jaxpr."""

    def __init__(self, fun: Callable, sig: Signature, roots: list[tuple[str, Any]], options: StepOptions):
        self.fun, self.sig, self.options = fun, sig, options
        self.name = step_name(fun)
        self.classes = root_classes(roots)
        self.calls, self.jaxpr = record(sig, roots)
        if not self.calls:
            raise ValueError(_no_module_call(fun, roots, "smartremat.filter_jit"))
        self.labels = [c.label for c in self.calls]
        self.memory = _device_limit(sig)  # the device's memory, where it reports it
        self.said: tuple[str, ...] = ()  # what planning had to do otherwise (the reference), for the plan's notes
        self.limit = self.memory if options.auto else None  # an automatic budget depends on it

    def key(self) -> PlanKey:
        extra = (self.options, self.memory, AUTO_RESERVE)
        return step_key(self.name, self.sig, self.jaxpr, Identity(self.fun), extra)

    def model(self, config: Config, progress: Callable[[str], None], scans: bool = True) -> MemoryModel:
        return joined([build_model(c.call, c.spec, c.spec.rebuild(c.spec.dynamic)[0], config, progress, scans)
                       for c in self.calls], self.labels)

    def refined(self, model: MemoryModel, config: Config) -> tuple[MemoryModel, Config]:
        """The automatic budget (`budget_mb="auto"`), and the rest of the step after its last block
        (`tail`), from the compiled reference step (`reference`; where the device refuses every
        one, the model unrefined and, for `"auto"`, `abstract_figures`)."""
        try:
            base, choice = self.reference(model)
        except Refused as e:  # the search, not the model, finds what fits the device
            logger.debug("smartremat: no reference step compiled (%s); the tail is not measured", e.message)
            self.said = (NO_REFERENCE_NOTE,)
            base, choice = self.abstract_figures(), None
        if self.options.auto:
            budget = auto_budget(self.sig, base, "smartremat.filter_jit", self.limit)
            config = dataclasses.replace(config, budget_bytes=budget, budget_mb=budget / MB)
        if choice is None:
            return model, config
        return dataclasses.replace(tail(model, base.temp, choice), refined_on=(choice,)), config

    def abstract_figures(self) -> StepFigures:
        """The step's figures without a compiled program (every reference refused): its arguments
        and outputs from the recorded jaxpr, a donated argument aliased to an output of its type
        (as XLA does), no code; the temp bytes unknown (0)."""
        outs = [(tuple(v.shape), str(v.dtype)) for v in self.jaxpr.out_avals]
        alias = 0
        for a in (self.sig.avals[i] for i in self.sig.donated(self.options.donate)):
            if (tuple(a.shape), str(a.dtype)) in outs:  # each output takes one donated buffer
                outs.remove((tuple(a.shape), str(a.dtype)))
                alias += aval_bytes(a)
        outputs = sum(aval_bytes(v) for v in self.jaxpr.out_avals)
        return StepFigures(0, 0.0, sum(aval_bytes(a) for a in self.sig.avals), outputs, alias, 0)

    def reference(self, model: MemoryModel) -> tuple[StepFigures, tuple[int, ...]]:
        """`(figures, choice)` of a compiled step to refine the model on: the step without remat;
        where the device refuses it for memory (XLA:TPU, docs/facts.md fact 21), or the model puts
        it above the device's memory before compiling it (`beyond_device`), the model's choice
        of lowest peak with the last block without remat (what follows that block then runs beside
        its kept bytes, as without remat); where that is refused too, the lowest choice itself.
        Where the last block is an iteration of a scan, the lowest choice comes first: leaving the
        last iteration without remat splits the scan, a program unlike the candidates' (on XLA:TPU
        calibrated on it, the rest of the step came out 0.9 GB below what the whole scan shows: docs/fit.md).
        Where every one is refused, the last refusal is raised (`_refused.Refused`): the model's
        lowest choice is not always the compiler's (a user's own checkpoints, a `cond`), so the
        search goes on with the model unrefined (and `budget_mb="auto"` on `abstract_figures`)."""
        lowest = min_peak(model.stages).choice
        plain = (0,) * len(lowest)
        beyond = self.beyond_device(model)
        choices: dict[tuple[int, ...], str] = {} if beyond else {plain: ""}
        at_last = peak_at(model.stages, lowest)[1] == len(lowest) - 1  # else the tail does not set its peak
        if at_last and model.stages[-1].run is not None:
            choices[lowest] = "the model's lowest plan"
        choices.setdefault((*lowest[:-1], 0), "the model's lowest plan, its last block without remat")
        if at_last:
            choices.setdefault(lowest, "the model's lowest plan")
        refused = Refused(None, "no reference step")
        for choice, described in choices.items():
            try:
                figures = self.figures(model, choice)
            except (Refused, Unbuildable) as e:  # a split scan may not build
                refused = e if isinstance(e, Refused) else refused
                continue
            if choice != plain:
                self.said = (REFERENCE_NOTE.format(why=BEYOND if beyond else REFUSED, plan=described),)
            return figures, choice
        raise refused

    def beyond_device(self, model: MemoryModel) -> bool:
        """Whether the model, before it is refined, puts the step without remat above the device's
        memory: its blocks' peak (the rest of the step not yet counted) beside the step's arguments and
        outputs. Such a reference is not compiled: XLA:TPU would refuse it after a compile (12 s
        for the TPU check's GPT-2-medium without remat, and as long again to trace and lower it)."""
        if not self.memory or self._sharded():  # sharded: the model counts one device doing all the work
            return False
        f = self.abstract_figures()
        plain = (0,) * len(model.stages)
        beyond = peak_of(model.stages, plain) + f.arguments + f.outputs - f.alias > self.memory
        if beyond:
            logger.debug("smartremat: the step without remat is modelled above the device's memory; not compiled")
        return beyond

    def figures(self, model: MemoryModel, choice: tuple[int, ...]) -> StepFigures:
        """The compiled figures of the step under `choice` (`_refused.Refused` if the device
        refuses it)."""
        return step_figures(self.sig, (self.classes, self.runs(model, choice)), self.options.donate)

    def plain(self, model: MemoryModel) -> int | None:
        """The compiled temp bytes of the step without remat (`None` where the device refuses it)."""
        try:
            return self.figures(model, (0,) * len(model.stages)).temp
        except Refused:
            return None

    def runs(self, model: MemoryModel, choice: tuple[int, ...]) -> Runs:
        return split_assignment(model, choice, self.labels)

    def measure(self, runs: Runs, config: Config, every_loss: bool) -> tuple[int, float]:
        """The compiled step's temp bytes and FLOPs; `_refused.Refused` where the compiler refuses
        it, or where it compiles to more than the device holds (XLA:GPU compiles such a program,
        logging that it cannot reduce memory below the limit, and fails at run time)."""
        f = step_figures(self.sig, (self.classes, runs), self.options.donate)
        total = f.temp + f.arguments + f.outputs - f.alias
        if self.memory and total > self.memory:
            raise Refused(total, f"the step needs {total / MB:.1f} MB, more than the device's {self.memory / MB:.1f} MB")
        return f.temp, f.flops

    def losses(self, config: Config) -> int:
        return 1  # the user's own

    def timed(self, runs: Runs, config: Config) -> Timed:
        """The whole step under `runs`, as `_tune.timings` times it: lowered and compiled as it runs,
        its donated arguments consumed by each call."""
        entry_of, donate = (self.classes, runs), self.options.donate
        build = lambda: compiled_step(self.sig, entry_of, donate)[0]  # noqa: E731
        return Timed(compiled_key(self.sig, entry_of, donate), build, self.sig.avals, self.sig.donated(donate))

    def too_low(self, config: Config, model: MemoryModel, floor: int, compiled: bool) -> Exception:
        plain = self.plain(model)
        reasons = unplanned(model) + (() if plain is None else _no_saving(floor, plain))
        return _too_low(self.fun, config, floor, "smartremat.filter_jit", self.options.auto, compiled, reasons)

    def notes(self, model: MemoryModel) -> tuple[str, ...]:
        return self.said + self._sharded_notes()

    #: Its programs are the user's step: a refusal of them all is final.
    stands_in = False
    #: The rest of the step raises its last block, a scan's last iteration too (`tail`).
    refines_scans = True

    def _sharded(self) -> bool:
        return any(len(getattr(a.sharding, "device_set", ())) > 1 for a in self.sig.avals)

    def _sharded_notes(self) -> tuple[str, ...]:
        hidden = self._sharded() and any(shardings_hidden(c.spec) for c in self.calls)
        return (HIDDEN_NOTE,) if hidden else ()


def plan_step(fun: Callable, sig: Signature, roots: list[tuple[str, Any]], config: Config,
              options: StepOptions) -> Entry:
    """The step's plan (`_planner.planned`: once per key, from the disk cache where it holds one)."""
    with planning_step():
        target = StepTarget(fun, sig, roots, options)
        made = planned(target, config)
    return Entry(made.plan, made.runs, target.classes, sig)


def tail(model: MemoryModel, temp: int, choice: tuple[int, ...] | None = None) -> MemoryModel:
    """`model` calibrated on the compiled step under `choice` (`temp` bytes; by default, and as a
    rule, the step without remat): the rest of the step (what follows the last block, the loss,
    the update) is a tail whose backward runs first, while every block's kept bytes are alive, not
    a constant beside every block (docs/facts.md, fact 16): the last stage's own peak is raised by
    it (`_model.after_stage`), so the reference step is predicted at its compiled bytes (or above,
    where the blocks' own peaks are higher: the glue's residuals are then on top)."""
    stages = model.stages
    if not stages:  # every call a scan of length 0: the whole step is the rest
        return dataclasses.replace(model, fixed_bytes=max(temp, 0))
    choice = (0,) * len(stages) if choice is None else choice
    kept = sum(st.saved[c] for st, c in zip(stages[:-1], choice[:-1]))
    return after_stage(model, len(stages) - 1, temp, kept, choice[-1])


def _device_limit(sig: Signature) -> int | None:
    """`bytes_limit` of this process's first device among those the step's first placed argument
    lives on (None if not reported, or where the arguments are placed on an abstract mesh, inside
    an outer `jit`). Only a device of this process reports its memory (`jax.distributed`)."""
    sharding = next((a.sharding for a in sig.avals if getattr(a, "sharding", None) is not None), None)
    try:
        devices = sharding.device_set if sharding is not None else set(jax.local_devices())
    except ValueError:  # an AbstractMesh names no devices
        return None
    own = [d for d in devices if d.process_index == jax.process_index()]
    if not own:
        return None
    stats = min(own, key=lambda d: d.id).memory_stats()
    return (stats or {}).get("bytes_limit")


#: Plan notes where the step without remat did not fit the device (`StepTarget.reference`).
REFERENCE_NOTE = ("the step without remat {why}: the rest of the step (after the last block) "
                  "was measured with {plan}")
#: Why `REFERENCE_NOTE`'s reference is not the step without remat.
REFUSED, BEYOND = "does not fit the device", "is modelled above the device's memory (not compiled)"
NO_REFERENCE_NOTE = ("neither the step without remat nor the model's lowest plans fit the device: the rest of the "
                     "step (after the last block) is not measured, and the compiler alone judged the candidates")



#: Share of the device's memory left to the allocator's fragmentation under `budget_mb="auto"`.
AUTO_RESERVE = 0.05


def auto_budget(sig: Signature, base: StepFigures, name: str, limit: int | None) -> int:
    """The device's memory minus the step's arguments, outputs (not aliased), code and a reserve."""
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


HIDDEN_NOTE = (
    "the step's arguments are sharded over several devices, but inside `jit` JAX hides the shardings "
    "of the module's values (a mesh with Auto axes): smartremat's predicted figures count one device "
    "doing all the work, while the compiled figures, which chose this plan, are per device")


def _no_saving(floor: int, plain: int) -> tuple[str, ...]:
    """Where no plan saves anything, a sentence saying so (the error then states the plain temp)."""
    if floor < plain:
        return ()
    return (f"no remat plan takes this step below its temp without remat ({plain / MB:.3f} MB): its peak "
            "is set outside the module calls smartremat checkpoints (the loss, the optimizer update, or "
            "work inside a loop of the step)",)


def _too_low(fun: Callable, config: Config, floor: int, name: str, auto: bool, compiled: bool,
             reasons: tuple[str, ...] = ()) -> ValueError:
    up = -(-floor * 100 // MB) / 100
    asked = f'"auto"` ({config.budget_mb:.1f} MB of the device left for it)' if auto else f"{config.budget_mb:g})`"
    lowest, kind = (("the lowest temp memory of the remat plans smartremat compiled",
                     f"compiled temp bytes of the whole step, per device; {FLOOR_SCOPE}") if compiled else
                    ("the lowest temp memory smartremat's model predicts for a remat plan",
                     "temp bytes of the whole step, per device, predicted by smartremat's model"))
    return ValueError(
        f"`{name}(budget_mb={asked} is below {lowest} for the step `{step_name(fun)}` on these arguments: {floor / MB:.3f} MB ({kind}). Raise "
        f"`budget_mb` to at least {up:.2f}, lower the batch size, or shard the batch over more devices."
        + as_notes(reasons))


def _no_module_call(fun: Callable, roots: list[tuple[str, Any]], name: str) -> str:
    found = ", ".join(f"{n} ({type(m).__name__})" for n, m in roots) or "none"
    return (
        f"`{name}` found no call of an Equinox module among the arguments of "
        f"`{step_name(fun)}` (modules among its arguments: {found}). It plans the "
        "modules the step calls (`model(x)`, possibly under `jax.vmap` or `eqx.filter_grad`): pass the "
        "model as an argument of the step and call it there, or use `eqx.filter_jit` for a step "
        "without one.")
