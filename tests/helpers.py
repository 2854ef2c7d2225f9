"""Shared test helpers: tree comparison and the compiler's figures for a training step."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
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


def step_figures(model: Any, *args: Any) -> tuple[int, float]:
    """Compiled temp bytes and FLOPs of `grad(sum(model(*args)))` w.r.t. the model's arrays."""
    params, static = eqx.partition(model, eqx.is_array)
    loss = lambda p, *a: jnp.sum(eqx.combine(p, static)(*a))
    compiled = jax.jit(jax.grad(loss)).lower(params, *args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return compiled.memory_analysis().temp_size_in_bytes, float(cost["flops"])


def _call(module, *args, **kwargs):
    return module(*args, **kwargs)


class Uniform(eqx.Module):
    """A hand-written uniform plan: `eqx.filter_checkpoint(policy)` around a sub-module."""

    module: Any
    policy: Any = eqx.field(static=True)

    def __call__(self, *args):
        return eqx.filter_checkpoint(_call, policy=self.policy)(self.module, *args)


def uniform(model: Any, policy: Any, where=lambda m: m.layers) -> Any:
    """`model` with every block named by `where` checkpointed under `policy` (None: as is)."""
    if policy is None:
        return model
    if where is None:
        return Uniform(model, policy)
    return eqx.tree_at(where, model, [Uniform(b, policy) for b in where(model)])
