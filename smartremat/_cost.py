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


def aval_bytes(aval: Any) -> int:
    """Bytes of one device's share of `aval` (its shard, when sharded over a mesh)."""
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    sharding = getattr(aval, "sharding", None)
    if sharding is not None and getattr(getattr(sharding, "mesh", None), "size", 1) > 1:
        try:
            shape = tuple(sharding.shard_shape(tuple(shape)))
        except Exception:  # a spec that does not divide the shape: count the whole array
            pass
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys): count their storage
        itemsize = getattr(dtype, "itemsize", 4) or 4
    return int(math.prod(shape)) * int(itemsize)


def _size(aval: Any) -> int:
    return int(math.prod(getattr(aval, "shape", ())))


def jaxpr_cost(jaxpr: jcore.Jaxpr | jcore.ClosedJaxpr) -> Cost:
    """Total FLOPs and bytes of a (closed) jaxpr, descending into calls, scans and remat."""
    total = Cost()
    jaxpr = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") and not isinstance(jaxpr, jcore.Jaxpr) else jaxpr
    for eqn in jaxpr.eqns:
        p, name = eqn.params, eqn.primitive.name
        subs = [p[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if p.get(k) is not None]
        if name == "cond":  # it costs its costliest branch
            total += max((jaxpr_cost(b) for b in p["branches"]), key=lambda c: c.flops)
        elif name == "scan":
            total += jaxpr_cost(p["jaxpr"]).scale(int(p["length"]))
        elif name == "while":
            total += jaxpr_cost(p["body_jaxpr"]) + jaxpr_cost(p["cond_jaxpr"])
        elif subs:
            total += sum((jaxpr_cost(s) for s in subs), Cost())
        else:
            total += eqn_cost(eqn)
    return total


def eqn_cost(eqn: Any) -> Cost:  # a jcore.JaxprEqn, whose avals JAX does not type
    """FLOPs and bytes of one primitive equation (no sub-jaxprs)."""
    nbytes = sum(aval_bytes(v.aval) for v in eqn.invars if hasattr(v, "aval"))
    nbytes += sum(aval_bytes(v.aval) for v in eqn.outvars)
    name = eqn.primitive.name
    if name == "dot_general":  # 2 x outputs x contracted size
        (contract, _), _ = eqn.params["dimension_numbers"]
        flops = 2 * _size(eqn.outvars[0].aval) * math.prod(eqn.invars[0].aval.shape[d] for d in contract)
    elif name == "conv_general_dilated":  # 2 x outputs x kernel size per output feature
        rhs = eqn.invars[1].aval.shape
        per_output = math.prod(rhs) // rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
        flops = 2 * _size(eqn.outvars[0].aval) * per_output
    elif name.startswith(("reduce", "arg", "cum")):
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
_FREE = frozenset({"reshape", "squeeze", "broadcast_in_dim", "convert_element_type", "stop_gradient",
                   "optimization_barrier", "copy", "name"})

# Equations that move data but do no arithmetic.
_MOVEMENT = frozenset({"slice", "dynamic_slice", "dynamic_update_slice", "concatenate", "transpose", "gather",
                       "pad", "rev", "iota", "split", "select_and_gather_add"})


def function_cost(fn: Callable, *args: Any) -> Cost:
    """Cost of `fn(*args)` traced abstractly with `jax.make_jaxpr`."""
    return jaxpr_cost(jax.make_jaxpr(fn)(*args))
