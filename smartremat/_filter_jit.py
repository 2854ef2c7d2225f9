"""`smartremat.filter_jit(step, budget_mb=...)`: `eqx.filter_jit` for a training step whose modules
are planned so that the compiled step fits the budget."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Literal, get_args

import equinox as eqx
from jax.core import Tracer

from . import _intercept
from ._model import Config
from ._cache import KeyedCache
from ._env import environment_key
from ._decorator import make_config
from ._plan import Plan
from ._step import (Box, Signature, applying, bind, compiled_step, lower_step, quick_split, root_modules,
                    split_args, static_split, step_name, traced, traced_once)
from ._step_plan import Entry, StepOptions, plan_step


class PlannedStep:
    """A training step planned by `smartremat.filter_jit`: called like `eqx.filter_jit(step)`. Plans
    once per argument signature (shapes, dtypes, shardings, static values); after that a call runs
    the compiled step, with no tracing."""

    def __init__(self, fun: Callable, config: Config, options: StepOptions):
        self.__wrapped__ = fun
        self.__name__ = step_name(fun).rsplit(".", 1)[-1]
        self.__doc__ = getattr(fun, "__doc__", None)
        self.config, self.options = config, options
        self._entries: KeyedCache[tuple[Entry, Any, Box]] = KeyedCache()
        self._quick: KeyedCache[tuple[Entry, Any, Box]] = KeyedCache()  # the same, by `quick_split`'s key
        self._bound: tuple = ()  # the instance of a method, its first argument

    def _entry(self, args: tuple, kwargs: dict) -> tuple[tuple[Entry, Any, Box], list]:
        args, kwargs = bind(self.__wrapped__, (*self._bound, *args), kwargs)
        quick, dynamic = quick_split(self.__wrapped__, args, kwargs)
        if quick is None:
            return self._signed(args, kwargs)
        return self._quick.get((quick, *environment_key()), lambda: self._signed(args, kwargs)[0]), dynamic

    def _signed(self, args: tuple, kwargs: dict) -> tuple[tuple[Entry, Any, Box], list]:
        sig, dynamic = split_args(self.__wrapped__, args, kwargs)
        traced = any(isinstance(x, Tracer) for x in dynamic)
        key = (sig.key(), traced, *environment_key())
        return self._entries.get(key, lambda: self._make(sig, args, kwargs, traced)), dynamic

    def _make(self, sig: Signature, args: tuple, kwargs: dict, traced: bool) -> tuple[Entry, Any, Box]:
        roots = root_modules(self.__wrapped__, args, kwargs)
        entry = plan_step(self.__wrapped__, sig, roots, self.config, self.options)
        if traced:  # called inside an outer jit: the step is inlined there
            return entry, None, Box()
        compiled, box = compiled_step(sig, (entry.classes, entry.assignments), self.options.donate)
        return entry, compiled, box

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        (entry, compiled, box), dynamic = self._entry(args, kwargs)
        if compiled is None:
            f = traced(entry.sig, applying(entry.classes, entry.assignments), box)
            with _intercept.installed(entry.classes):
                out = traced_once(lambda: f(*dynamic), box, len(entry.assignments))
        else:
            out = compiled(*dynamic)
        return eqx.combine(out, box.value)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Plan (if not yet) and lower the planned step, as `eqx.filter_jit(step).lower(...)`:
        `.compile().memory_analysis()` then gives the compiler's figures of the step that runs."""
        (entry, _, _), _ = self._entry(args, kwargs)
        entry_of = (entry.classes, entry.assignments)
        lowered, box = lower_step(entry.sig, entry_of, self.options.donate)
        return Lowered(lowered, entry.sig, box, self.__wrapped__, self._bound,
                       lambda: compiled_step(entry.sig, entry_of, self.options.donate)[0])

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The `Plan` for these arguments (made on first use): what `smartremat.explain` returns."""
        return self._entry(args, kwargs)[0][0].plan

    def __get__(self, instance: Any, owner: Any = None) -> PlannedStep:
        """As a method (`@smartremat.filter_jit(...)` on a method, as `eqx.filter_jit` allows): a
        copy bound to `instance`, its first argument (in calls, `.lower` and `.plan`); plans shared."""
        if instance is None:
            return self
        bound = copy.copy(self)
        bound._bound = (instance,)
        return bound


class Lowered:
    """The lowered planned step: `.compile()` gives a `Compiled` (the executable the step's calls
    run, compiled once: after a call it compiles nothing); `.as_text()` its StableHLO."""

    def __init__(self, lowered: Any, sig: Signature, box: Box, fun: Callable, bound: tuple,
                 executable: Callable[[], Any]):
        self.lowered, self._sig, self._box, self._fun, self._bound = lowered, sig, box, fun, bound
        self._executable = executable  # the step's cached executable (`_step.compiled_step`)

    def as_text(self) -> str:
        return self.lowered.as_text()

    def compile(self) -> Compiled:
        return Compiled(self._executable(), self._sig, self._box, self._fun, self._bound)


class Compiled:
    """The compiled planned step: called with the step's arguments; `memory_analysis()` and
    `cost_analysis()` are the compiler's (per device when sharded)."""

    def __init__(self, compiled: Any, sig: Signature, box: Box, fun: Callable, bound: tuple = ()):
        self.compiled, self._sig, self._box, self._fun, self._bound = compiled, sig, box, fun, bound
        self._static_key = sig.key()[:2]

    def memory_analysis(self) -> Any:
        return self.compiled.memory_analysis()

    def cost_analysis(self) -> Any:
        return self.compiled.cost_analysis()

    def as_text(self) -> str:
        """The compiled (optimised) HLO, as `jax.stages.Compiled.as_text`."""
        return self.compiled.as_text()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key, dynamic = static_split(self._fun, *bind(self._fun, (*self._bound, *args), kwargs))
        if key != self._static_key:
            raise ValueError("This compiled step was lowered for other arguments (structure or static "
                             "values); lower and compile it for these.")
        return eqx.combine(self.compiled(*dynamic), self._box.value)


Donate = Literal["none", "all", "all-except-first"]


def filter_jit(fun: Callable | None = None, *, budget_mb: float | Literal["auto"], donate: Donate = "none",
               policies: Any = None, calibrate: bool = True, scan_segments: int = 2,
               nested: bool = True, tune: bool = False) -> Any:
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
    - `tune`: as for `smartremat.smartremat`, timing the whole step (on synthetic arguments of
      its shapes, dtypes and shardings, never yours; donated ones copied for each run, so a
      donated argument takes device memory twice more while timing) instead of a gradient.

    **Returns:**

    A callable like `eqx.filter_jit(fun)`, with `.lower(*args)` and `.plan(*args)`; on a method
    of a class it binds as a method does (`self` is the step's first argument). The Equinox
    modules among the arguments (outermost ones, decorated ones included) are planned: every
    candidate plan is compiled as the whole step and the cheapest whose temp bytes fit is kept.
    """
    auto = isinstance(budget_mb, str) and budget_mb == "auto"
    name = "smartremat.filter_jit"
    config = make_config(1.0 if auto else budget_mb, policies=policies, calibrate=calibrate,
                         scan_segments=scan_segments, nested=nested, tune=tune, name=name)
    if donate not in get_args(Donate):
        raise ValueError(f"`{name}(donate=...)` should be one of {', '.join(map(repr, get_args(Donate)))} "
                         f"(as for `eqx.filter_jit`), not {donate!r}.")
    options = StepOptions(auto, donate)
    make = lambda f: PlannedStep(_check_fun(f, name), config, options)
    return make if fun is None else make(fun)


def _check_fun(fun: Any, name: str) -> Callable:
    if not callable(fun):
        raise TypeError(f"`{name}(fun=...)` should be your training step, a function, not "
                        f"{type(fun).__name__} {fun!r:.60}; e.g. `{name}(step, budget_mb=512)`.")
    return fun
