"""Explicitly keyed, thread-safe caches (profiles, compiled figures, plans)."""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import jax

T = TypeVar("T")


def environment_key() -> tuple[str, str]:
    """What else a compiled figure depends on: the backend and the XLA flags."""
    return jax.default_backend(), os.environ.get("XLA_FLAGS", "")


def measuring_options() -> dict[str, Any]:
    """XLA options for the compiles smartremat only measures (profiles, candidate plans), never
    for a step that runs. On the CPU, LLVM's optimisation level decides code generation only,
    after the HLO passes and buffer assignment that `memory_analysis()` and `cost_analysis()`
    read, so level 0 gives the same figures in about half the compile time (docs/fit.md,
    "Planning time"). Other backends compile as they would anyway."""
    return {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else {}


def profiling_options() -> dict[str, Any]:
    """XLA options for the small compiles that profile one block (its own peak, its copies in a
    row): `measuring_options()` and, on the CPU, XLA's loop emitters instead of its MLIR fusion
    emitters, which halves these compiles at the same temp bytes on every block profile of the
    benchmark models (docs/fit.md, "Planning time"); also for the one compile of the module with
    its stack's blocks skipped (`_head.in_place`), a measure too. Not for whole-step compiles,
    whose figures must be those of the step that runs: there the emitters move the quick GPT's
    temp bytes by up to 192 bytes. `_profile.compiled_temp` falls back to `measuring_options()` where a jaxlib does
    not know the option."""
    extra = {"xla_cpu_use_fusion_emitters": False} if jax.default_backend() == "cpu" else {}
    return {**measuring_options(), **extra}


def barrier_hint() -> str:
    """For an error about a budget that is too low: on the CPU without the barrier flag, a
    sentence saying that the figures overstate what remat can save and how to set the flag;
    else `""`."""
    from ._planner import CPU_NOTE, cpu_barrier_missing

    if not cpu_barrier_missing():
        return ""
    return (f" Note: {CPU_NOTE}, and it is not set in this process, so the compiled program keeps what "
            "remat should free and the figures above may be too high: set it (e.g. "
            "`XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander python train.py`) and plan again "
            "before raising the budget.")


class Identity:
    """A key part for an object that cannot be hashed by value: equal only to a key part of the
    same object. It holds the object, so its `id` cannot be reused by another one while the key
    is alive (a bare `id(x)` in a key can: a later object at the same address would hit)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Identity) and other.obj is self.obj

    def __repr__(self) -> str:
        return f"Identity(<{type(self.obj).__name__} at {id(self.obj):#x}>)"


#: How many values each cache keeps; the least recently used goes first.
MAX_ENTRIES = 256

_CACHES: weakref.WeakSet[KeyedCache] = weakref.WeakSet()
_CACHES_LOCK = threading.Lock()


class KeyedCache(Generic[T]):
    """`get(key, make)` returns the value made once for `key`: threads asking for the same key
    while it is being made wait for it (keys differing are made in parallel), and an exception
    in `make` is raised to its caller and not kept (the next `get` makes it again).

    It keeps the `max_entries` values most recently asked for (then a key is made again); a
    value whose making began before a `clear()` is returned to its caller but not kept."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"`KeyedCache(max_entries=...)` should be at least 1, not {max_entries!r}.")
        self.max_entries = max_entries
        self._values: OrderedDict[Hashable, T] = OrderedDict()
        self._making: dict[Hashable, threading.Lock] = {}
        self._lock = threading.Lock()
        self._generation = 0  # bumped by clear(): a value made across a clear is not kept
        with _CACHES_LOCK:
            _CACHES.add(self)

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        while True:
            with self._lock:
                if key in self._values:
                    self._values.move_to_end(key)
                    return self._values[key]
                lock = self._making.setdefault(key, threading.Lock())
            with lock:  # one maker per key; the others wait here, then find the value
                with self._lock:
                    if key in self._values:
                        self._values.move_to_end(key)
                        return self._values[key]
                    if self._making.get(key) is not lock:  # its maker failed (or it was evicted): start over
                        continue
                    generation = self._generation
                try:
                    value = make()
                except BaseException:
                    with self._lock:
                        del self._making[key]
                    raise
                with self._lock:
                    del self._making[key]
                    if generation != self._generation:
                        return value
                    self._values[key] = value
                    while len(self._values) > self.max_entries:
                        self._values.popitem(last=False)
                    return value

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self._generation += 1


def clear_caches() -> None:
    """Forget every plan, profile and compiled figure smartremat has kept in this process.

    smartremat caches what it measures (by module code, input signature, configuration, backend
    and `XLA_FLAGS`), so planning the same call twice costs nothing the second time. Each cache
    keeps its most recently used entries only, so this is rarely needed; call it to free the memory
    they hold, or to plan again from scratch (e.g. to time planning), much as
    `equinox.clear_caches()` does for Equinox's compiled functions.

    The next trace of a decorated model, or the next call of a `smartremat.filter_jit` step, plans
    again; a function JAX has already compiled keeps the plan it was traced with. A `Plan` given
    with `smartremat(plan=...)` is not a cache and stays. JAX's and Equinox's own caches are left
    alone (`jax.clear_caches()` and `equinox.clear_caches()` clear those).

    **Arguments:** none.

    **Returns:** `None`.

    ```python
    import smartremat

    smartremat.clear_caches()
    ```
    """
    from . import _spec

    with _CACHES_LOCK:
        caches = list(_CACHES)
    for cache in caches:
        cache.clear()
    _spec._concrete_mesh.cache_clear()
