"""FLOP and byte counts of jaxpr equations (docs/facts.md, facts 5 and 7).

Counting happens on the jaxpr, not on XLA's cost analysis, so that a `lax.scan` body counts
once per iteration and so that the figures exist before anything is compiled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore


@dataclass(frozen=True)
class Cost:
    """FLOPs and bytes moved by a piece of computation."""

    flops: int = 0
    bytes: int = 0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes + other.bytes)

    def __sub__(self, other: "Cost") -> "Cost":
        return Cost(self.flops - other.flops, self.bytes - other.bytes)

    def scale(self, k: int) -> "Cost":
        return Cost(self.flops * k, self.bytes * k)


def floating_leaves(tree: Any) -> list:
    """The leaves of `tree` with a floating (or complex) dtype: what a gradient flows through."""
    return [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]


def _shard_shape(aval: Any, shape: tuple) -> tuple:
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if sharding is None or mesh is None or getattr(mesh, "size", 1) <= 1:
        return shape
    try:
        return tuple(sharding.shard_shape(tuple(shape)))
    except Exception:  # a spec that does not divide the shape: count the whole array
        return shape


def aval_bytes(aval: Any) -> int:
    """Bytes of one device's share of `aval` (its shard, when sharded over a mesh)."""
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    shape = _shard_shape(aval, shape)
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys): count their storage
        itemsize = getattr(dtype, "itemsize", 4) or 4
    return int(math.prod(shape)) * int(itemsize)


def _size(aval: Any) -> int:
    return int(math.prod(getattr(aval, "shape", ())))


def _dot_flops(eqn: Any) -> int:  # a jcore.JaxprEqn, whose avals JAX does not type
    (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    contract = math.prod(lhs[d] for d in lc)
    return 2 * _size(eqn.outvars[0].aval) * int(contract)


def _conv_flops(eqn: Any) -> int:
    rhs = eqn.invars[1].aval.shape
    dn = eqn.params["dimension_numbers"]
    out_feature_dim = dn.rhs_spec[0]
    per_output = math.prod(rhs) // rhs[out_feature_dim]
    return 2 * _size(eqn.outvars[0].aval) * int(per_output)


def _sub_jaxprs(eqn: jcore.JaxprEqn) -> list[tuple[Any, Any]]:
    """(jaxpr, multiplicity) pairs for equations that hold other jaxprs; a `cond` gives
    `("max", branches)`: it costs its costliest branch."""
    p = eqn.params
    name = eqn.primitive.name
    if name == "scan":
        return [(p["jaxpr"], int(p["length"]))]
    if name == "cond":
        return [("max", p["branches"])]
    if name == "while":
        return [(p["body_jaxpr"], 1), (p["cond_jaxpr"], 1)]
    subs = []
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in p and p[key] is not None:
            subs.append((p[key], 1))
    return subs


def _as_jaxpr(j: Any) -> Any:
    return j.jaxpr if hasattr(j, "jaxpr") and not isinstance(j, jcore.Jaxpr) else j


def jaxpr_cost(jaxpr: jcore.Jaxpr | jcore.ClosedJaxpr) -> Cost:
    """Total FLOPs and bytes of a (closed) jaxpr, descending into calls, scans and remat."""
    total = Cost()
    for eqn in _as_jaxpr(jaxpr).eqns:
        subs = _sub_jaxprs(eqn)
        if subs:
            for sub, mult in subs:
                if sub == "max":
                    costs = [jaxpr_cost(b) for b in mult]
                    total = total + max(costs, key=lambda c: c.flops)
                else:
                    total = total + jaxpr_cost(sub).scale(mult)
            continue
        total = total + eqn_cost(eqn)
    return total


def eqn_cost(eqn: jcore.JaxprEqn) -> Cost:
    """FLOPs and bytes of one primitive equation (no sub-jaxprs)."""
    nbytes = sum(aval_bytes(v.aval) for v in eqn.invars if hasattr(v, "aval"))
    nbytes += sum(aval_bytes(v.aval) for v in eqn.outvars)
    name = eqn.primitive.name
    if name == "dot_general":
        flops = _dot_flops(eqn)
    elif name == "conv_general_dilated":
        flops = _conv_flops(eqn)
    elif name.startswith("reduce") or name.startswith("arg") or name.startswith("cum"):
        flops = sum(_size(v.aval) for v in eqn.invars if hasattr(v, "aval"))
    elif name in _FREE:
        flops, nbytes = 0, 0
    elif name in _MOVEMENT:
        flops = 0
    else:
        flops = sum(_size(v.aval) for v in eqn.outvars)
    return Cost(int(flops), int(nbytes))


# Equations that move no data and do no arithmetic once XLA has compiled them.
# (Primitive names as JAX 0.9-0.10 spells them; tests/test_profile.py checks each one exists.)
_FREE = frozenset(
    {"reshape", "squeeze", "broadcast_in_dim", "convert_element_type", "stop_gradient",
     "optimization_barrier", "copy", "name"}
)


# Equations that move data but do no arithmetic.
_MOVEMENT = frozenset(
    {"slice", "dynamic_slice", "dynamic_update_slice", "concatenate", "transpose", "gather",
     "pad", "rev", "iota", "split", "select_and_gather_add"}
)


def function_cost(fn: Callable, *args: Any) -> Cost:
    """Cost of `fn(*args)` traced abstractly with `jax.make_jaxpr`."""
    return jaxpr_cost(jax.make_jaxpr(fn)(*args))
