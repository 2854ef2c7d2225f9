"""Explicitly keyed, thread-safe caches (profiles, compiled figures, plans)."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


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
_CLEARS: list[Callable[[], Any]] = []


def register_clear(clear: Callable[[], Any]) -> Callable[[], Any]:
    """Have `clear_caches()` call `clear` too (e.g. a `functools.cache`'s `cache_clear`), as
    Equinox's `_caches.py` registers its caches; returns `clear`."""
    with _CACHES_LOCK:
        _CLEARS.append(clear)
    return clear


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
            with lock:  # one maker per key; the others wait here, then start over to find its value
                with self._lock:
                    if self._making.get(key) is not lock:  # made (or its maker failed) meanwhile
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
                    if generation == self._generation:  # else a clear() came while it was made
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
    and `XLA_FLAGS`), each cache its most recently used entries only; call this to free the memory
    they hold, or to plan again from scratch (e.g. to time planning), as `equinox.clear_caches()`
    does for Equinox's compiled functions. The next trace of a decorated model, or the next call of
    a `smartremat.filter_jit` step, plans again; a function JAX has already compiled keeps the plan
    it was traced with. A `Plan` given with `smartremat(plan=...)` is not a cache and stays. JAX's
    and Equinox's own caches are left alone (`jax.clear_caches()` and `equinox.clear_caches()`).

    **Arguments:** none.

    **Returns:** `None`.

    ```python
    import smartremat

    smartremat.clear_caches()
    ```
    """
    with _CACHES_LOCK:
        caches, clears = list(_CACHES), list(_CLEARS)
    for cache in caches:
        cache.clear()
    for clear in clears:
        clear()
