"""The one place smartremat touches private JAX API, each use with a public fallback.

Public JAX has no way to ask a tracer what transformation it belongs to, and smartremat needs
to know: under `jax.vmap(model)(x)` the module sees per-example tracers but the budget counts
the whole batch (batch size and axis of each argument, the vmap's axis name); a call that is
not differentiated runs the plain forward (`differentiated`); `smartremat.filter_jit` tells
which step argument a module came from (`differentiated_from`). Binding a jaxpr equation again
(`bind_equation`) is the scan splitter's. If the private attributes are missing, each says "not
batched" / "differentiated" / "itself", so smartremat plans as it would without them.
"""

from __future__ import annotations

import contextlib
from typing import Any

from jax import core as jax_core

try:  # private: jax._src.interpreters.{batching,ad}
    from jax._src.interpreters import ad as _ad
    from jax._src.interpreters import batching as _batching

    _BatchTracer = _batching.BatchTracer
    _PRIMAL_TRACERS = tuple(
        t for t in (getattr(_ad, "JVPTracer", None), getattr(_ad, "LinearizeTracer", None)) if t
    )
    AVAILABLE = True
except Exception:  # pragma: no cover - public fallback
    _BatchTracer = ()
    _PRIMAL_TRACERS = ()
    AVAILABLE = False


def _strip_primal(x: Any) -> Any:
    while _PRIMAL_TRACERS and isinstance(x, _PRIMAL_TRACERS):
        x = getattr(x, "primal", x)
        if not isinstance(x, _PRIMAL_TRACERS):
            break
    return x


def differentiated_from(leaf: Any) -> Any:
    """The value a leaf seen inside `jax.grad`/`jax.vjp` (any depth) is the tangent-free copy
    of: the step's own input tracer, to tell which argument a module came from. Public
    fallback: the leaf itself."""
    while _PRIMAL_TRACERS and isinstance(leaf, _PRIMAL_TRACERS):
        leaf = getattr(leaf, "primal", None)
    return leaf


def differentiated(leaves: list) -> bool:
    """Whether any leaf is seen inside `jax.grad`/`jax.vjp`/`jax.jvp` (through any `jax.vmap`s).
    A function traced first and differentiated afterwards (`jax.grad(jax.jit(f))`, a `scan`
    body) shows no sign of it. Public fallback: `True` for anything traced."""
    for leaf in leaves:
        x = leaf
        while True:
            if _PRIMAL_TRACERS and isinstance(x, _PRIMAL_TRACERS):
                return True
            if _BatchTracer and isinstance(x, _BatchTracer):
                x = x.val
                continue
            break
        if not AVAILABLE and isinstance(leaf, jax_core.Tracer):
            return True
    return False


def batch_axis(leaf: Any) -> tuple[int, int, Any] | None:
    """For a leaf seen inside one `jax.vmap`, `(axis_size, batch_dim, trace)`; else `None`."""
    if not AVAILABLE:
        return None
    x = _strip_primal(leaf)
    if not isinstance(x, _BatchTracer):
        return None
    bdim = x.batch_dim
    if not isinstance(bdim, int):
        return None
    size = x._trace.axis_data.size
    return int(size), int(bdim), x._trace


def axis_name(trace: Any) -> Any:
    """The `axis_name` of the `jax.vmap` a `batch_axis` trace belongs to (for collectives such
    as BatchNorm's `pmean`), or `None`."""
    return getattr(getattr(trace, "axis_data", None), "name", None)


def inner_value(leaf: Any) -> Any:
    """The batched value underneath a `BatchTracer` (to detect nested vmaps)."""
    return _strip_primal(_strip_primal(leaf).val)


def is_batched(leaf: Any) -> bool:
    return AVAILABLE and isinstance(_strip_primal(leaf), _BatchTracer)


def bind_equation(eqn: Any, invals: list) -> list:
    """Bind a jaxpr equation's primitive to `invals`, as `jax.core.eval_jaxpr` does.

    `Primitive.get_bind_params` returns the params (sub-functions inside) in current JAX and
    `(subfuns, params)` in older releases; both are handled.
    """
    got = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = got if isinstance(got, tuple) else ((), got)
    with _equation_context(eqn):
        outs = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _equation_context(eqn: Any) -> Any:
    """The equation's own context (XLA metadata, `compute_on`, ...) and its name stack, entered
    as `jax.core.eval_jaxpr` does; private `source_info_util`, or only the context without it."""
    manager = getattr(getattr(eqn, "ctx", None), "manager", None) or contextlib.nullcontext()
    try:
        from jax._src import source_info_util as siu

        names = siu.current_name_stack() + eqn.source_info.name_stack
        user = siu.user_context(eqn.source_info.traceback, name_stack=names)
    except (ImportError, AttributeError):
        user = contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(user)
    stack.enter_context(manager)
    return stack
