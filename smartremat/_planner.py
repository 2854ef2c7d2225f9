"""discover -> profile -> model -> solve -> verify: the one entry the decorator and explain call."""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from ._apply import call_module, run
from ._cache import KeyedCache, environment_key
from ._discover import BlockCall, discover, path_str
from ._memory import Stage, cost_of, peak_of
from ._plan import MB, Plan, PlanBlock, PolicyFigures
from ._policies import policy_name
from ._profile import BlockProfile, n_module_leaves, profile_block, _residuals
from ._solve import Solution, frontier, min_peak, solve
from ._serialise import signature
from ._spec import CallSpec
from ._verify import compiled_step

logger = logging.getLogger("smartremat")


@dataclass(frozen=True)
class Config:
    """What the user asked for; part of every cache key."""

    budget_bytes: int
    policies: tuple
    budget_mb: float = 0.0
    blocks: Callable | None = None
    calibrate: bool = True
    verify: bool = True
    plan: Plan | None = None


@dataclass(frozen=True)
class Model:
    """The profiled module: block calls, their profiles, and the solver's stages."""

    calls: tuple[BlockCall, ...]
    profiles: tuple[BlockProfile, ...]
    stages: tuple[Stage, ...]
    fixed_bytes: int


_PLANS: KeyedCache[Plan] = KeyedCache()


def get_plan(call: Callable, spec: CallSpec, module: Any, config: Config) -> Plan:
    """The plan for this call, signature, config and environment, made once."""
    key = (call, spec.key(), config, *environment_key())
    return _PLANS.get(key, lambda: make_plan(call, spec, module, config))


def _option_of(profile: BlockProfile, policy: Any):
    name = policy_name(policy)
    return next(o for o in profile.options if o.name == name or name in o.merged)


def build_model(call: Callable, spec: CallSpec, module: Any, config: Config) -> Model:
    """Discover the block calls and profile each distinct one under every policy."""
    calls = tuple(discover(module, call, spec, config.blocks))
    profiles = tuple(
        profile_block(c.spec, call if c.path == () else call_module, config.policies, config.calibrate)
        for c in calls
    )
    groups = {p: i for i, p in enumerate(dict.fromkeys(c.path for c in calls))}
    stages = []
    for c, prof in zip(calls, profiles):
        opts = [_option_of(prof, pol) for pol in config.policies]
        stages.append(Stage(tuple(o.saved_bytes for o in opts), tuple(o.peak_bytes for o in opts),
                            tuple(o.recompute.flops for o in opts), groups[c.path]))
    fixed = _fixed_bytes(call, spec, calls, profiles, config)
    return Model(calls, profiles, tuple(stages), fixed)


def _fixed_bytes(call, spec, calls, profiles, config) -> int:
    """Residuals of the work outside blocks (embedding, head, ...), held for the whole pass."""
    if len(calls) == 1 and calls[0].path == ():
        return 0
    full = jax.checkpoint_policies.nothing_saveable
    assignment = tuple((c.path, full) for c in dict((c.path, c) for c in calls).values())
    f = spec.function(lambda m, *a, **k: run(m, call, assignment, a, k))
    internal, _, _ = _residuals(f, spec, n_module_leaves(spec))
    block_inputs = sum(_option_of(p, full).residual_bytes for p in profiles)
    return max(internal - block_inputs, 0)


def assignment_of(model: Model, policies: tuple, choice: tuple[int, ...]) -> tuple:
    seen: dict = {}
    for c, o in zip(model.calls, choice):
        seen.setdefault(c.path, policies[o])
    return tuple(seen.items())


def make_plan(call: Callable, spec: CallSpec, module: Any, config: Config) -> Plan:
    t0 = time.perf_counter()
    model = build_model(call, spec, module, config)
    stages, fixed = model.stages, model.fixed_bytes
    lowest = min_peak(stages)
    sol = solve(stages, config.budget_bytes - fixed)
    if sol is None and not config.verify:
        raise infeasible(config, spec, lowest.peak + fixed, "predicted by smartremat's model")
    compiled = None
    if config.verify:
        sol, compiled = _verified(call, spec, model, config, sol or lowest, lowest)
    plan = _assemble(model, config, sol, lowest, compiled, time.perf_counter() - t0, signature(call, spec))
    if cpu_barrier_missing():
        warnings.warn("smartremat: " + CPU_NOTE + ".", stacklevel=2)
    _log(type(module).__name__, plan)
    return plan


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


_MAX_CANDIDATES = 16


def _verified(call, spec, model: Model, config: Config, sol: Solution, lowest: Solution):
    """The candidate with the fewest *compiled* FLOPs whose compiled temp bytes fit the budget.

    Candidates are the model's Pareto frontier (at most `_MAX_CANDIDATES` points, spread
    evenly) and every uniform plan: after XLA's fusion a uniform policy can take fewer FLOPs
    than no remat (design.md fact 9), and the model's peaks are off by a few percent. The set
    does not depend on the budget, so each is compiled once per signature (cached), and as the
    budget falls the chosen plan's compiled temp bytes never rise.
    """
    stages = model.stages
    front = frontier(stages) if len(stages) <= _MAX_FRONTIER_STAGES else [lowest, sol]
    cands = list(dict.fromkeys([s.choice for s in _spread(front, _MAX_CANDIDATES)]
                               + [(o,) * len(stages) for o in range(len(config.policies))]))

    def measure(choice):
        return compiled_step(call, spec, assignment_of(model, config.policies, choice))

    with ThreadPoolExecutor(max(1, min(len(cands), os.cpu_count() or 1))) as pool:
        figures = dict(zip(cands, pool.map(measure, cands)))
    fits = [(f, t, cost_of(stages, ch), ch) for ch, (t, f) in figures.items() if t <= config.budget_bytes]
    if not fits:
        floor = min(t for t, _ in figures.values())
        raise infeasible(config, spec, floor, "compiled temp bytes of the training step")
    flops, temp, cost, choice = min(fits)
    return Solution(choice, peak_of(stages, choice), cost), (temp, flops)


def _spread(front: list[Solution], n: int) -> list[Solution]:
    """At most `n` frontier points, evenly spaced, always keeping both ends."""
    if len(front) <= n:
        return front
    idx = sorted({round(k * (len(front) - 1) / (n - 1)) for k in range(n)})
    return [front[i] for i in idx]


def infeasible(config: Config, spec: CallSpec, floor: int, kind: str) -> ValueError:
    shapes = ", ".join(f"{d.dtype}{list(d.shape)}" for d in spec.dynamic[n_module_leaves(spec):])
    up = math.ceil(floor / MB * 100) / 100
    return ValueError(
        f"`smartremat(budget_mb={config.budget_mb:g})` is below the lowest peak any remat plan "
        f"reaches for this module on inputs ({shapes}): {floor / MB:.3f} MB ({kind}). Raise "
        f"`budget_mb` to at least {up:.2f}, lower the batch size, or name finer blocks with "
        "`blocks=` so that smaller pieces can be recomputed."
    )


def _blocks(model: Model, config: Config, choice: tuple[int, ...]) -> tuple[PlanBlock, ...]:
    out, counts = {}, {}
    for c, prof, o in zip(model.calls, model.profiles, choice):
        counts[c.path] = counts.get(c.path, 0) + 1
        if c.path in out:
            continue
        figures = tuple(PolicyFigures(p.name, p.saved_bytes, p.peak_bytes, p.recompute.flops, p.merged)
                        for p in prof.options)
        out[c.path] = (c, figures, policy_name(config.policies[o]))
    return tuple(PlanBlock(path_str(c.path), c.type_name, counts[p], pol, figs)
                 for p, (c, figs, pol) in out.items())


def _uniform_peak(stages, policies, policy) -> int:
    idx = next((i for i, p in enumerate(policies) if p is policy), len(policies) - 1)
    return peak_of(stages, (idx,) * len(stages))


def _assemble(model: Model, config: Config, sol: Solution, lowest: Solution, compiled, seconds,
              sig: str) -> Plan:
    stages, fixed = model.stages, model.fixed_bytes
    return Plan(
        budget_bytes=config.budget_bytes,
        predicted_peak_bytes=sol.peak + fixed,
        no_remat_peak_bytes=peak_of(stages, (0,) * len(stages)) + fixed,
        full_remat_peak_bytes=_uniform_peak(stages, config.policies, jax.checkpoint_policies.nothing_saveable) + fixed,
        min_peak_bytes=lowest.peak + fixed,
        recompute_flops=sol.cost,
        forward_flops=sum(p.forward.flops for p in model.profiles),
        blocks=_blocks(model, config, sol.choice),
        compiled_peak_bytes=None if compiled is None else int(compiled[0]),
        compiled_flops=None if compiled is None else float(compiled[1]),
        fixed_bytes=fixed,
        planning_seconds=seconds,
        backend=jax.default_backend(),
        notes=tuple(_notes(model, sol)),
        assignment=assignment_of(model, config.policies, sol.choice),
        stages=stages,
        menu=tuple(policy_name(p) for p in config.policies),
        signature=sig,
    )


CPU_NOTE = (
    "on the CPU backend XLA removes remat's optimisation barriers before CSE, so remat outside "
    "loops saves nothing unless XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander is set "
    "before JAX is imported"
)


def cpu_barrier_missing() -> bool:
    return jax.default_backend() == "cpu" and "cse_barrier_expander" not in os.environ.get("XLA_FLAGS", "")


def _notes(model: Model, sol: Solution) -> list[str]:
    notes = [CPU_NOTE] if cpu_barrier_missing() else []
    kept, worst, at = 0, -1, 0
    for i, (st, c) in enumerate(zip(model.stages, sol.choice)):
        if kept + st.peak[c] > worst:
            worst, at = kept + st.peak[c], i
        kept += st.saved[c]
    prior = worst - model.stages[at].peak[sol.choice[at]]
    notes.append(
        f"the peak is reached in the backward of {path_str(model.calls[at].path)} "
        f"({model.calls[at].type_name}), while {prior / MB:.2f} MB kept by earlier blocks are alive")
    return notes
