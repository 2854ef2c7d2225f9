"""The memory model: the block calls a module's forward makes (`_discover`), each distinct one
profiled under every option (`_profile`), as the solver's stages (`_memory.Stage`); several
modules' models joined into one (a training step's), and the one refinement that raises a stage's
own peak by what a compiled program shows runs beside it (`after_stage`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._cache import KeyedCache
from ._discover import BlockCall, call_module, discover, expanded
from ._env import environment_key
from ._memory import Stage, raised
from ._nested import nested_options
from ._objective import device_charge
from ._options import NO_REMAT, Entry, Option, Segments, expand, run
from ._paths import Path, path_str
from ._plan import Plan
from ._policies import FULL_REMAT
from ._profile import BlockProfile, PolicyProfile, n_module_leaves, profile_block, residuals
from ._spec import CallSpec
from ._verify import DEFAULT_LOSSES

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
    its nested options), indexed like its stage's figures. `refined_on` are the choices of the
    programs a target refined the model on (with `after_stage`): the device compiled them, so they are
    candidates at no cost where nothing else fits, even if the refined model rules them out.
    """

    calls: tuple[BlockCall, ...]
    profiles: tuple[BlockProfile, ...]
    stages: tuple[Stage, ...]
    fixed_bytes: int
    owner: tuple[int, ...]
    menus: tuple[tuple, ...]
    refined_on: tuple[tuple[int, ...], ...] = ()


def _option_of(profile: BlockProfile, option: Option) -> PolicyProfile:
    found = find_option(profile, option)
    if found is None:
        raise KeyError(option.name)
    return found


def find_option(profile: BlockProfile, option: Option) -> PolicyProfile | None:
    """The profile of `option` (or of the option it was merged into); `None` if it failed for the block."""
    return next((o for o in profile.options if o.stands_for(option)), None)


def _available(calls: tuple[BlockCall, ...], profiles: tuple, menus: tuple) -> tuple[tuple, ...]:
    """Each call's menu less the options that failed for its block (in any of its calls, which
    are tied by option index)."""
    failed: dict = {}
    for c, prof, menu in zip(calls, profiles, menus):
        failed.setdefault(c.path, set()).update(i for i, pol in enumerate(menu) if find_option(prof, pol) is None)
    return tuple(tuple(pol for i, pol in enumerate(menu) if i not in failed[c.path]) for c, menu in zip(calls, menus))


def uniform(model: MemoryModel, option: Option) -> tuple[int, ...]:
    """The choice giving every block `option` (no remat where it failed for a block), or the
    option it was merged into for a block (the same residuals, so as a rule the same program)
    where all the block's calls merged it alike, so that uniform plans of the same residuals are
    one choice. (Not always one program: a checkpoint that keeps what no remat keeps can still
    compile smaller, `every_option`.)"""
    same: dict[Path, Option] = {}
    for ci in model.owner:
        found = find_option(model.profiles[ci], option)
        kept = found.option if found is not None else NO_REMAT
        path = model.calls[ci].path
        same[path] = kept if same.get(path, kept) == kept else option
    return tuple(next((i for i, p in enumerate(model.menus[ci]) if p == same[model.calls[ci].path]), 0)
                 for ci in model.owner)


def every_option(model: MemoryModel) -> tuple[tuple[int, ...], ...]:
    """For each option of any block's menu (nested ones too), the choice giving it to every block
    whose menu holds it, no remat elsewhere: the last resort of a search where nothing else fits.
    The compiler's lowest plan is not always the model's: a nested option may reach below full
    remat where an unrefined model rules it out, and an option merged into another for keeping the
    same residuals (`uniform`) is its own choice here, as its checkpoint may still compile smaller
    (an `eqx.nn.Linear` whose loss is an outer product: 0.004 MB under `dots_saveable`, 1.002 MB
    without remat, XLA fusing the product into the backward's reduction)."""
    names = dict.fromkeys(o.name for ci in model.owner for o in model.menus[ci])
    return tuple(dict.fromkeys(
        tuple(next((i for i, o in enumerate(model.menus[ci]) if o.name == name), 0) for ci in model.owner)
        for name in names))


_CALLS: KeyedCache[tuple[BlockCall, ...]] = KeyedCache()


def block_calls(module: Any, call: Callable, spec: CallSpec, blocks: Callable | None) -> tuple[BlockCall, ...]:
    """The block calls `call(module, ...)` makes (`_discover`: its stacks expanded unless `blocks`
    names them), found once per key: the call, the module's signature (its structure and static
    fields, as `_profile.profile_block` keys a block), `blocks`, backend and XLA flags. Planning
    builds a model twice where a scan's body is calibrated after all (`_planner.refined_model`)."""
    key = (call, spec.key(), blocks, *environment_key())

    def found() -> tuple[BlockCall, ...]:
        calls = discover(module, call, spec, blocks)
        return tuple(expanded(module, call, spec, calls) if blocks is None else calls)

    return _CALLS.get(key, found)


def build_model(call: Callable, spec: CallSpec, module: Any, config: Config,
                progress: Callable[[str], None] = logger.debug, scans: bool = True) -> MemoryModel:
    """Discover the block calls and profile each distinct one under every option; with
    `config.calibrate`, each calibrated by the compiler, a scan's body only with `scans` (else its
    jaxpr's figures: see `working_sets_matter`)."""
    calls = block_calls(module, call, spec, config.blocks)
    menus = _menus(calls, config)
    profiles = []
    for k, (c, menu) in enumerate(zip(calls, menus)):
        progress(f"profiling block call {k + 1} of {len(calls)}: {path_str(c.path)} ({c.type_name})")
        profiles.append(profile_block(c.spec, call if c.path == () else call_module, menu,
                                      config.calibrate and (scans or c.scan is None), c.ends,
                                      scanned=c.scan is not None))
    profiles = tuple(profiles)
    menus = _available(calls, profiles, menus)
    groups = {p: i for i, p in enumerate(dict.fromkeys(c.path for c in calls))}
    charge = device_charge()
    stages, owner = [], []
    for ci, (c, prof) in enumerate(zip(calls, profiles)):
        opts = [_option_of(prof, pol) for pol in menus[ci]]
        if c.scan is None:
            stages.append(Stage(*stage_figures(opts, scanned=False), groups[c.path], kept_charge=charge.unrolled))
            owner.append(ci)
            continue
        for _ in range(c.scan.length):  # each iteration its own group, pieces limited per run
            stages.append(Stage(*stage_figures(opts, scanned=True), len(groups) + len(stages), c.scan.eqn,
                                config.scan_segments, c.scan.xs_bytes, charge.scanned))
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


def stage_figures(opts: list, scanned: bool) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """`(saved, peak, cost)` per option. A scan stacks each iteration's residuals as the jaxpr
    has them (XLA cannot fuse them away across the loop), so a scanned stage keeps the jaxpr
    count, plus the compiler's transient for its own backward."""
    if not scanned:
        return (tuple(o.saved_bytes for o in opts), tuple(o.peak_bytes for o in opts),
                tuple(o.recompute.flops for o in opts))
    saved = tuple(o.residual_bytes for o in opts)
    # a scan body's profile has no chains (`_profile.calibration(scanned=True)`): its saved bytes are the
    # jaxpr's count, and its working set the compiled peak less that count
    peak = tuple(o.residual_bytes + max(o.peak_bytes - max(o.saved_bytes, 0), 0) for o in opts)
    return saved, peak, tuple(o.recompute.flops for o in opts)


def _fixed_bytes(call: Callable, spec: CallSpec, calls: Sequence[BlockCall], profiles: Sequence[BlockProfile],
                 config: Config) -> int:
    """Residuals of the work outside blocks (embedding, head, ...), held for the whole pass."""
    if len(calls) == 1 and calls[0].path == ():
        return 0
    full = full_remat(config.policies)
    usable = {c.path: full if find_option(p, full) is not None else NO_REMAT for c, p in zip(calls, profiles)}
    assignment = tuple(usable.items())
    f = spec.function(lambda m, *a, **k: run(m, call, assignment, a, k))
    internal, _, _ = residuals(f, spec, n_module_leaves(spec))
    block_inputs = sum(_option_of(p, usable[c.path]).residual_bytes * (c.scan.length if c.scan else 1)
                       for c, p in zip(calls, profiles))
    return max(internal - block_inputs, 0)


def described(model: MemoryModel, choice: tuple[int, ...]) -> str:
    """A choice as the log names it: each stage's option, runs of one option counted
    (`"dots_with_no_batch_dims_saveable x18, none x3"`)."""
    names = [model.menus[ci][o].name for ci, o in zip(model.owner, choice)]
    runs: list[list] = []
    for name in names:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return ", ".join(name if n == 1 else f"{name} x{n}" for name, n in runs)


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


def unplanned(model: MemoryModel) -> tuple[str, ...]:
    """Why some blocks of the model's module(s) are left as they run (called inside loops)."""
    return tuple(dict.fromkeys(r for c in model.calls for r in c.unplanned))


def as_notes(reasons: tuple[str, ...]) -> str:
    """Reasons appended to an error message, one " Note: ..." sentence each."""
    return "".join(f" Note: {r}." for r in reasons)


def full_remat(menu: tuple[Option, ...]) -> Option:
    """`nothing_saveable` if on the menu, else the menu's last option."""
    return FULL_REMAT if FULL_REMAT in menu else menu[-1]


def joined(models: list[MemoryModel], labels: list[str]) -> MemoryModel:
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
    return MemoryModel(tuple(calls), tuple(profiles), tuple(stages), fixed, tuple(owner), tuple(menus))


def split_assignment(model: MemoryModel, choice: tuple[int, ...], labels: list[str]) -> tuple:
    """One assignment per module call (paths relative to that module)."""
    assignment = assignment_of(model, choice)
    if len(labels) == 1:
        return (assignment,)
    return tuple(tuple((path[1:], pol) for path, pol in assignment if path[0] == ("attr", label))
                 for label in labels)


def after_stage(model: MemoryModel, k: int, measured: int, kept_before: int, option: int = 0) -> MemoryModel:
    """`model` with stage `k`'s own peak under each option raised to at least its kept bytes plus
    what runs beside them in its backward: `measured` (the compiled temp bytes of a program in
    which the stages before `k` keep `kept_before` bytes and stage `k` runs under `option`, by
    default without remat) less the glue's residuals (`fixed_bytes`), `kept_before` and the
    stage's own kept bytes. The one refinement of the model by a compiled program: the head after
    a stack's last block (`_head`), and the rest of a training step after its last block
    (`_step_plan`)."""
    st = model.stages[k]
    after = measured - model.fixed_bytes - kept_before - st.saved[option]
    return dataclasses.replace(model, stages=model.stages[:k] + (raised(st, after),) + model.stages[k + 1:])


def working_sets_matter(raw: MemoryModel, refined: MemoryModel) -> bool:
    """Whether a scan body's working set (its own peak less what it keeps, from its jaxpr where it
    is not calibrated) could set a peak `refined` predicts: the model `raw` once a target refined
    its last stage with `after_stage`. It cannot where that raise took, with what runs beside the
    last stage's kept bytes (`after`) at least every scanned stage's working set, and no stage from
    the first scanned one on keeps a negative count: the last stage's backward then runs beside all
    that any scanned stage's does, and more. So a scanned step whose rest (the loss, the update)
    outweighs an iteration's backward needs no calibrating compile for its body (on XLA:TPU, 7 of
    them took 18.9 s of a 46.5 s first call where the whole step compiles in 9 s: docs/fit.md)."""
    stages = refined.stages
    scanned = [i for i, st in enumerate(stages) if st.run is not None]
    if not scanned:
        return False
    before, last = raw.stages[-1], stages[-1]
    raised = [p - s for p, q, s in zip(last.peak, before.peak, last.saved) if p > q]
    if not raised or any(s < 0 for st in stages[scanned[0]:] for s in st.saved):
        return True
    return any(p - s > min(raised) for i in scanned for p, s in zip(stages[i].peak, stages[i].saved))
