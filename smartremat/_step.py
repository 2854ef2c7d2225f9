"""`smartremat.filter_jit(step, budget_mb=...)`: plan the modules of a whole training step.

The step (loss, gradient, optimizer update) is the program the budget is held against: every
candidate plan is compiled as the step itself, with the arguments' shapes, dtypes and
shardings, and the plan kept is the cheapest whose compiled temp bytes fit. The modules planned
are the Equinox modules among the step's arguments; their blocks are found, profiled and solved
exactly as the decorator does (one `Model` per module call, joined in call order).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import numpy as np

from . import _intercept, _jax_private, _planner
from ._apply import run
from ._cache import KeyedCache, environment_key
from ._decorator import config_of, make_config
from ._memory import peak_of
from ._plan import MB, Plan
from ._profile import mesh_context
from ._solve import min_peak, solve
from ._spec import CallSpec, abstract, make_spec, shardings_hidden


@dataclass(frozen=True)
class StepFigures:
    """The compiler's figures for one compiled step (per device when sharded)."""

    temp: int
    flops: float
    arguments: int
    outputs: int
    alias: int
    code: int


@dataclass(frozen=True)
class RootCall:
    """One call of a module among the step's arguments, as the step made it."""

    label: str
    call: Callable
    spec: CallSpec


def _is_dynamic(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, jax.core.Tracer))


def _aval(x: Any) -> jax.ShapeDtypeStruct:
    """Shape, dtype, weak type and (for a concrete array) the sharding it is placed with."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.core.Tracer):
        return abstract(x)
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)
    return jax.ShapeDtypeStruct(np.shape(x), np.result_type(x))


@dataclass(frozen=True)
class Signature:
    """The step's arguments split as `eqx.filter_jit` does: arrays traced, the rest static."""

    treedef: Any
    static: tuple
    avals: tuple[jax.ShapeDtypeStruct, ...]
    first: int = 0  # how many of `avals` belong to the first argument

    def donated(self, donate: str) -> tuple[int, ...]:
        """`donate_argnums` of the flat step for `eqx.filter_jit`'s `donate=` setting."""
        start = {"none": len(self.avals), "all": 0, "all-except-first": self.first}[donate]
        return tuple(range(start, len(self.avals)))

    def key(self) -> tuple:
        return (self.treedef, self.static, tuple(
            (a.shape, str(a.dtype), getattr(a, "weak_type", False), _placement(a)) for a in self.avals))

    def rebuild(self, dynamic: tuple) -> tuple[tuple, dict]:
        leaves: list[Any] = []
        it, stat = iter(dynamic), dict(self.static)
        for i in range(len(self.avals) + len(self.static)):
            leaves.append(stat[i] if i in stat else next(it))
        return jax.tree.unflatten(self.treedef, leaves)


def bind(fun: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call as `fun`'s signature binds it (as `eqx.filter_jit` does), so a keyword argument
    and the same one passed by position are one signature, and "first" means the first parameter."""
    try:
        bound = inspect.signature(fun).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return tuple(args), dict(kwargs)
    return bound.args, bound.kwargs


def _placement(aval: jax.ShapeDtypeStruct) -> Any:
    """What of an argument's placement changes the program: its sharding over several devices
    (a numpy array, a jax array on the default device and a ShapeDtypeStruct are all one)."""
    sharding = getattr(aval, "sharding", None)
    return sharding if sharding is not None and len(sharding.device_set) > 1 else None


def split_args(args: tuple, kwargs: dict) -> tuple[Signature, list]:
    leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs)))
    static = tuple((i, x) for i, x in enumerate(leaves) if not _is_dynamic(x))
    dynamic = [x for x in leaves if _is_dynamic(x)]
    first = sum(_is_dynamic(x) for x in jax.tree.leaves(args[0])) if args else 0
    return Signature(treedef, static, tuple(_aval(x) for x in dynamic), first), dynamic


def root_modules(fun: Callable, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """`(label, module)` for the outermost callable Equinox modules among the arguments."""
    try:
        bound = dict(inspect.signature(fun).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        bound = {f"args[{i}]": a for i, a in enumerate(args)} | dict(kwargs)
    found = []
    for name, value in bound.items():  # into non-callable containers (a TrainState holding the model)
        paths = jax.tree_util.tree_flatten_with_path(value, is_leaf=_callable_module)[0]
        found += [(name + jax.tree_util.keystr(path), leaf) for path, leaf in paths if _callable_module(leaf)]
    return found


def _callable_module(x: Any) -> bool:
    return isinstance(x, eqx.Module) and callable(x)


def _root_of(module: Any, call: Callable) -> tuple[Any, Callable]:
    """The module and call to plan: a decorated module's original call, a wrapper's module."""
    found = config_of(module)
    return (found[2], found[1]) if found is not None else (module, call)


class _Box:
    """Set when the step is traced: the static part of its output, and the context that saw its
    module calls."""

    value: Any = None
    context: _intercept.StepContext | None = None

    @property
    def calls(self) -> int:
        return 0 if self.context is None else self.context.calls


_TRACE_LOCK = threading.RLock()


def traced_once(trace: Callable[[], Any], box: _Box, expected: int | None) -> Any:
    """`trace()` (which traces the step), checked: every module call must have been seen
    (`expected` of them, or at least one). A step that calls its modules inside its own
    `jax.jit`/`eqx.filter_jit`/`jax.checkpoint` function may reuse a trace JAX cached under
    another plan; then JAX's caches are cleared (`jax.clear_caches()`) and it is traced again.
    Traces are serialised, so that no other plan's trace refills those caches meanwhile."""
    with _TRACE_LOCK:
        out = trace()
        if box.calls == expected or (expected is None and box.calls):
            return out
        jax.clear_caches()
        out = trace()
    if expected is not None and box.calls != expected:
        raise RuntimeError(
            f"smartremat.filter_jit: the step called its modules {box.calls} times in this trace and "
            f"{expected} times when it was planned. A step must make the same module calls on every "
            "trace (no Python-side randomness or state deciding which modules run).")
    return out


def _label(module: Any, owners: dict[int, str], roots: list[tuple[str, Any]], seen: dict) -> str:
    """The argument a traced module came from: the one its arrays were taken from (through
    `jax.grad`'s tracers), else the one of the same class and structure, else `call<k>`."""
    leaves = [x for x in jax.tree.leaves(module) if isinstance(x, jax.core.Tracer)]
    names = {owners.get(id(_jax_private.differentiated_from(x))) for x in leaves} - {None}
    if len(names) != 1:
        structure = jax.tree.structure(module)
        names = {n for n, m in roots if type(m) is type(module) and jax.tree.structure(m) == structure}
    name = names.pop() if len(names) == 1 else f"call{len(seen)}"
    seen[name] = seen.get(name, 0) + 1
    return name if seen[name] == 1 else f"{name}#{seen[name]}"


def _traced(fun: Callable, sig: Signature, context: Callable[..., _intercept.StepContext], box: _Box) -> Callable:
    """`f(*dynamic)`: the step on the rebuilt arguments, its module calls handed to
    `context(args, kwargs)`; returns the array part of the output (the rest goes to `box`)."""

    def f(*dynamic):
        args, kwargs = sig.rebuild(dynamic)
        box.context = context(args, kwargs)
        with _intercept.active(box.context):
            out = fun(*args, **kwargs)
        arrays, box.value = eqx.partition(out, eqx.is_array)
        return arrays

    return f


def _record(fun: Callable, sig: Signature, roots: list[tuple[str, Any]]) -> list[RootCall]:
    """Trace the step once (abstractly) and record each call of an argument module."""
    calls: list[RootCall] = []
    seen: dict = {}
    owners: dict[int, str] = {}

    def on_root(module, call, args, kwargs):
        label = _label(module, owners, roots, seen)
        module, call = _root_of(module, call)
        calls.append(RootCall(label, call, make_spec(module, args, kwargs)))
        return call(module, *args, **kwargs)

    def context(args, kwargs):  # the traced arguments: which input arrays belong to which module
        owners.clear()
        for name, m in root_modules(fun, args, kwargs):
            owners.update({id(x): name for x in jax.tree.leaves(m) if isinstance(x, jax.core.Tracer)})
        return _intercept.StepContext(classes, on_root)

    classes = frozenset(type(m) for _, m in roots)
    with _intercept.installed(classes), mesh_context(sig.avals), warnings.catch_warnings():
        # under an Auto mesh the module calls show no sharding: the step's compiles will (see the plan's note)
        warnings.filterwarnings("ignore", message="smartremat sees a device mesh")
        box = _Box()
        f = _traced(fun, sig, context, box)
        traced_once(lambda: (calls.clear(), seen.clear(), jax.make_jaxpr(f)(*sig.avals)), box, None)
    return calls


def _applying(classes: frozenset, assignments: tuple) -> Callable[[], _intercept.StepContext]:
    """A fresh context (per trace) running the `k`-th module call under `assignments[k]`."""

    def make(*_: Any) -> _intercept.StepContext:
        count = [0]

        def on_root(module, call, args, kwargs):
            k = count[0]
            count[0] += 1
            if k >= len(assignments):
                raise RuntimeError(
                    "smartremat.filter_jit: the step called its modules more times than when it was "
                    f"planned ({len(assignments)}). A step must make the same module calls on every "
                    "trace (no Python-side randomness or state deciding which modules run).")
            module, call = _root_of(module, call)
            return run(module, call, assignments[k], args, kwargs)

        return _intercept.StepContext(classes, on_root)

    return make


_FIGURES: KeyedCache[StepFigures] = KeyedCache()


def lower_step(fun: Callable, sig: Signature, entry_of: tuple, donate: str) -> tuple[Any, _Box]:
    """The step lowered with `(classes, assignments)` applied: `(jax Lowered, output box)`."""
    classes, assignments = entry_of
    box = _Box()
    f = _traced(fun, sig, _applying(classes, assignments), box)
    with _intercept.installed(classes), mesh_context(sig.avals), quiet_donation():
        jitted = jax.jit(f, donate_argnums=sig.donated(donate))
        return traced_once(lambda: jitted.lower(*sig.avals), box, len(assignments)), box


@contextlib.contextmanager
def quiet_donation() -> Iterator[None]:
    """As `eqx.filter_jit(donate="all")` does: donated inputs that no output can reuse (the batch)
    are fine, not worth a warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        yield


def figures_of(compiled: Any) -> StepFigures:
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return StepFigures(int(m.temp_size_in_bytes), float((cost or {}).get("flops", 0.0)),
                       int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                       int(m.alias_size_in_bytes), int(m.generated_code_size_in_bytes))


def step_figures(fun: Callable, sig: Signature, entry_of: tuple, donate: str) -> StepFigures:
    """Figures of the compiled step, cached by step, signature, plan, donation, backend and flags."""
    from ._verify import _assignment_key

    key = (fun, sig.key(), tuple(_assignment_key(a) for a in entry_of[1]), donate, *environment_key())
    return _FIGURES.get(key, lambda: figures_of(_compile(lower_step(fun, sig, entry_of, donate)[0])))


def _compile(lowered: Any) -> Any:
    with quiet_donation():
        return lowered.compile()


def joined_model(models: list[_planner.Model], labels: list[str]) -> _planner.Model:
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
    return _planner.Model(tuple(calls), tuple(profiles), tuple(stages), fixed, tuple(owner), tuple(menus))


def split_assignment(model: _planner.Model, choice: tuple[int, ...], labels: list[str]) -> tuple:
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
    """Record the module calls, build and join their models, verify candidates on the step."""
    t0 = time.perf_counter()
    calls = _record(fun, sig, roots)
    if not calls:
        raise ValueError(_no_module_call(fun, roots, "smartremat.filter_jit"))
    labels = [c.label for c in calls]
    model = joined_model([_planner.build_model(c.call, c.spec, c.spec.rebuild(c.spec.dynamic)[0], config)
                          for c in calls], labels)
    classes = frozenset(type(m) for _, m in roots)
    stages = model.stages

    name = "smartremat.filter_jit"

    def measure(choice):
        f = step_figures(fun, sig, (classes, split_assignment(model, choice, labels)), options.donate)
        return f.temp, f.flops

    none = (0,) * len(stages)
    base = step_figures(fun, sig, (classes, split_assignment(model, none, labels)), options.donate)
    if options.auto:
        budget = auto_budget(sig, base, name)
        config = dataclasses.replace(config, budget_bytes=budget, budget_mb=budget / MB)
    # the rest of the step (loss, update, optimizer state) calibrates the model at no remat
    model = dataclasses.replace(model, fixed_bytes=max(base.temp - peak_of(stages, none), 0))
    lowest = min_peak(stages)
    sol = solve(stages, config.budget_bytes - model.fixed_bytes) or lowest
    sol, compiled = _planner.verified(stages, config, measure, lambda floor: _too_low(fun, config, floor, name, options.auto),
                                      sol, lowest)
    plan = _planner.assemble(model, config, sol, lowest, compiled, time.perf_counter() - t0,
                             _signature(fun, sig))
    if any(shardings_hidden(c.spec) for c in calls) and any(_sharded(a) for a in sig.avals):
        plan = dataclasses.replace(plan, notes=plan.notes + (HIDDEN_NOTE,))
    return Entry(plan, split_assignment(model, sol.choice, labels), classes, sig)


HIDDEN_NOTE = (
    "the step's arguments are sharded over several devices, but inside `jit` JAX hides the shardings "
    "of the module's values (a mesh with Auto axes): smartremat's predicted figures count one device "
    "doing all the work, while the compiled figures, which chose this plan, are per device")


def _sharded(aval: jax.ShapeDtypeStruct) -> bool:
    sharding = getattr(aval, "sharding", None)
    return sharding is not None and len(sharding.device_set) > 1


def _signature(fun: Callable, sig: Signature) -> str:
    import hashlib

    text = repr((getattr(fun, "__qualname__", repr(fun)), str(sig.treedef),
                 [(a.shape, str(a.dtype)) for a in sig.avals], jax.default_backend()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _too_low(fun: Callable, config: _planner.Config, floor: int, name: str, auto: bool) -> ValueError:
    up = -(-floor * 100 // MB) / 100
    asked = f'"auto"` ({config.budget_mb:.1f} MB of the device left for it)' if auto else f"{config.budget_mb:g})`"
    return ValueError(
        f"`{name}(budget_mb={asked} is below the lowest temp memory any remat plan reaches "
        f"for the step `{getattr(fun, '__qualname__', fun)}` on these arguments: {floor / MB:.3f} MB (compiled "
        f"temp bytes of the whole step, per device). Raise `budget_mb` to at least {up:.2f}, lower the "
        "batch size, or shard the batch over more devices.")


def _no_module_call(fun: Callable, roots: list[tuple[str, Any]], name: str) -> str:
    found = ", ".join(f"{n} ({type(m).__name__})" for n, m in roots) or "none"
    return (
        f"`{name}` found no call of an Equinox module among the arguments of "
        f"`{getattr(fun, '__qualname__', fun)}` (modules among its arguments: {found}). It plans the "
        "modules the step calls (`model(x)`, possibly under `jax.vmap` or `eqx.filter_grad`): pass the "
        "model as an argument of the step and call it there, or use `eqx.filter_jit` for a step "
        "without one.")


class PlannedStep:
    """A training step planned by `smartremat.filter_jit`: called like `eqx.filter_jit(step)`.

    Plans once per argument signature (shapes, dtypes, shardings, static values); after that a
    call runs the compiled step, with no tracing.
    """

    def __init__(self, fun: Callable, config: _planner.Config, options: StepOptions):
        self.__wrapped__ = fun
        self.__name__ = getattr(fun, "__name__", "step")
        self.__doc__ = getattr(fun, "__doc__", None)
        self.config, self.options = config, options
        self._entries: KeyedCache[tuple[Entry, Any, _Box]] = KeyedCache()

    def _entry(self, args: tuple, kwargs: dict) -> tuple[tuple[Entry, Any, _Box], list]:
        args, kwargs = bind(self.__wrapped__, args, kwargs)
        sig, dynamic = split_args(args, kwargs)
        traced = any(isinstance(x, jax.core.Tracer) for x in dynamic)
        key = (sig.key(), traced, *environment_key())
        return self._entries.get(key, lambda: self._make(sig, args, kwargs, traced)), dynamic

    def _make(self, sig: Signature, args: tuple, kwargs: dict, traced: bool) -> tuple[Entry, Any, _Box]:
        roots = root_modules(self.__wrapped__, args, kwargs)
        entry = plan_step(self.__wrapped__, sig, roots, self.config, self.options)
        if traced:  # called inside an outer jit: the step is inlined there
            return entry, None, _Box()
        lowered, box = lower_step(self.__wrapped__, sig, (entry.classes, entry.assignments), self.options.donate)
        return entry, _compile(lowered), box

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        (entry, compiled, box), dynamic = self._entry(args, kwargs)
        if compiled is None:
            f = _traced(self.__wrapped__, entry.sig, _applying(entry.classes, entry.assignments), box)
            with _intercept.installed(entry.classes):
                out = traced_once(lambda: f(*dynamic), box, len(entry.assignments))
        else:
            out = compiled(*dynamic)
        return eqx.combine(out, box.value)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Plan (if not yet) and lower the planned step, as `eqx.filter_jit(step).lower(...)`:
        `.compile().memory_analysis()` then gives the compiler's figures of the step that runs."""
        (entry, _, _), _ = self._entry(args, kwargs)
        lowered, box = lower_step(self.__wrapped__, entry.sig, (entry.classes, entry.assignments), self.options.donate)
        return Lowered(lowered, entry.sig, box, self.__wrapped__)

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The `Plan` for these arguments (made on first use): what `smartremat.explain` returns."""
        return self._entry(args, kwargs)[0][0].plan


class Lowered:
    """The lowered planned step: `.compile()` gives a `Compiled`; `.as_text()` its StableHLO."""

    def __init__(self, lowered: Any, sig: Signature, box: _Box, fun: Callable):
        self.lowered, self._sig, self._box, self._fun = lowered, sig, box, fun

    def as_text(self) -> str:
        return self.lowered.as_text()

    def compile(self) -> Compiled:
        return Compiled(_compile(self.lowered), self._sig, self._box, self._fun)


class Compiled:
    """The compiled planned step: called with the step's arguments; `memory_analysis()` and
    `cost_analysis()` are the compiler's (per device when sharded)."""

    def __init__(self, compiled: Any, sig: Signature, box: _Box, fun: Callable):
        self.compiled, self._sig, self._box, self._fun = compiled, sig, box, fun

    def memory_analysis(self) -> Any:
        return self.compiled.memory_analysis()

    def cost_analysis(self) -> Any:
        return self.compiled.cost_analysis()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        sig, dynamic = split_args(*bind(self._fun, args, kwargs))
        if sig.key()[:2] != self._sig.key()[:2]:
            raise ValueError("This compiled step was lowered for other arguments (structure or static "
                             "values); lower and compile it for these.")
        return eqx.combine(self.compiled(*dynamic), self._box.value)


@dataclass(frozen=True)
class StepOptions:
    """`filter_jit`'s own options: an automatic budget, and which arguments are donated."""

    auto: bool = False
    donate: str = "none"


_DONATE = ("none", "all", "all-except-first")


def filter_jit(fun: Callable | None = None, *, budget_mb: float | str, donate: str = "none",
               policies: Any = None, calibrate: bool = True, scan_segments: int = 2,
               nested: bool = True) -> Any:
    """`eqx.filter_jit` for a whole training step, with remat planned so that it fits `budget_mb`.

    **Arguments:**

    - `fun`: the training step, e.g. `step(model, opt_state, x, y)` computing the loss, its
      gradient (`eqx.filter_grad`, `jax.grad`, ...) and the optimizer update. Arrays in its
      arguments are traced, everything else is static, as with `eqx.filter_jit`.
    - `budget_mb`: the cap (MB = 2**20 bytes) on the compiled step's temp bytes
      (`.lower(...).compile().memory_analysis().temp_size_in_bytes`, per device when the arguments
      are sharded): everything the step allocates besides its arguments and outputs. `"auto"`:
      the device's memory (`memory_stats()["bytes_limit"]`) less 5% reserve, the step's
      arguments, its outputs (net of donated buffers) and its code.
    - `donate`: as for `eqx.filter_jit`: `"none"`, `"all"` or `"all-except-first"`. Donating the
      parameters and optimizer state lets their updates reuse the old buffers; without it, XLA may
      lay temporaries out in the (not yet written) output buffers, and the temp bytes understate
      what the step adds to memory.
    - `policies`, `calibrate`, `scan_segments`, `nested`: as for `smartremat.smartremat`.

    **Returns:**

    A callable like `eqx.filter_jit(fun)`, with `.lower(*args)` and `.plan(*args)`. The Equinox
    modules among the arguments (outermost ones, decorated ones included) are planned: every
    candidate plan is compiled as the whole step and the cheapest whose temp bytes fit is kept.
    """
    auto = isinstance(budget_mb, str) and budget_mb == "auto"
    name = "smartremat.filter_jit"
    config = make_config(1.0 if auto else budget_mb, policies=policies, calibrate=calibrate,
                         scan_segments=scan_segments, nested=nested, name=name)
    if donate not in _DONATE:
        raise ValueError(f"`{name}(donate=...)` should be one of {', '.join(map(repr, _DONATE))} (as for "
                         f"`eqx.filter_jit`), not {donate!r}.")
    options = StepOptions(auto, donate)
    if fun is None:
        return lambda f: PlannedStep(_check_fun(f, name), config, options)
    return PlannedStep(_check_fun(fun, name), config, options)


def _check_fun(fun: Any, name: str) -> Callable:
    if not callable(fun):
        raise TypeError(f"`{name}(fun=...)` should be your training step, a function, not "
                        f"{type(fun).__name__} {fun!r:.60}; e.g. `{name}(step, budget_mb=512)`.")
    return fun
