"""A training step as smartremat traces and compiles it (for `smartremat.filter_jit`): its
arguments split as `eqx.filter_jit` splits them, its module calls recorded or run under a plan
(one assignment per module call), each candidate compiled as the whole step for its figures."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
from jax.core import Tracer
import numpy as np

from . import _intercept, _jax_private
from ._options import run
from ._cache import KeyedCache
from ._env import environment_key, measuring_options
from ._decorator import config_of
from ._profile import mesh_context
from ._refused import Refusal, compile_or_refuse, kept, raised
from ._verify import assignment_key
from ._spec import CallSpec, abstract, hashable, is_traced, make_spec, merge_leaves


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


def _aval(x: Any) -> jax.ShapeDtypeStruct:
    """Shape, dtype, weak type and (for a concrete array) the sharding it is placed with."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, Tracer):
        return abstract(x)
    if isinstance(x, jax.Array):  # typed PRNG keys (`jax.random.key`) have no `weak_type`
        # an array on the default device runs where the step runs, as under `jit`; one committed
        # to another device, or sharded over several, decides where the program runs
        several = len(x.sharding.device_set) > 1
        sharding = x.sharding if several or (x.committed and _placed(x.sharding)) else None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=getattr(x, "weak_type", False))
    return jax.ShapeDtypeStruct(np.shape(x), np.result_type(x))


@dataclass(frozen=True)
class Signature:
    """The step's arguments and the step itself (a callable Module may hold arrays, traced after
    the arguments') split as `eqx.filter_jit` splits them: arrays traced, the rest static."""

    treedef: Any
    static: tuple
    avals: tuple[jax.ShapeDtypeStruct, ...]
    first: int = 0  # how many of `avals` belong to the first argument

    def donated(self, donate: str) -> tuple[int, ...]:
        """`donate_argnums` of the flat step for `eqx.filter_jit`'s `donate=` setting (which
        donates the step's own arrays with the arguments after the first)."""
        start = {"none": len(self.avals), "all": 0, "all-except-first": self.first}[donate]
        return tuple(range(start, len(self.avals)))

    def key(self) -> tuple:
        return (self.treedef, tuple((i, hashable(x)) for i, x in self.static), tuple(
            (a.shape, str(a.dtype), getattr(a, "weak_type", False), _placement(a)) for a in self.avals))

    def rebuild(self, dynamic: tuple) -> tuple[tuple, dict, Callable]:
        """`(args, kwargs, step)` from the traced leaves."""
        return merge_leaves(self.treedef, self.static, dynamic)


def bind(fun: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call as `fun`'s signature binds it (as `eqx.filter_jit` does), so a keyword argument
    and the same one passed by position are one signature, and "first" means the first parameter."""
    try:
        bound = inspect.signature(fun).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return tuple(args), dict(kwargs)
    return bound.args, bound.kwargs


def _placed(sharding: Any) -> bool:
    """Whether a sharding decides where the program runs: several devices, or one not the default."""
    devices = sharding.device_set
    return len(devices) > 1 or next(iter(devices)) != jax.devices()[0]


def _placement(aval: jax.ShapeDtypeStruct) -> Any:
    """What of an argument's placement changes the program (see `_placed`), else `None`: a numpy
    array, a jax array on the default device and a ShapeDtypeStruct are all one."""
    sharding = getattr(aval, "sharding", None)
    return sharding if sharding is not None and _placed(sharding) else None


def split_args(fun: Callable, args: tuple, kwargs: dict) -> tuple[Signature, list]:
    leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs), fun))
    static = tuple((i, x) for i, x in enumerate(leaves) if not is_traced(x))
    dynamic = [x for x in leaves if is_traced(x)]
    first = sum(is_traced(x) for x in jax.tree.leaves(args[0])) if args else 0
    return Signature(treedef, static, tuple(_aval(x) for x in dynamic), first), dynamic


def static_split(fun: Callable, args: tuple, kwargs: dict) -> tuple[tuple, list]:
    """`(Signature.key()[:2], dynamic leaves)` of a call: its structure and static values, what
    a compiled step checks on each call (no avals made)."""
    leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs), fun))
    static = tuple((i, hashable(x)) for i, x in enumerate(leaves) if not is_traced(x))
    return (treedef, static), [x for x in leaves if is_traced(x)]


def _quick_leaf(x: Any) -> Any:
    """A leaf's part of `quick_split`'s key: what `Signature.key` reads of it, unprocessed."""
    if isinstance(x, Tracer):
        raise TypeError  # traced inside an outer `jit`: the full signature decides
    if isinstance(x, jax.Array):
        return x.shape, x.dtype, getattr(x, "weak_type", False), x.sharding, x.committed
    if isinstance(x, (np.ndarray, np.generic)):
        return "<numpy>", np.shape(x), x.dtype
    return hashable(x)  # a ShapeDtypeStruct is hashable as it is


def quick_split(fun: Callable, args: tuple, kwargs: dict) -> tuple[tuple | None, list]:
    """`(key, dynamic leaves)` of a call, the key read straight from the leaves (no avals made):
    calls with equal keys have equal `split_args` signatures, so a planned step finds its entry
    by it in a fraction of the time (the per-call cost of a step over a model of many leaves).
    The key is None where a leaf is a tracer (then only `split_args` decides)."""
    leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs), fun))
    dynamic = [x for x in leaves if is_traced(x)]
    try:
        return (treedef, tuple(map(_quick_leaf, leaves))), dynamic
    except TypeError:
        return None, dynamic


def step_name(fun: Any) -> str:
    """The step as a user would name it: a function's qualified name, through `functools.partial`,
    Equinox's gradient wrappers and bound methods (never a repr with a memory address)."""
    for _ in range(8):
        inner = fun.func if isinstance(fun, functools.partial) else getattr(fun, "__wrapped__", None)
        if inner is None and isinstance(fun, eqx.Module) and not hasattr(fun, "__qualname__"):
            inner = getattr(fun, "_fun", None)
        if inner is None:
            break
        fun = inner
    name = getattr(fun, "__qualname__", None)
    return name if isinstance(name, str) else type(fun).__name__


def root_modules(fun: Callable, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """`(label, module)` for the outermost callable Equinox modules in the arguments and the step
    itself (a bound method's module, a `functools.partial`'s arguments)."""
    try:
        bound = dict(inspect.signature(fun).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        bound = {f"args[{i}]": a for i, a in enumerate(args)} | dict(kwargs)
    found = []
    for name, value in [*bound.items(), *_step_parts(fun)]:  # into containers (a TrainState holding the model)
        paths = jax.tree_util.tree_flatten_with_path(value, is_leaf=_callable_module)[0]
        found += [(name + jax.tree_util.keystr(path), leaf) for path, leaf in paths if _callable_module(leaf)]
    return found


def _step_parts(fun: Any, depth: int = 0) -> list[tuple[str, Any]]:
    """What the step carries besides its arguments: a partial's arguments, a callable Module's
    fields (`eqx.filter_value_and_grad(loss)`, a bound method's `__self__`, named `self`)."""
    if depth > 4:
        return []
    if isinstance(fun, functools.partial):
        return ([(f"partial.args[{i}]", a) for i, a in enumerate(fun.args)]
                + [(f"partial.{k}", v) for k, v in fun.keywords.items()] + _step_parts(fun.func, depth + 1))
    if isinstance(fun, eqx.Module):
        parts = []
        for f in dataclasses.fields(fun):
            value = getattr(fun, f.name, None)
            name = "self" if f.name == "__self__" else f.name
            model = _callable_module(value) and not _function_wrapper(value)
            parts += [(name, value)] if model or not callable(value) else _step_parts(value, depth + 1)
        return parts
    owner = getattr(fun, "__self__", None)
    return [("self", owner)] if isinstance(owner, eqx.Module) else []


def _function_wrapper(x: Any) -> bool:
    """Equinox's own callable Modules that wrap a function (`filter_grad`, `filter_jit`, a bound
    method, `Partial`): the step, looked through, never a model to plan."""
    module = type(x).__module__
    return module.startswith("equinox.") and not module.startswith("equinox.nn")


def nested_modules(roots: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """`(label, module)` for every callable Equinox module inside the roots (the roots first), which
    a step training its model through a method (`model.loss(x, y)`) calls directly."""
    found = list(roots)
    for label, root in roots:
        paths = jax.tree_util.tree_flatten_with_path(root, is_leaf=lambda x: x is not root and _callable_module(x))[0]
        for path, leaf in paths:
            if leaf is not root and _callable_module(leaf):
                found += nested_modules([(label + jax.tree_util.keystr(path), leaf)])
    return found


def root_classes(roots: list[tuple[str, Any]]) -> frozenset:
    """The classes whose calls, made outside another planned call, `smartremat.filter_jit` plans."""
    return frozenset(type(m) for _, m in nested_modules(roots))


def _callable_module(x: Any) -> bool:
    return isinstance(x, eqx.Module) and callable(x)


def _root_of(module: Any, call: Callable) -> tuple[Any, Callable]:
    """The module and call to plan: a decorated module's original call, a wrapper's module."""
    found = config_of(module)
    return (found[2], found[1]) if found is not None else (module, call)


class Box:
    """Set when the step is traced: its output's static part, the context that saw its module calls."""

    value: Any = None
    context: _intercept.StepContext | None = None

    @property
    def calls(self) -> int:
        return 0 if self.context is None else self.context.calls


_TRACE_LOCK = threading.RLock()


def traced_once(trace: Callable[[], Any], box: Box, expected: int | None) -> Any:
    """`trace()` (which traces the step), checked: `expected` module calls (or at least one) seen.
    A step that calls its modules inside its own `jit`/`checkpoint` may reuse a trace JAX cached
    under another plan: then JAX's caches are cleared and it is traced again. Traces are
    serialised, so that no other plan's trace refills those caches meanwhile."""
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


def _leaf_ids(module: Any) -> frozenset:
    """The step's own input tracers a traced module's arrays are (through `jax.grad`'s tracers)."""
    return frozenset(id(_jax_private.differentiated_from(x)) for x in jax.tree.leaves(module) if isinstance(x, Tracer))


def _label(module: Any, places: dict[frozenset, str], roots: list[tuple[str, Any]], seen: dict) -> str:
    """Where a traced module came from: the argument (or the module inside one) whose arrays it
    holds, else the one of the same class and structure, else `call<k>`."""
    ids = _leaf_ids(module)
    name = places.get(ids) if ids else None
    if name is None:
        structure = jax.tree.structure(module)
        names = {n for n, m in nested_modules(roots) if type(m) is type(module) and jax.tree.structure(m) == structure}
        name = names.pop() if len(names) == 1 else f"call{len(seen)}"
    seen[name] = seen.get(name, 0) + 1
    return name if seen[name] == 1 else f"{name}#{seen[name]}"


def traced(sig: Signature, context: Callable[..., _intercept.StepContext], box: Box) -> Callable:
    """`f(*dynamic)`: the step on the rebuilt arguments, its module calls handed to
    `context(fun, args, kwargs)`; returns the array part of the output (the rest goes to `box`)."""

    def f(*dynamic: Any) -> Any:
        args, kwargs, fun = sig.rebuild(dynamic)
        box.context = context(fun, args, kwargs)
        with _intercept.active(box.context):
            out = fun(*args, **kwargs)
        arrays, box.value = eqx.partition(out, eqx.is_array)
        return arrays

    return f


def record(sig: Signature, roots: list[tuple[str, Any]]) -> tuple[list[RootCall], Any]:
    """Trace the step once (abstractly) and record each call of a module among its arguments
    (or inside one, called from one of its methods); also returns the step's jaxpr (no remat)."""
    calls: list[RootCall] = []
    seen: dict = {}
    places: dict[frozenset, str] = {}

    def on_root(module: Any, call: Callable, args: tuple, kwargs: dict) -> Any:
        label = _label(module, places, roots, seen)
        module, call = _root_of(module, call)
        calls.append(RootCall(label, call, make_spec(module, args, kwargs)))
        return call(module, *args, **kwargs)

    def context(fun: Callable, args: tuple, kwargs: dict) -> _intercept.StepContext:
        places.clear()  # the traced arguments: which input arrays belong to which module
        for name, m in reversed(nested_modules(root_modules(fun, args, kwargs))):
            places.setdefault(_leaf_ids(m), name)
        return _intercept.StepContext(classes, on_root)

    classes = root_classes(roots)
    with _intercept.installed(classes), mesh_context(sig.avals), warnings.catch_warnings():
        # under an Auto mesh the module calls show no sharding: the step's compiles will (see the plan's note)
        warnings.filterwarnings("ignore", message="smartremat sees a device mesh")
        box = Box()
        f = traced(sig, context, box)
        jaxpr = traced_once(lambda: (calls.clear(), seen.clear(), jax.make_jaxpr(f)(*sig.avals))[2], box, None)
    return calls, jaxpr


def applying(classes: frozenset, assignments: tuple) -> Callable[[], _intercept.StepContext]:
    """A fresh context (per trace) running the `k`-th module call under `assignments[k]`."""

    def make(*_: Any) -> _intercept.StepContext:
        count = itertools.count()

        def on_root(module: Any, call: Callable, args: tuple, kwargs: dict) -> Any:
            k = next(count)
            if k >= len(assignments):
                raise RuntimeError(
                    "smartremat.filter_jit: the step called its modules more times than when it was "
                    f"planned ({len(assignments)}). A step must make the same module calls on every "
                    "trace (no Python-side randomness or state deciding which modules run).")
            module, call = _root_of(module, call)
            return run(module, call, assignments[k], args, kwargs)

        return _intercept.StepContext(classes, on_root)

    return make


_FIGURES: KeyedCache[StepFigures | Refusal] = KeyedCache()
#: The last few steps lowered, and compiled as they run: the step that runs is a candidate the
#: search (or `tune=True`) has already lowered, and on a backend whose measuring compiles are its
#: usual ones (`measuring_options()` empty: not the CPU), compiled.
_LOWERED: KeyedCache[tuple[Any, Box]] = KeyedCache(max_entries=8)
_COMPILED: KeyedCache[Any] = KeyedCache(max_entries=4)


def lower_step(sig: Signature, entry_of: tuple, donate: str) -> tuple[Any, Box]:
    """The step lowered with `(classes, assignments)` applied: `(jax Lowered, output box)`, once
    per `compiled_key` among the last few."""
    return _LOWERED.get(compiled_key(sig, entry_of, donate), lambda: _lowered(sig, entry_of, donate))


def compiled_step(sig: Signature, entry_of: tuple, donate: str) -> tuple[Any, Box]:
    """The step compiled as it runs (default options): `(executable, output box)`, once per
    `compiled_key` among the last few."""
    lowered, box = lower_step(sig, entry_of, donate)
    return _COMPILED.get(compiled_key(sig, entry_of, donate), lambda: compile_quietly(lowered)), box


def _lowered(sig: Signature, entry_of: tuple, donate: str) -> tuple[Any, Box]:
    classes, assignments = entry_of
    box = Box()
    f = traced(sig, applying(classes, assignments), box)
    with _intercept.installed(classes), mesh_context(sig.avals), quiet_donation():
        jitted = jax.jit(f, donate_argnums=sig.donated(donate))
        return traced_once(lambda: jitted.lower(*sig.avals), box, len(assignments)), box


_QUIET_LOCK = threading.Lock()
_quiet: list[contextlib.AbstractContextManager] = []  # the one filter context while any thread is quiet
_quiet_depth = [0]


@contextlib.contextmanager
def quiet_donation() -> Iterator[None]:
    """No warning about donated inputs that no output can reuse (the batch), as under
    `eqx.filter_jit(donate="all")`. Candidates are lowered and compiled in threads, and
    `warnings.catch_warnings` swaps a process-wide filter list, so the first thread in installs
    the filter and the last one out removes it."""
    with _QUIET_LOCK:
        if _quiet_depth[0] == 0:
            context = warnings.catch_warnings()
            context.__enter__()
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            _quiet.append(context)
        _quiet_depth[0] += 1
    try:
        yield
    finally:
        with _QUIET_LOCK:
            _quiet_depth[0] -= 1
            if _quiet_depth[0] == 0:
                _quiet.pop().__exit__(None, None, None)


def figures_of(compiled: Any) -> StepFigures:
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return StepFigures(int(m.temp_size_in_bytes), float((cost or {}).get("flops", 0.0)),
                       int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                       int(m.alias_size_in_bytes), int(m.generated_code_size_in_bytes))


def compiled_key(sig: Signature, entry_of: tuple, donate: str) -> tuple:
    """What a compiled step depends on: signature, each module call's plan, donation, backend and
    flags (a key for `step_figures` and `tune=True`'s times)."""
    return (sig.key(), tuple(assignment_key(a) for a in entry_of[1]), donate, *environment_key())


def step_figures(sig: Signature, entry_of: tuple, donate: str) -> StepFigures:
    """Figures of the compiled step, cached by `compiled_key` (a refusal for memory too: raised
    as `_refused.Refused`, and not compiled again)."""
    make = kept(lambda: figures_of(compile_or_refuse(lambda: _measured(sig, entry_of, donate))))
    return raised(_FIGURES.get(compiled_key(sig, entry_of, donate), make))


def _measured(sig: Signature, entry_of: tuple, donate: str) -> Any:
    """The step compiled with `measuring_options()`: where those are the usual ones, the
    executable the step runs (kept for it)."""
    options = measuring_options()
    if not options:
        return compiled_step(sig, entry_of, donate)[0]
    return compile_quietly(lower_step(sig, entry_of, donate)[0], options)


def compile_quietly(lowered: Any, options: dict[str, Any] | None = None) -> Any:
    """`lowered.compile(options)` without the warning about unusable donated buffers (JAX's own
    error where the device refuses it: the step that runs is the user's; `step_figures`, which
    measures, turns a refusal into `_refused.Refused`)."""
    with quiet_donation():
        return lowered.compile(options)
