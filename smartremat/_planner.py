"""discover -> profile -> model -> solve -> verify: the one entry the decorator and explain call."""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from . import _disk
from ._apply import run
from ._discover import call_module
from ._cache import KeyedCache, barrier_hint, environment_key
from ._discover import BlockCall, Path, discover, expanded, path_str
from ._memory import Stage, cost_of, peak_at, peak_of
from ._plan import MB, Plan, PlanBlock, PolicyFigures
from ._options import NO_REMAT, Entry, Option, Segments, expand
from ._policies import FULL_REMAT, no_policy_error
from ._profile import BlockProfile, PolicyProfile, n_module_leaves, profile_block, _residuals
from ._nested import nested_options
from ._solve import Solution, frontier, min_peak, solve
from ._serialise import signature
from ._spec import CallSpec, shardings_hidden
from ._head import in_place
from ._verify import DEFAULT_LOSSES, compiled_step, timed_step
from ._search import MAX_CANDIDATES, Estimates, Outcome, _Compiled, search, spread
from ._tune import pool, timings, tuned

logger = logging.getLogger("smartremat")


@dataclass(frozen=True, kw_only=True)
class Config:
    """What the user asked for; part of every cache key."""

    budget_bytes: int
    policies: tuple
    budget_mb: float = 0.0
    blocks: Callable | None = None
    calibrate: bool = True
    verify: bool = True
    plan: Plan | None = None
    scan_segments: int = 2
    nested: bool = True
    losses: tuple = DEFAULT_LOSSES
    tune: bool = False


@dataclass(frozen=True)
class MemoryModel:
    """The memory model of the user's module, built from its profiled block calls: the calls,
    their profiles, and the solver's stages.

    A scanned call gives one stage per iteration, in the order the scan runs them; `owner[i]`
    is the index of stage `i`'s call; `menus[c]` are call `c`'s options (the policy menu, then
    its nested options), indexed like its stage's figures.
    """

    calls: tuple[BlockCall, ...]
    profiles: tuple[BlockProfile, ...]
    stages: tuple[Stage, ...]
    fixed_bytes: int
    owner: tuple[int, ...]
    menus: tuple[tuple, ...]


_PLANS: KeyedCache[Plan] = KeyedCache()


def get_plan(call: Callable, spec: CallSpec, module: Any, config: Config) -> Plan:
    """The plan for this call, signature, config and environment, made once."""
    key = (call, spec.key(), config, *environment_key())
    return _PLANS.get(key, lambda: _stored_or_made(call, spec, module, config))


def _stored_or_made(call: Callable, spec: CallSpec, module: Any, config: Config) -> Plan:
    """The plan from the disk cache (`_disk`) if it holds one for this key, else a new plan,
    stored there."""
    t0 = time.perf_counter()
    text = _disk.plan_key(call, spec, config)
    stored = _disk.load(text)
    if stored is None:
        plan = make_plan(call, spec, module, config)
        _disk.store(text if not untimed(config, plan) else None, plan)
        return plan
    plan = _disk.loaded(stored[0], time.perf_counter() - t0)
    _log(type(module).__name__, plan)
    return plan


def untimed(config: Config, plan: Plan) -> bool:
    """Whether `tune=True` could not time this plan's candidates (`_fastest`): not to be stored."""
    return config.tune and not plan.timed


def _option_of(profile: BlockProfile, option: Option) -> PolicyProfile:
    found = _find_option(profile, option)
    if found is None:
        raise KeyError(option.name)
    return found


def _find_option(profile: BlockProfile, option: Option) -> PolicyProfile | None:
    """The profile of `option` (or of the option it was merged into); `None` if it failed for the block."""
    return next((o for o in profile.options if o.stands_for(option)), None)


def _available(calls: tuple[BlockCall, ...], profiles: tuple, menus: tuple) -> tuple[tuple, ...]:
    """Each call's menu less the options that failed for its block (in any of its calls, which
    are tied by option index)."""
    failed: dict = {}
    for c, prof, menu in zip(calls, profiles, menus):
        failed.setdefault(c.path, set()).update(i for i, pol in enumerate(menu) if _find_option(prof, pol) is None)
    return tuple(tuple(pol for i, pol in enumerate(menu) if i not in failed[c.path]) for c, menu in zip(calls, menus))


def uniform(model: MemoryModel, option: Option) -> tuple[int, ...]:
    """The choice giving every block `option` (no remat where it failed for a block), or the
    option it was merged into for a block (the same residuals, so the same program) where all the
    block's calls merged it alike, so that uniform plans that are one program are one choice."""
    same: dict[Path, Option] = {}
    for ci in model.owner:
        found = _find_option(model.profiles[ci], option)
        kept = found.option if found is not None else NO_REMAT
        path = model.calls[ci].path
        same[path] = kept if same.get(path, kept) == kept else option
    return tuple(next((i for i, p in enumerate(model.menus[ci]) if p == same[model.calls[ci].path]), 0)
                 for ci in model.owner)


def build_model(call: Callable, spec: CallSpec, module: Any, config: Config,
                progress: Callable[[str], None] = logger.debug) -> MemoryModel:
    """Discover the block calls and profile each distinct one under every option."""
    found = discover(module, call, spec, config.blocks)
    calls = tuple(expanded(module, call, spec, found) if config.blocks is None else found)
    menus = _menus(calls, config)
    profiles = []
    for k, (c, menu) in enumerate(zip(calls, menus)):
        progress(f"profiling block call {k + 1} of {len(calls)}: {path_str(c.path)} ({c.type_name})")
        profiles.append(profile_block(c.spec, call if c.path == () else call_module, menu, config.calibrate, c.ends))
    profiles = tuple(profiles)
    menus = _available(calls, profiles, menus)
    groups = {p: i for i, p in enumerate(dict.fromkeys(c.path for c in calls))}
    stages, owner = [], []
    for ci, (c, prof) in enumerate(zip(calls, profiles)):
        opts = [_option_of(prof, pol) for pol in menus[ci]]
        if c.scan is None:
            stages.append(Stage(*_figures(opts, scanned=False), groups[c.path]))
            owner.append(ci)
            continue
        for _ in range(c.scan.length):  # each iteration its own group, pieces limited per run
            stages.append(Stage(*_figures(opts, scanned=True), len(groups) + len(stages), c.scan.eqn,
                                config.scan_segments, c.scan.xs_bytes))
            owner.append(ci)
    fixed = _fixed_bytes(call, spec, calls, profiles, config)
    return MemoryModel(calls, profiles, tuple(stages), fixed, tuple(owner), menus)


def _menus(calls: tuple[BlockCall, ...], config: Config) -> tuple[tuple, ...]:
    """Per call: the policy menu, then (with `config.nested`) its nested options."""
    found: dict = {}
    out = []
    for c in calls:
        if not config.nested or c.path == ():
            out.append(config.policies)
            continue
        if c.path not in found:  # one menu per block: its calls are tied by option index
            found[c.path] = nested_options(c, config.policies)
        out.append(config.policies + found[c.path])
    return tuple(out)


def _figures(opts: list, scanned: bool) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """`(saved, peak, cost)` per option. A scan stacks each iteration's residuals as the jaxpr
    has them (XLA cannot fuse them away across the loop), so a scanned stage keeps the jaxpr
    count, plus the compiler's transient for its own backward."""
    if not scanned:
        return (tuple(o.saved_bytes for o in opts), tuple(o.peak_bytes for o in opts),
                tuple(o.recompute.flops for o in opts))
    saved = tuple(o.residual_bytes for o in opts)
    peak = tuple(o.residual_bytes + max(o.peak_bytes - max(o.saved_bytes, 0), 0) for o in opts)
    return saved, peak, tuple(o.recompute.flops for o in opts)


def _fixed_bytes(call: Callable, spec: CallSpec, calls: Sequence[BlockCall], profiles: Sequence[BlockProfile],
                 config: Config) -> int:
    """Residuals of the work outside blocks (embedding, head, ...), held for the whole pass."""
    if len(calls) == 1 and calls[0].path == ():
        return 0
    full = _full_remat(config.policies)
    usable = {c.path: full if _find_option(p, full) is not None else NO_REMAT for c, p in zip(calls, profiles)}
    assignment = tuple(usable.items())
    f = spec.function(lambda m, *a, **k: run(m, call, assignment, a, k))
    internal, _, _ = _residuals(f, spec, n_module_leaves(spec))
    block_inputs = sum(_option_of(p, usable[c.path]).residual_bytes * (c.scan.length if c.scan else 1)
                       for c, p in zip(calls, profiles))
    return max(internal - block_inputs, 0)


def choices_of(model: MemoryModel, choice: tuple[int, ...]) -> dict[Path, Option]:
    """`{block path: chosen option or Segments}`, one entry per distinct block."""
    per_call: dict[int, list[int]] = {}
    for ci, o in zip(model.owner, choice):
        per_call.setdefault(ci, []).append(o)
    seen: dict = {}
    for ci, opts in per_call.items():
        c = model.calls[ci]
        if c.path in seen:
            continue
        menu = model.menus[ci]
        seen[c.path] = menu[opts[0]] if c.scan is None else _segments(opts, c.scan.reverse, menu)
    return seen


def assignment_of(model: MemoryModel, choice: tuple[int, ...]) -> tuple[Entry, ...]:
    """`((path, option), ...)` to apply: a nested option becomes its sub-blocks' entries (paths
    below the block's), the block itself left alone."""
    return tuple(dict(expand(tuple(choices_of(model, choice).items()))).items())


def _segments(opts: list[int], reverse: bool, policies: tuple[Option, ...]) -> Option:
    """Run-length pieces over the stacked axis (a reversed scan runs it from the end)."""
    by_index = opts[::-1] if reverse else opts
    pieces, start = [], 0
    for i in range(1, len(by_index) + 1):
        if i == len(by_index) or by_index[i] != by_index[start]:
            pieces.append((start, i, policies[by_index[start]]))
            start = i
    return pieces[0][2] if len(pieces) == 1 else Segments(tuple(pieces))


_QUIET_SECONDS = 2.0


def progress_log(name: str, t0: float) -> Callable[[str], None]:
    """Say what planning `name` is doing on the `smartremat` logger (INFO), once it has taken
    more than `_QUIET_SECONDS`; quicker plans stay quiet."""

    def say(what: str) -> None:
        elapsed = time.perf_counter() - t0
        if elapsed >= _QUIET_SECONDS:
            logger.info("smartremat planning %s, %.1f s: %s", name, elapsed, what)

    return say


def make_plan(call: Callable, spec: CallSpec, module: Any, config: Config) -> Plan:
    t0 = time.perf_counter()
    progress = progress_log(type(module).__name__, t0)
    model = build_model(call, spec, module, config, progress)
    if config.calibrate:
        model = _with_head(model, call, spec, config.losses[0])
    stages, fixed = model.stages, model.fixed_bytes
    lowest = min_peak(stages)
    sol = solve(stages, config.budget_bytes - fixed)
    if sol is None and not config.verify:
        raise infeasible(config, spec, lowest.peak + fixed, "predicted by smartremat's model", unplanned(model))
    outcome = None
    if config.verify:
        def measure(choice: tuple[int, ...]) -> tuple[int, float]:
            return compiled_step(call, spec, assignment_of(model, choice), config.losses[:1])

        def confirm(choice: tuple[int, ...]) -> tuple[int, float]:
            return compiled_step(call, spec, assignment_of(model, choice), config.losses)

        def error(floor: int) -> ValueError:
            return infeasible(config, spec, floor, "compiled temp bytes of the training step", unplanned(model))

        def time_of(choices: list) -> list[tuple[float, ...]]:
            return timings([timed_step(call, spec, assignment_of(model, c), config.losses[0]) for c in choices])

        sol, outcome = verified(model, config, measure, error, sol or lowest, lowest, progress,
                                confirm if len(config.losses) > 1 else None, time_of if config.tune else None)
    assert sol is not None  # unverified, an unsolvable budget raised above
    plan = assemble(model, config, sol, lowest, outcome, time.perf_counter() - t0, signature(call, spec))
    if cpu_barrier_missing():
        warnings.warn("smartremat: " + CPU_NOTE + ".", stacklevel=2)
    _log(type(module).__name__, plan)
    return plan


def _with_head(model: MemoryModel, call: Callable, spec: CallSpec, loss: Any) -> MemoryModel:
    """`_head.in_place`, or `model` as it is where that measure fails: it only refines the model."""
    try:
        return in_place(model, call, spec, loss)
    except Exception as e:
        logger.debug("smartremat: the head after the last block was not measured (%s: %s)", type(e).__name__, e)
        return model


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


_MAX_FRONTIER_STAGES = 64


def verified(model: MemoryModel, config: Config, measure: Callable, error: Callable,
             sol: Solution, lowest: Solution, progress: Callable[[str], None] = logger.debug,
             confirm: Callable | None = None, time_of: Callable | None = None) -> tuple[Solution, Outcome]:
    """The cheapest candidate whose compiled temp bytes fit the budget (within `_search.TIE_MARGIN`,
    the one of fewest temp bytes), found by `_search.search`
    with few whole-step compiles.

    Candidates are the model's Pareto frontier (at most `MAX_CANDIDATES` points, spread evenly;
    above `_MAX_FRONTIER_STAGES` stages, where enumerating it is too slow, only the lowest-peak
    choice `lowest` and the model's choice `sol`) and the uniform plans the model does not rule
    out (`_search`). "Cheapest" is the fewest compiled FLOPs, or the model's FLOPs when a block
    is scanned (XLA's cost analysis counts a loop body once, docs/facts.md fact 7).

    With `time_of` (`tune=True`), the fitting candidates of `_tune.pool` are timed by it, and the
    one of the lowest median time replaces that choice (`_fastest`, `_tune.tuned`).
    """
    stages = model.stages
    front = frontier(stages) if len(stages) <= _MAX_FRONTIER_STAGES else sorted({lowest, sol}, key=lambda s: s.peak)
    points = spread(front, MAX_CANDIDATES)
    looped = any(st.run is not None for st in stages)

    def rank(choice: tuple[int, ...], flops: float) -> float:
        return cost_of(stages, choice) if looped else flops

    def peak(choice: tuple[int, ...]) -> float:
        return peak_of(stages, choice) + model.fixed_bytes

    def flops(choice: tuple[int, ...]) -> float:
        return cost_of(stages, choice)

    uniforms = list(dict.fromkeys(uniform(model, p) for p in config.policies))
    out = search([p.choice for p in points], uniforms, Estimates(peak, flops), config.budget_bytes, measure, rank,
                 error, progress, confirm)
    if time_of is not None:
        out = _fastest(out, [p.choice for p in points], uniforms, config, measure, confirm, time_of, peak, progress)
    return Solution(out.choice, peak_of(stages, out.choice), cost_of(stages, out.choice)), out


#: The warning when `tune=True` cannot run its candidates.
TUNE_FAILED = ("smartremat: `tune=True` could not time its candidate plans ({error}); the plan of the "
               "fewest compiled FLOPs that fits is used, untimed, and not stored in the disk cache, so the next "
               "process tries again. Timing holds a second copy of the step's inputs on the device: free memory "
               "for it, or pass `tune=False` to plan without timing.")


def _fastest(out: Outcome, points: list, uniforms: list, config: Config, measure: Callable,
             confirm: Callable | None, time_of: Callable, peak: Callable, progress: Callable[[str], None]) -> Outcome:
    """`tune=True`: the search's outcome with its choice replaced by the fastest fitting candidate
    (`_tune.tuned`), the candidates it compiled and timed added. Where running them fails (out of
    device memory: timing holds a second copy of the inputs), a warning says so and the search's
    outcome stays, with no times (`Plan.timed` empty: such a plan is not stored on disk)."""
    compiled = _Compiled(measure, progress, confirm)
    try:
        choice, timed = tuned(out, pool(points, uniforms, out.choice), config.budget_bytes, compiled, time_of,
                              progress)
    except jax.errors.JaxRuntimeError as e:
        warnings.warn(TUNE_FAILED.format(error=str(e).splitlines()[0] if str(e) else type(e).__name__),
                      stacklevel=2)
        return out
    checked = dict(zip(out.measured, out.checked))
    for c, (t, _) in compiled.figures.items():
        checked.setdefault(c, (int(peak(c)), t))
    return Outcome(choice, compiled.figures[choice], tuple(checked),
                   tuple(dict.fromkeys([*out.confirmed, *compiled.confirmed])),  # each once: the choice is in both
                   tuple(checked.values()), timed, out.skipped + compiled.skipped)


def unplanned(model: MemoryModel) -> tuple[str, ...]:
    """Why some blocks of the model's module(s) are left as they run (called inside loops)."""
    return tuple(dict.fromkeys(r for c in model.calls for r in c.unplanned))


def unplanned_text(reasons: tuple[str, ...]) -> str:
    """For an error about a budget that is too low: the blocks remat could not reach, and why."""
    return "".join(f" Note: {r}." for r in reasons)


def infeasible(config: Config, spec: CallSpec, floor: int, kind: str, reasons: tuple[str, ...] = ()) -> ValueError:
    empty = no_policy_error(config.policies, config.budget_mb, floor)
    if empty is not None:
        return empty
    shapes = ", ".join(f"{d.dtype}{list(d.shape)}" for d in spec.dynamic[n_module_leaves(spec):])
    up = math.ceil(floor / MB * 100) / 100
    return ValueError(
        f"`smartremat(budget_mb={config.budget_mb:g})` is below the lowest peak any remat plan "
        f"reaches for this module on inputs ({shapes}): {floor / MB:.3f} MB ({kind}). Raise "
        f"`budget_mb` to at least {up:.2f}, lower the batch size, or name finer blocks with "
        "`blocks=` so that smaller pieces can be recomputed." + unplanned_text(reasons) + _unseen_sharding(spec)
        + barrier_hint()
    )


def _unseen_sharding(spec: CallSpec) -> str:
    """Several devices, no sharding seen: say why the figures are for one device, and what to do."""
    if not shardings_hidden(spec):
        return ""
    return (
        f" These figures are for one device running the whole call: smartremat sees no sharding on "
        f"it although {jax.device_count()} devices are present. If the step runs over a "
        "`jax.sharding.Mesh` whose axes are Auto (e.g. `Mesh(jax.devices(), ('data',))` with "
        "`NamedSharding` inputs), JAX hides each device's share inside `jit`: plan the whole step "
        "with `smartremat.filter_jit(step, budget_mb=...)`, which compiles it with your arguments' "
        "shardings and holds the budget per device, or make the mesh with Explicit axes "
        "(`jax.make_mesh(shape, names)`), whose shardings smartremat reads."
    )


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
        saved, peak, cost = _figures(shown, scanned=c.scan is not None)
        figures = tuple(PolicyFigures(o.name, s, pk, f, tuple(m.name for m in o.merged))
                        for o, s, pk, f in zip(shown, saved, peak, cost))
        out += [PlanBlock(label, c.type_name, counts[path] if n is None else n, q.name, figures)
                for label, n, q in rows]
    return tuple(out)


def _full_remat(menu: tuple[Option, ...]) -> Option:
    """`nothing_saveable` if on the menu, else the menu's last option."""
    return FULL_REMAT if FULL_REMAT in menu else menu[-1]


def assemble(model: MemoryModel, config: Config, sol: Solution, lowest: Solution,
             outcome: Outcome | None, seconds: float, sig: str) -> Plan:
    """The `Plan` of choice `sol`; its compile count is the search's: each candidate under the
    first loss, the confirmed ones under the others too."""
    stages, fixed = model.stages, model.fixed_bytes
    compiled = None if outcome is None else outcome.compiled
    return Plan(
        budget_bytes=config.budget_bytes,
        predicted_peak_bytes=sol.peak + fixed,
        no_remat_peak_bytes=peak_of(stages, (0,) * len(stages)) + fixed,
        full_remat_peak_bytes=peak_of(stages, uniform(model, _full_remat(config.policies))) + fixed,
        min_peak_bytes=lowest.peak + fixed,
        recompute_flops=sol.cost,
        forward_flops=sum(p.forward.flops * (c.scan.length if c.scan else 1)
                          for c, p in zip(model.calls, model.profiles)),
        blocks=_blocks(model, config, sol.choice),
        compiled_peak_bytes=None if compiled is None else int(compiled[0]),
        compiled_flops=None if compiled is None else float(compiled[1]),
        fixed_bytes=fixed,
        planning_seconds=seconds,
        compiles=0 if outcome is None else len(outcome.measured) + len(outcome.confirmed) * (len(config.losses) - 1),
        checked=() if outcome is None else outcome.checked,
        timed=() if outcome is None else outcome.timed,
        backend=jax.default_backend(),
        notes=tuple(_notes(model, sol)) + _skipped_note(outcome) + unplanned(model),
        assignment=assignment_of(model, sol.choice),
        stages=stages,
        menu=tuple(p.name for p in config.policies),
        signature=sig,
    )


def _skipped_note(outcome: Outcome | None) -> tuple[str, ...]:
    if outcome is None or not outcome.skipped:
        return ()
    return (f"{outcome.skipped} candidate plan(s) could not be built (a scan split into pieces whose "
            "operands differ between policies) and were skipped",)


CPU_NOTE = (
    "on the CPU backend XLA removes remat's optimisation barriers before CSE, so remat outside "
    "loops saves nothing unless XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander is set "
    "before JAX is imported"
)


def cpu_barrier_missing() -> bool:
    return jax.default_backend() == "cpu" and "cse_barrier_expander" not in os.environ.get("XLA_FLAGS", "")


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
