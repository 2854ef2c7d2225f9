"""Hold a plan against the compiler: temp bytes and FLOPs of a training step with a real loss.

The decorator cannot see the user's loss (it runs inside it), so it compiles the gradient of the
module's parameters under losses users write and keeps the largest figure: the squared error and
the softmax cross-entropy (soft targets and integer labels) of every floating output, against
targets that are inputs of the step (never `jnp.sum(out)`: a constant cotangent lets XLA simplify
the backward). With `smartremat(loss=...)` the user's own loss is the only one compiled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ._cache import Identity, KeyedCache
from ._env import environment_key
from ._cost import floating_leaves
from ._options import Assignment, run
from ._profile import compiled_temp, mesh_context, n_module_leaves, split_diff
from ._refused import Refusal, kept, raised
from ._spec import CallSpec, placed_sharding
from ._tune import Timed

_CACHE: KeyedCache[tuple[int, float] | Refusal] = KeyedCache()


def _like(o: Any, shape: tuple, dtype: Any) -> jax.ShapeDtypeStruct:
    """A target of `shape` (a prefix of the output `o`'s) and `dtype`, sharded like `o`'s
    leading axes over several devices (on concrete devices, to compile for)."""
    placed = placed_sharding(o)
    if placed is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    spec = (tuple(placed.spec) + (None,) * o.ndim)[: len(shape)]
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(placed.mesh, P(*spec)))


@dataclass(frozen=True)
class RealLoss:
    """A loss on every floating output leaf: the mean squared error against a target of its shape
    (`kind="squared"`), or the softmax cross-entropy over its last axis against soft targets
    (`"soft"`, same shape) or integer labels (`"labels"`, the leading axes); the cross-entropy of a
    scalar leaf is its squared error."""

    kind: str = "squared"

    def targets(self, out: Any) -> tuple:
        return tuple(_like(o, o.shape[:-1], jnp.int32) if self.kind == "labels" and o.ndim
                     else _like(o, o.shape, o.dtype) for o in floating_leaves(out))

    def __call__(self, out: Any, *targets: jax.Array) -> jax.Array:
        total = jnp.float32(0)
        for o, t in zip(floating_leaves(out), targets, strict=True):
            o = o.astype(jnp.float32)
            if self.kind == "squared" or o.ndim == 0:
                error = (o - t.astype(jnp.float32)) ** 2
                total = total + (jnp.mean(error) if self.kind == "squared" else error)
                continue
            logp = jax.nn.log_softmax(o, axis=-1)
            picked = (jnp.take_along_axis(logp, t[..., None], axis=-1) if self.kind == "labels"
                      else logp * t.astype(jnp.float32))  # soft targets in the output's dtype
            total = total - jnp.mean(jnp.sum(picked, axis=-1))
        return total


#: The losses the decorator holds plans against when the user gives none.
DEFAULT_LOSSES = (RealLoss("squared"), RealLoss("soft"), RealLoss("labels"))


def abstract_args(given: Any) -> tuple:
    """`loss_args` as a hashable value: `(treedef, ShapeDtypeStructs)` of the argument tuple
    (one argument if a single one is given; `None` is no argument), shardings kept."""
    given = () if given is None else tuple(given) if isinstance(given, (tuple, list)) else (given,)
    leaves, treedef = jax.tree.flatten(given)
    structs = (jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a), sharding=getattr(a, "sharding", None),
                                    weak_type=getattr(a, "weak_type", False)) for a in leaves)
    return treedef, tuple(structs)


@dataclass(frozen=True)
class UserLoss:
    """`smartremat(loss=fn, loss_args=...)`: `fn(output, *loss_args)` is the user's loss. `args` is
    `abstract_args(...)` of the extra arguments, or a function from the output's shapes to them."""

    fn: Callable[..., jax.Array]
    args: Any = ()

    def targets(self, out: Any) -> tuple:
        treedef, leaves = abstract_args(self.args(out)) if callable(self.args) else self.args
        return jax.tree.unflatten(treedef, leaves)

    def __call__(self, out: Any, *targets: Any) -> jax.Array:
        return self.fn(out, *targets)


def loss_step(f: Callable, spec: CallSpec, loss: Any) -> tuple[Callable, tuple]:
    """`(step, avals)`: `step(*dynamic, *targets)` is the gradient of `loss(f(...), *targets)`
    w.r.t. the module's floating leaves (its parameters); `avals` are its abstract inputs."""
    diff_idx, g = split_diff(f, spec, n_module_leaves(spec))
    with mesh_context(spec.dynamic):
        out = jax.eval_shape(f, *spec.dynamic)
    extra, treedef = jax.tree.flatten(loss.targets(out))
    n = len(spec.dynamic)

    def step(*leaves: Any) -> Any:
        dyn, t = leaves[:n], jax.tree.unflatten(treedef, leaves[n:])
        return jax.grad(lambda d: loss(g(d, dyn), *t))([dyn[i] for i in diff_idx])

    return step, tuple(spec.dynamic) + tuple(extra)


def compiled_step(call: Callable, spec: CallSpec, assignment: Assignment,
                  losses: tuple = DEFAULT_LOSSES) -> tuple[int, float]:
    """`(temp_size_in_bytes, flops)` of the training step under `assignment`: the largest temp
    bytes over `losses`, and the FLOPs of the first. Cached by signature, assignment, losses,
    backend and XLA flags."""
    figures = [compiled_one(call, spec, assignment, loss) for loss in losses]
    return max(t for t, _ in figures), figures[0][1]


def compiled_one(call: Callable, spec: CallSpec, assignment: Assignment, loss: Any,
                 options: dict | None = None) -> tuple[int, float]:
    """`(temp bytes, flops)` of the training step under `assignment` and one loss, compiled with
    XLA `options` (`_env.measuring_options()` by default: the figures of the step that runs).
    A refusal for memory is raised as `_refused.Refused` (and kept: not compiled again)."""
    options_key = None if options is None else tuple(sorted(options.items()))
    key = (spec.key(), call, assignment_key(assignment), loss, options_key, *environment_key())
    make = kept(lambda: compiled_temp(*loss_step(_planned(call, spec, assignment), spec, loss), options))
    return raised(_CACHE.get(key, make))


def _planned(call: Callable, spec: CallSpec, assignment: Assignment) -> Callable:
    """The module's call as `spec` makes it, each block under its option in `assignment`."""
    return spec.function(lambda m, *a, **k: run(m, call, assignment, a, k))


def timed_step(call: Callable, spec: CallSpec, assignment: Assignment, loss: Any) -> Timed:
    """The training step under `assignment` and `loss`, as `_tune.timings` times it: compiled as
    it runs (no measuring options)."""
    step, avals = loss_step(_planned(call, spec, assignment), spec, loss)

    def executable() -> Any:
        with mesh_context(avals):
            return jax.jit(step).lower(*avals).compile()

    return Timed((spec.key(), call, assignment_key(assignment), loss, *environment_key()), executable, avals)


def assignment_key(assignment: Assignment) -> tuple:
    return tuple((path, _option_key(option)) for path, option in assignment)


def _option_key(option: Any) -> Any:
    """The option itself (options are values), or, if it holds an unhashable policy, the option
    compared by identity (and held, so its id cannot be reused while the key lives)."""
    try:
        hash(option)
        return option
    except TypeError:
        return Identity(option)
