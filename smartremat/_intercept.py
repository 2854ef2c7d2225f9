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
# class -> [its own `__call__` entry (or _MISSING), the call it had, how many installs hold it]
_installed: dict[type, list] = {}


@dataclass
class StepContext:
    """What the thread tracing a step does with a call of one of `roots` (the classes of the
    modules among the step's arguments): `on_root(module, call, args, kwargs)`. Calls made
    inside a root call are the root's own business (its blocks), not roots."""

    roots: frozenset
    on_root: Callable[[Any, Callable, tuple, dict], Any]
    depth: int = field(default=0)


def in_step() -> bool:
    """Whether this thread is tracing a step of `smartremat.filter_jit` right now."""
    return getattr(_local, "context", None) is not None


def _original(cls: type) -> Callable:
    for c in cls.__mro__:
        if c in _installed:
            return _installed[c][1]
    return cls.__call__


def _hook(self: Any, *args: Any, **kwargs: Any) -> Any:
    ctx = getattr(_local, "context", None)
    call = _original(type(self))
    if ctx is None or ctx.depth or type(self) not in ctx.roots:
        return call(self, *args, **kwargs)
    ctx.depth += 1
    try:
        return ctx.on_root(self, call, args, kwargs)
    finally:
        ctx.depth -= 1


@contextlib.contextmanager
def installed(classes: frozenset) -> Iterator[None]:
    """Route the calls of `classes` through `_hook` while the block runs (re-entrant)."""
    with _lock:
        for cls in classes:
            if cls not in _installed:
                _installed[cls] = [cls.__dict__.get("__call__", _MISSING), cls.__call__, 0]
                cls.__call__ = _hook
            _installed[cls][2] += 1
    try:
        yield
    finally:
        with _lock:
            for cls in classes:
                entry = _installed[cls]
                entry[2] -= 1
                if entry[2] == 0:
                    del _installed[cls]
                    if entry[0] is _MISSING:
                        del cls.__call__
                    else:
                        cls.__call__ = entry[0]


@contextlib.contextmanager
def active(context: StepContext) -> Iterator[StepContext]:
    """Make `context` this thread's while the step is traced."""
    previous = getattr(_local, "context", None)
    _local.context = context
    try:
        yield context
    finally:
        _local.context = previous
