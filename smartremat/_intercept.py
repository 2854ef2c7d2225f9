"""See the calls of a training step's Equinox modules while JAX traces the step.

`smartremat.filter_jit` plans the modules among a step's arguments, but the step calls them
itself, usually on copies rebuilt by `eqx.filter_grad` (new objects, same classes). So while the
step is traced, the `__call__` of each such class is replaced by `_hook`, which hands the call of
a module of that class to the tracing thread's `StepContext` (to record it, or to run it under
its plan) and otherwise calls the original. Instances, their fields, `isinstance` and the
gradient pytree are untouched; the classes get their own `__call__` back when the step is traced.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

_local = threading.local()
_lock = threading.RLock()
_MISSING = object()
# class -> [its own `__call__` entry (or _MISSING), how many installs hold it]
_installed: dict[type, list] = {}


@dataclass
class StepContext:
    """What the thread tracing a step does with a call of one of `roots` (the classes of the
    modules among the step's arguments): `on_root(module, call, args, kwargs)`. Calls made
    inside a root call are the root's own business (its blocks), not roots. `calls` counts the
    root calls this trace made (a step whose inner `jit` reused an earlier trace makes none)."""

    roots: frozenset
    on_root: Callable[[Any, Callable, tuple, dict], Any]
    depth: int = field(default=0)
    calls: int = field(default=0)


def in_root_call() -> bool:
    """Whether this thread is inside a module call that `smartremat.filter_jit` is planning."""
    ctx = getattr(_local, "context", None)
    return ctx is not None and ctx.depth > 0


def _original(cls: type) -> Callable:
    """`cls.__call__` as it is without smartremat's hooks (whatever order classes were patched in)."""
    for c in cls.__mro__:
        entry = _installed[c][0] if c in _installed else c.__dict__.get("__call__", _MISSING)
        if entry is not _MISSING and not getattr(entry, "_smartremat_hook", False):
            return entry.__get__(None, c) if hasattr(entry, "__get__") else entry  # as `c.__call__` reads
    raise TypeError(f"{cls.__name__} has no `__call__`")


def _hook_for(cls: type) -> Callable:
    """`cls`'s replacement `__call__`: a root call goes to the context, any other to `cls`'s own
    (so `super().__call__` from a subclass reaches the base class's original)."""

    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = _original(cls)
        ctx = getattr(_local, "context", None)
        if ctx is None or ctx.depth or type(self) not in ctx.roots:
            return call(self, *args, **kwargs)
        ctx.depth += 1
        ctx.calls += 1
        try:
            return ctx.on_root(self, call, args, kwargs)
        finally:
            ctx.depth -= 1

    hook._smartremat_hook = True  # type: ignore[attr-defined]
    return hook


@contextlib.contextmanager
def installed(classes: frozenset) -> Iterator[None]:
    """Route the calls of `classes` through their hooks while the block runs (re-entrant)."""
    done: list[type] = []
    try:
        with _lock:
            for cls in classes:
                if cls not in _installed:
                    _installed[cls] = [cls.__dict__.get("__call__", _MISSING), 0]
                    cls.__call__ = _hook_for(cls)
                _installed[cls][1] += 1
                done.append(cls)
        yield
    finally:
        with _lock:
            for cls in done:
                entry = _installed[cls]
                entry[1] -= 1
                if entry[1] == 0:  # restore first: a concurrent hook still finds the original
                    if entry[0] is _MISSING:
                        del cls.__call__
                    else:
                        cls.__call__ = entry[0]
                    del _installed[cls]


@contextlib.contextmanager
def active(context: StepContext) -> Iterator[StepContext]:
    """Make `context` this thread's while the step is traced."""
    previous = getattr(_local, "context", None)
    _local.context = context
    try:
        yield context
    finally:
        _local.context = previous
