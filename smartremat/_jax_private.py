"""The one place smartremat touches private JAX API, each use with a public fallback.

Public JAX cannot tell which transformation a tracer belongs to, and smartremat needs it: under
`jax.vmap(model)(x)` the budget counts the whole batch (`batch_axis`); a call not differentiated
runs the plain forward (`differentiated`); `smartremat.filter_jit` tells which step argument a
module came from (`differentiated_from`). `bind_equation` serves the scan splitter. Without the
private attributes each says "not batched" / "differentiated" / "itself".

JAX's configuration context managers (`with jax.default_matmul_precision("highest"):`,
`jax.enable_x64(True)`, ...) hold in the thread that entered them only; smartremat lowers and
compiles in worker threads, which `carrying_config` gives the caller's settings
(`jax._src.config.config_states`; public fallback: the public context managers of
`PUBLIC_CONFIG`). Plans are not keyed by these settings: a plan made inside a user's trace serves
`explain` outside it (docs/real-models.md says what that leaves).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax
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


try:  # private: jax._src.config
    from jax._src import config as _config

    _STATES: dict[str, Any] | None = _config.config_states
    _UNSET = _config.config_ext.unset
    #: Thread-local contexts that are not options: the meshes (`jax.set_mesh`, `with mesh:`), the
    #: default device's context, `compute_on`, XLA metadata (never the trace itself).
    _CONTEXTS = tuple(c for name in ("mesh_context_manager", "abstract_mesh_context_manager", "device_context",
                                     "compute_on_context_manager", "xla_metadata_context_manager")
                      if (c := getattr(_config, name, None)) is not None)
except Exception:  # pragma: no cover - public fallback
    _STATES, _UNSET, _CONTEXTS = None, object(), ()

#: The configuration options with a public context manager (`jax.<name>(value)`) that change what a
#: traced step computes: the public fallback's settings to carry into worker threads.
PUBLIC_CONFIG = ("default_matmul_precision", "enable_x64", "numpy_rank_promotion", "numpy_dtype_promotion",
                 "default_device", "debug_nans", "debug_infs", "default_prng_impl", "threefry_partitionable",
                 "softmax_custom_jvp")

_F = TypeVar("_F", bound=Callable[..., Any])


def thread_config() -> tuple[tuple[Any, Any], ...]:
    """The configuration this thread holds by context managers, `(setting, value)` each: the
    options and contexts set in this thread alone (private; an option is entered by calling it,
    a context swapped in), or every `PUBLIC_CONFIG` option's context manager and value (public
    fallback)."""
    if _STATES is not None:
        held = (*_STATES.values(), *_CONTEXTS)
        return tuple((c, v) for c in held if (v := c.get_local()) is not _UNSET)
    return tuple((getattr(jax, name), getattr(jax.config, f"jax_{name}")) for name in PUBLIC_CONFIG
                 if hasattr(jax, name) and hasattr(jax.config, f"jax_{name}"))


@contextlib.contextmanager
def entered(settings: tuple[tuple[Any, Any], ...]) -> Iterator[None]:
    """`thread_config()` of another thread, entered in this one."""
    with contextlib.ExitStack() as stack:
        for setting, value in settings:
            if callable(setting):  # an option (its update hooks run) or a public context manager
                stack.enter_context(setting(value))  # type: ignore[arg-type]
            else:
                stack.callback(setting.set_local, setting.swap_local(value))
        yield


def carrying_config(fn: _F) -> _F:
    """`fn`, to run in a worker thread under the configuration of the thread that calls this:
    a step lowered there is the step the caller would lower."""
    settings = thread_config()

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with entered(settings):
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]

