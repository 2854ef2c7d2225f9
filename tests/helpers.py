"""Shared test helpers: tree comparison, short plan names, and the compiler's figures for a training step."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np


def tree_allclose(a: Any, b: Any, rtol: float = 1e-6, atol: float = 0.0) -> bool:
    """Same structure and every array leaf close (relative to the leaf's scale)."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        scale = np.max(np.abs(y)) if y.size else 0.0
        if not np.all(np.abs(x - y) <= atol + rtol * max(scale, 1e-30)):
            return False
    return True


#: `make test-full` (`SMARTREMAT_FULL_TESTS=1`): every case of the suites that run the same check on
#: several heavy models; `make test` (CI) runs a subset that still covers each model and idiom
#: somewhere, so that it stays under 30 minutes on 2 cores.
FULL = os.environ.get("SMARTREMAT_FULL_TESTS", "") == "1"


def tier(names: Iterable[Any], ci: Iterable[Any]) -> list:
    """`names` (in order) under `make test-full`; under `make test`, those also in `ci`."""
    keep = list(ci)
    return [n for n in names if FULL or n in keep]


def short_plan(policies: dict) -> str:
    """`{path: policy}` in a few characters: `none`, `dots`, `dots_nb`, `full`, nested kept short."""
    names = {"dots_saveable": "dots", "dots_with_no_batch_dims_saveable": "dots_nb", "nothing_saveable": "full"}
    return " ".join(names.get(p, p) for p in policies.values())


# The hand-written fixed strategies and the compiler's figures are the benchmark's own, so tests
# and benchmarks hold plans against the same reference (`benchmarks/strategies.py`).
from benchmarks.strategies import figures as step_figures  # noqa: E402,F401
from benchmarks.strategies import strategy as uniform  # noqa: E402,F401


def backward(model: Any, *args: Any) -> Any:
    """The gradient of a real loss (mean squared output) w.r.t. the model: a call smartremat plans
    (a forward-only call runs the plain forward)."""
    import equinox as eqx
    import jax.numpy as jnp

    return eqx.filter_grad(lambda m: jnp.mean(jnp.square(m(*args))))(model)


def in_threads(work: Any, n: int) -> list[BaseException]:
    """Run `work(i)` for i < n in n threads at once; the exceptions they raised."""
    import threading

    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as e:  # surfaced to the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


# The gradient standard is the benchmarks' too (the accelerator check judges answers by it).
from benchmarks.answers import MISMATCH_RTOL as MISMATCH_RTOL  # noqa: E402
from benchmarks.answers import tree_mismatches as tree_mismatches  # noqa: E402
