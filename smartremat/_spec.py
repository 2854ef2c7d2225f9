"""Abstract call signatures: what a block or module is called with, as a hashable value."""

from __future__ import annotations

import contextlib
import functools
import threading
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.core import Tracer
import numpy as np

from . import _jax_private
from ._cache import Identity, register_clear


def is_traced(x: Any) -> bool:
    """Whether a leaf is traced (an array, a `ShapeDtypeStruct` or a tracer) rather than static."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, Tracer))


def scatter(leaves: Sequence[Any], at: Sequence[int], values: Sequence[Any]) -> list[Any]:
    """A copy of `leaves` with `values[k]` put at position `at[k]` (e.g. the dynamic leaves back
    among the static ones, or the differentiated ones among all)."""
    full = list(leaves)
    for i, x in zip(at, values):
        full[i] = x
    return full


def merge_leaves(treedef: Any, static: tuple[tuple[int, Any], ...], dynamic: Any) -> Any:
    """The pytree of `treedef` from its static leaves `(index, value)` and the dynamic ones in order."""
    stat = dict(static)
    leaves = scatter([stat.get(i) for i in range(treedef.num_leaves)],
                     [i for i in range(treedef.num_leaves) if i not in stat], dynamic)
    return jax.tree.unflatten(treedef, leaves)


def hashable(x: Any) -> Any:
    """A static leaf as a key part: itself if hashable, a mutable set or byte array by its value,
    else the object itself compared by identity (held, so its id cannot be reused meanwhile)."""
    with contextlib.suppress(TypeError):
        hash(x)
        return x
    if type(x) is set:
        return ("<set>", frozenset(hashable(v) for v in x))
    if type(x) is bytearray:
        return ("<bytearray>", bytes(x))
    return ("<unhashable>", type(x).__name__, Identity(x))


@dataclass(frozen=True)
class CallSpec:
    """An abstract call `fn(module, *args, **kwargs)`, possibly under one `jax.vmap`.

    Array leaves are held as `jax.ShapeDtypeStruct` of the *whole* batch (batch axis first);
    everything else is static. Equal specs mean the same compiled program, so specs key caches.
    """

    treedef: Any
    dynamic: tuple[jax.ShapeDtypeStruct, ...]
    static: tuple[tuple[int, Any], ...]
    in_axes: tuple[int | None, ...]
    axis_size: int | None
    axis_name: Any = None

    def key(self) -> tuple:
        dyn = tuple((d.shape, str(d.dtype), sharding_key(d)) for d in self.dynamic)
        stat = tuple((i, hashable(v)) for i, v in self.static)
        return (self.treedef, dyn, stat, self.in_axes, self.axis_size, self.axis_name)

    def rebuild(self, dynamic: tuple) -> tuple:
        return merge_leaves(self.treedef, self.static, dynamic)

    def function(self, fn: Callable, wrap: Callable | None = None) -> Callable:
        """`f(*dynamic)` that calls `fn(module, *args, **kwargs)`, vmapped as recorded; `wrap` wraps the
        per-example function (e.g. in `jax.checkpoint`) before the vmap, as under the user's vmap."""

        def per_example(*dynamic: Any) -> Any:
            module, args, kwargs = self.rebuild(dynamic)
            return fn(module, *args, **kwargs)

        f = wrap(per_example) if wrap is not None else per_example
        if self.axis_size is not None:
            f = jax.vmap(f, in_axes=self.in_axes, axis_size=self.axis_size, axis_name=self.axis_name)
        return f


def make_spec(module: Any, args: tuple, kwargs: dict) -> CallSpec:
    """The abstract signature of `module(*args, **kwargs)` as seen right now; leaves that are
    `BatchTracer`s of one `jax.vmap` are recorded with their whole batch."""
    leaves, treedef = jax.tree.flatten((module, tuple(args), dict(kwargs)))
    dynamic, static, in_axes = [], [], []
    size, trace = None, None
    for i, leaf in enumerate(leaves):
        if not is_traced(leaf):
            static.append((i, leaf))
            continue
        batch = _jax_private.batch_axis(leaf)
        aval = jax.typeof(leaf) if not isinstance(leaf, jax.ShapeDtypeStruct) else leaf
        if batch is None:
            dynamic.append(jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=placed_sharding(aval)))
            in_axes.append(None)
            continue
        bsize, bdim, btrace = batch
        inner = _jax_private.inner_value(leaf)
        if (trace is not None and btrace is not trace) or _jax_private.is_batched(inner):
            raise NotImplementedError(_NESTED_VMAP)
        size, trace = bsize, btrace
        batched = jax.typeof(inner)
        dynamic.append(jax.ShapeDtypeStruct((bsize, *aval.shape), aval.dtype,
                                            sharding=_batch_first(placed_sharding(batched), bdim, len(aval.shape) + 1)))
        in_axes.append(0)
    name = _jax_private.axis_name(trace) if trace is not None else None
    return CallSpec(treedef, tuple(dynamic), tuple(static), tuple(in_axes), size, name)


def _mesh_of(sharding: Any) -> Any:
    mesh = getattr(sharding, "mesh", None)
    return mesh if mesh is not None and getattr(mesh, "size", 1) > 1 else None


def _explicit(mesh: Any) -> bool:
    return all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


@functools.lru_cache(maxsize=64)
def _concrete_mesh(sizes: tuple, names: tuple, types: tuple) -> jax.sharding.Mesh:
    """A device mesh for an abstract one seen inside `jit`: the first devices, in order."""
    devices = np.array(jax.devices()[: math.prod(sizes)]).reshape(sizes)
    return jax.sharding.Mesh(devices, names, axis_types=types)


register_clear(_concrete_mesh.cache_clear)


def shardings_hidden(spec: CallSpec) -> bool:
    """Several devices, and no input of `spec` shows a sharding over Explicit mesh axes: JAX hides
    (Auto axes) or there is no per-device split, so figures are for one device doing all the work."""
    meshes = [_mesh_of(getattr(d, "sharding", None)) for d in spec.dynamic]
    return jax.device_count() > 1 and not any(m is not None and _explicit(m) for m in meshes)


def placed_sharding(aval: Any) -> jax.sharding.NamedSharding | None:
    """The aval's sharding over a mesh of several devices, on concrete devices (to compile for);
    `None` for a single device. Under a mesh whose axes are not Explicit, JAX does not show a
    traced value's sharding, so smartremat warns and plans as if it were replicated."""
    sharding = getattr(aval, "sharding", None)
    mesh = _mesh_of(sharding)
    if mesh is None or sharding is None:
        return None
    if not _explicit(mesh) and not _STEP_PLANNING[0]:
        warnings.warn(_AUTO_MESH, stacklevel=4)
    if not isinstance(mesh, jax.sharding.Mesh):
        mesh = _concrete_mesh(tuple(mesh.axis_sizes), tuple(mesh.axis_names), tuple(mesh.axis_types))
    return jax.sharding.NamedSharding(mesh, sharding.spec)


def _batch_first(sharding: Any, bdim: int, ndim: int) -> Any:
    """The sharding of a batched value, its batch axis moved from `bdim` to the front."""
    if sharding is None:
        return None
    spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    spec.insert(0, spec.pop(bdim))
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


def sharding_key(d: jax.ShapeDtypeStruct) -> Any:
    s = getattr(d, "sharding", None)
    named = isinstance(s, jax.sharding.NamedSharding)
    return (tuple(s.mesh.axis_names), tuple(s.mesh.axis_sizes), str(s.spec)) if named else None


def abstract(x: Any) -> jax.ShapeDtypeStruct:
    """`x`'s shape, dtype and (over several devices) sharding, as seen now."""
    aval = jax.typeof(x)
    sharding = getattr(aval, "sharding", None)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding if _mesh_of(sharding) else None,
                                weak_type=getattr(aval, "weak_type", False))


_STEP_PLANNING = [0]  # how many `smartremat.filter_jit` plannings are under way (in any thread)
_STEP_LOCK = threading.Lock()


@contextlib.contextmanager
def planning_step() -> Iterator[None]:
    """While `smartremat.filter_jit` plans a step (a process-wide count: it compiles in worker
    threads), no warning about a mesh with Auto axes: it compiles the whole step with the arguments'
    shardings, and its plan says which figures are for one device (`_step_plan.HIDDEN_NOTE`)."""
    with _STEP_LOCK:
        _STEP_PLANNING[0] += 1
    try:
        yield
    finally:
        with _STEP_LOCK:
            _STEP_PLANNING[0] -= 1


_AUTO_MESH = ("smartremat sees a device mesh whose axes are not `AxisType.Explicit`; inside `jit` JAX then "
              "hides how each value is sharded, so smartremat profiles and compiles as if every input were "
              "replicated, and its per-device figures are those of one device doing all the work (pessimistic). "
              "Make the mesh with Explicit axes (`jax.make_mesh`'s default) so that per-device bytes are counted.")


def vmapped_spec(module: Any, args: tuple, kwargs: dict, axis_name: Any = None) -> CallSpec:
    """The spec the decorator records for `jax.vmap(module)(*args, **kwargs)` (axis 0 of
    every array in `args`/`kwargs` is the batch, the module is not batched)."""
    base = make_spec(module, args, kwargs)
    n_module = jax.tree_util.treedef_children(base.treedef)[0].num_leaves
    unbatched = n_module - sum(i < n_module for i, _ in base.static)  # the module's dynamic leaves
    in_axes = (None,) * unbatched + (0,) * (len(base.dynamic) - unbatched)
    sizes = {d.shape[0] for d, ax in zip(base.dynamic, in_axes) if ax == 0 and d.shape}
    if len(sizes) != 1:
        raise ValueError(f"`explain(..., vmap=True)` needs every array argument to share its leading (batch) "
                         f"axis; got leading sizes {sorted(sizes)}. Pass the batched inputs you would give "
                         "to `jax.vmap(model)`.")
    return CallSpec(base.treedef, base.dynamic, base.static, in_axes, sizes.pop(), axis_name)


_NESTED_VMAP = ("smartremat plans under at most one `jax.vmap` around the decorated module, and this call "
                "is under two (or two different ones). Apply `jax.vmap` once over the batch (reshape the "
                "extra axes into it), or call the module without nested vmaps.")
