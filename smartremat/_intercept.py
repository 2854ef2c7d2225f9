"""See the calls of particular Equinox modules while JAX traces, without touching the modules.

Nothing in the module tree is replaced, so the user's code observes what it does without
smartremat (`isinstance`, fields, methods, the gradient pytree). While a function is traced, the
`__call__` of each class of interest is a hook that hands a call to the thread's innermost
`BlockContext` (discovery records it, a plan runs it under its policy) when that one claims the
instance, else to its `StepContext` (`smartremat.filter_jit`'s root modules), else to the original.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax

from ._paths import get_at

_local = threading.local()
_lock = threading.RLock()
_MISSING = object()
_PASS = object()
# class -> [its own `__call__` entry (or _MISSING), how many installs hold it]
_installed: dict[type, list] = {}


@dataclass
class StepContext:
    """What the thread tracing a step does with a call of one of `roots` (the classes of the step's
    modules): `on_root(module, call, args, kwargs)`; calls inside a root call are not roots. `calls`
    counts this trace's root calls (none where the step's inner `jit` reused an earlier trace)."""

    roots: frozenset
    on_root: Callable[[Any, Callable, tuple, dict], Any]
    depth: int = 0
    calls: int = 0


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
    """`cls`'s replacement `__call__`: a claimed call goes to its context, any other to `cls`'s
    own (so `super().__call__` from a subclass reaches the base class's original)."""

    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = _original(cls)
        stack = getattr(_local, "blocks", None)
        if stack:
            out = stack[-1].dispatch(self, call, args, kwargs)
            if out is not _PASS:
                return out
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


def _leaf_shapes(tree: Any) -> tuple:
    return tuple(getattr(x, "shape", None) for x in jax.tree.leaves(tree))


class Target:
    """A sub-module instance a `BlockContext` claims, and what a copy rebuilt inside a transformation
    looks like: same class and structure, each leaf of the same shape or with the leading axis dropped
    (`eqx.combine` of a slice in a `jax.lax.scan` body, a `jax.vmap` over stacked modules)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj  # kept alive, so its id is not reused while the context lives
        self.type = type(obj)
        self.treedef = jax.tree.structure(obj)
        self.shapes = _leaf_shapes(obj)

    def like(self, obj: Any, treedef: Any, shapes: tuple) -> bool:
        if type(obj) is not self.type or treedef != self.treedef or len(shapes) != len(self.shapes):
            return False
        if all(s is None for s in shapes):  # nothing tells copies of a parameter-free module apart
            return False
        return shapes == self.shapes or all(
            a is None and b is None or a is not None and b is not None and tuple(b[1:]) == tuple(a)
            for a, b in zip(shapes, self.shapes))


class BlockContext:
    """Routes the calls of the sub-modules at `paths` of `tree` to `on_call(index, module, call,
    args, kwargs)`, but not calls made inside a claimed call. A copy of a target is claimed too: one
    rebuilt from it (see `Target`), or one at the target's place below a called copy of one of its
    ancestors (`mixed_precision_cast(self.inner)(x)` rebuilds every layer of `inner`)."""

    def __init__(self, tree: Any, paths: list, on_call: Callable[..., Any]) -> None:
        self.targets = [Target(get_at(tree, p)) for p in paths]
        self.by_id = {id(t.obj): i for i, t in enumerate(self.targets)}
        self.aliases: list[Any] = []  # copies claimed by place, kept alive with their ids
        self.others = _modules_in(tree)  # sub-modules of the tree that are not targets: never claimed
        below: dict = {}
        for i, p in enumerate(paths):
            for k in range(1, len(p)):
                below.setdefault(tuple(p[:k]), []).append((i, tuple(p[k:])))
        self.anchors = [(Target(get_at(tree, a)), under) for a, under in below.items()
                        if isinstance(get_at(tree, a), eqx.Module)]
        self.types = frozenset([t.type for t in self.targets] + [a.type for a, _ in self.anchors])
        self.on_call = on_call
        self.depth = 0

    def claim(self, obj: Any) -> int | None:
        """The index of the target `obj` is, or is a rebuilt copy of (`None` if none, or if
        several targets look alike and `obj` is none of them itself)."""
        if id(obj) in self.by_id:
            return self.by_id[id(obj)]
        if type(obj) not in self.types or id(obj) in self.others:
            return None
        treedef, shapes = jax.tree.structure(obj), _leaf_shapes(obj)
        found = [i for i, t in enumerate(self.targets) if t.like(obj, treedef, shapes)]
        if len(found) == 1:
            return found[0]
        self._adopt(obj, treedef, shapes)
        return None

    def _adopt(self, obj: Any, treedef: Any, shapes: tuple) -> None:
        """`obj` is a copy of one ancestor of targets: its sub-modules at their places are theirs."""
        alike = [under for a, under in self.anchors if a.like(obj, treedef, shapes)]
        if len(alike) != 1:
            return
        for index, rel in alike[0]:
            try:
                copy = get_at(obj, rel)
            except (AttributeError, IndexError, KeyError, TypeError):
                continue
            self.aliases.append(copy)
            self.by_id[id(copy)] = index

    def dispatch(self, obj: Any, call: Callable, args: tuple, kwargs: dict) -> Any:
        index = None if self.depth else self.claim(obj)  # a call inside a claimed call is that block's
        if index is None:
            return _PASS
        self.depth += 1
        try:
            return self.on_call(index, obj, call, args, kwargs)
        finally:
            self.depth -= 1


def _modules_in(tree: Any) -> dict[int, Any]:
    """`{id: module}` of every `eqx.Module` in `tree` (the objects are kept, so ids stay theirs)."""
    found: dict[int, Any] = {}
    todo = [tree]
    while todo:
        x = todo.pop()
        if id(x) in found:
            continue
        if isinstance(x, eqx.Module):
            found[id(x)] = x
        if isinstance(x, (eqx.Module, list, tuple, dict)):
            todo.extend(jax.tree.leaves(x, is_leaf=lambda y: y is not x and isinstance(y, eqx.Module)))
    return found


@contextlib.contextmanager
def routing(tree: Any, paths: list, on_call: Callable[..., Any]) -> Iterator[BlockContext]:
    """While the block runs, calls on this thread of the sub-modules of `tree` at `paths` (or of
    copies of them, see `BlockContext`) go to `on_call(index, module, call, args, kwargs)`, where
    `call` is the class's own `__call__` (call it, not `module(...)`, to run the module itself)."""
    ctx = BlockContext(tree, paths, on_call)
    stack = vars(_local).setdefault("blocks", [])  # this thread's
    with installed(ctx.types):
        stack.append(ctx)
        try:
            yield ctx
        finally:
            stack.pop()
