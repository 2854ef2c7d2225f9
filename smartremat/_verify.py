"""Hold a plan against the compiler: temp bytes and FLOPs of the real training step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._cache import KeyedCache, environment_key
from ._apply import Assignment, run
from ._profile import compiled_temp, grad_step
from ._spec import CallSpec

_CACHE: KeyedCache[tuple[int, float]] = KeyedCache()


def step_function(call: Callable, spec: CallSpec, assignment: Assignment) -> Callable:
    """`step(*dynamic)`: the gradient, w.r.t. the module's parameters, of the summed output."""
    f = spec.function(lambda m, *a, **k: run(m, call, assignment, a, k))
    return grad_step(f, spec, module_only=True)


def compiled_step(call: Callable, spec: CallSpec, assignment: Assignment) -> tuple[int, float]:
    """`(temp_size_in_bytes, flops)` of the compiled training step under `assignment`.

    This is the ground truth the budget is held against (design.md: what the budget means).
    Cached by signature, assignment, backend and XLA flags.
    """
    key = (spec.key(), call, _assignment_key(assignment), *environment_key())
    return _CACHE.get(key, lambda: compiled_temp(step_function(call, spec, assignment), spec))


def _assignment_key(assignment: Assignment) -> tuple:
    return tuple((path, _policy_key(pol)) for path, pol in assignment)


def _policy_key(pol: Any) -> Any:
    try:
        hash(pol)
        return pol
    except TypeError:
        return id(pol)
