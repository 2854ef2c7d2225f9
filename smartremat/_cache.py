"""Explicitly keyed, thread-safe caches (profiles, compiled figures, plans)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import jax

T = TypeVar("T")


def environment_key() -> tuple[str, str]:
    """What else a compiled figure depends on: the backend and the XLA flags."""
    return jax.default_backend(), os.environ.get("XLA_FLAGS", "")


class KeyedCache(Generic[T]):
    """`get(key, make)` returns the value made once for `key`; two threads get the same value."""

    def __init__(self) -> None:
        self._values: dict[Hashable, T] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        with self._lock:
            if key in self._values:
                return self._values[key]
        value = make()
        with self._lock:
            return self._values.setdefault(key, value)

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
