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


class KeyedCache(Generic[T]):
    """`get(key, make)` returns the value made once for `key`: threads asking for the same key
    while it is being made wait for it (keys differing are made in parallel), and an exception
    in `make` is raised to its caller and not kept (the next `get` makes it again)."""

    def __init__(self) -> None:
        self._values: dict[Hashable, T] = {}
        self._making: dict[Hashable, threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        while True:
            with self._lock:
                if key in self._values:
                    return self._values[key]
                lock = self._making.setdefault(key, threading.Lock())
            with lock:  # one maker per key; the others wait here, then find the value
                with self._lock:
                    if key in self._values:
                        return self._values[key]
                    if self._making.get(key) is not lock:  # its maker failed: start over
                        continue
                try:
                    value = make()
                except BaseException:
                    with self._lock:
                        del self._making[key]
                    raise
                with self._lock:
                    del self._making[key]
                    return self._values.setdefault(key, value)

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
