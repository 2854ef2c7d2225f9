"""The one place smartremat touches private JAX API, each use with a public fallback.

Public JAX cannot tell which transformation a tracer belongs to, and smartremat needs it: under
`jax.vmap(model)(x)` the budget counts the whole batch (`batch_axis`); a call not differentiated
runs the plain forward (`differentiated`); `smartremat.filter_jit` tells which step argument a
module came from (`differentiated_from`). `bind_equation` serves the scan splitter. Without the
private attributes each says "not batched" / "differentiated" / "itself".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from jax import core as jax_core

try:  # private: jax._src.interpreters.{batching,ad}
    from jax._src.interpreters import ad as _ad
    from jax._src.interpreters import batching as _batching

    _BatchTracer = _batching.BatchTracer
    _PRIMAL_TRACERS = tuple(filter(None, (getattr(_ad, "JVPTracer", None), getattr(_ad, "LinearizeTracer", None))))
    AVAILABLE = True
except Exception:  # pragma: no cover - public fallback
    _BatchTracer = ()
    _PRIMAL_TRACERS = ()
    AVAILABLE = False


def differentiated_from(leaf: Any) -> Any:
    """The value a leaf seen inside `jax.grad`/`jax.vjp` (any depth) is the tangent-free copy
    of: the step's own input tracer, to tell which argument a module came from. Public
    fallback: the leaf itself."""
    while isinstance(leaf, _PRIMAL_TRACERS):
        leaf = getattr(leaf, "primal", None)
    return leaf


def differentiated(leaves: list) -> bool:
    """Whether any leaf is seen inside `jax.grad`/`jax.vjp`/`jax.jvp` (through any `jax.vmap`s).
    A function traced first and differentiated afterwards (`jax.grad(jax.jit(f))`, a `scan`
    body) shows no sign of it. Public fallback: `True` for anything traced."""
    for leaf in leaves:
        x = leaf
        while isinstance(x, _BatchTracer):
            x = x.val
        if isinstance(x, _PRIMAL_TRACERS) or not AVAILABLE and isinstance(leaf, jax_core.Tracer):
            return True
    return False


def batch_axis(leaf: Any) -> tuple[int, int, Any] | None:
    """For a leaf seen inside one `jax.vmap`, `(axis_size, batch_dim, trace)`; else `None`."""
    x = differentiated_from(leaf)
    if not isinstance(x, _BatchTracer) or not isinstance(x.batch_dim, int):
        return None
    return int(x._trace.axis_data.size), int(x.batch_dim), x._trace


def axis_name(trace: Any) -> Any:
    """The `axis_name` of the `jax.vmap` a `batch_axis` trace belongs to (for collectives such
    as BatchNorm's `pmean`), or `None`."""
    return getattr(getattr(trace, "axis_data", None), "name", None)


def inner_value(leaf: Any) -> Any:
    """The batched value underneath a `BatchTracer` (to detect nested vmaps)."""
    return differentiated_from(differentiated_from(leaf).val)


def is_batched(leaf: Any) -> bool:
    return isinstance(differentiated_from(leaf), _BatchTracer)


def bind_equation(eqn: Any, invals: list) -> list:
    """Bind a jaxpr equation's primitive to `invals`, as `jax.core.eval_jaxpr` does
    (`get_bind_params` returns `(subfuns, params)` in older JAX, the params alone in current)."""
    got = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = got if isinstance(got, tuple) else ((), got)
    with _equation_context(eqn):
        outs = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


@contextlib.contextmanager
def _equation_context(eqn: Any) -> Iterator[None]:
    """The equation's own context (XLA metadata, `compute_on`, ...) and its name stack, entered
    as `jax.core.eval_jaxpr` does; private `source_info_util`, or only the context without it."""
    manager = getattr(getattr(eqn, "ctx", None), "manager", None) or contextlib.nullcontext()
    try:
        from jax._src import source_info_util as siu

        names = siu.current_name_stack() + eqn.source_info.name_stack
        user = siu.user_context(eqn.source_info.traceback, name_stack=names)
    except (ImportError, AttributeError):
        user = contextlib.nullcontext()
    with user, manager:
        yield


def key_value_store() -> Any:
    """The `jax.distributed` coordination service's client (`key_value_set`,
    `blocking_key_value_get`) that every process of the job reaches, or `None` (not initialised,
    or JAX moved it; `_share` then broadcasts through public `multihost_utils`)."""
    try:
        from jax._src import distributed

        return distributed.global_state.client
    except (ImportError, AttributeError):
        return None
