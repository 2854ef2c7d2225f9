"""The fixed remat strategies smartremat is held against, and the training step they are all
measured on: a real loss, compiled once, read for its temp bytes and FLOPs.

One definition for the benchmarks, the studies (`studies/`) and the tests. Importing this module
changes nothing around it (no flags, no environment), unlike `benchmarks/common.py`, which a
benchmark script imports first.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

cp = jax.checkpoint_policies
UNIFORM = {"none": None, "dots": cp.dots_saveable, "dots_nb": cp.dots_with_no_batch_dims_saveable,
           "full": cp.nothing_saveable}


def _call(m, *a, **kw):
    return m(*a, **kw)


class Ckpt(eqx.Module):
    """A hand-placed `eqx.filter_checkpoint(policy)` around one module."""

    module: Any
    policy: Any = eqx.field(static=True)

    def __call__(self, *a, **kw):
        return eqx.filter_checkpoint(_call, policy=self.policy)(self.module, *a, **kw)


class Segment(eqx.Module):
    """Consecutive blocks run under one checkpoint (Chen et al.'s sqrt(n) segments)."""

    blocks: list

    def __call__(self, x):
        def run(blocks, x):
            for b in blocks:
                x = b(x)
            return x

        return eqx.filter_checkpoint(run, policy=cp.nothing_saveable)(self.blocks, x)


def _placed(block: Any, policy: str) -> Any:
    """One block of a mixed strategy: a uniform policy name, or `attn:<name>` for the block's
    `attn` sub-module alone under that policy (the rest of the block without remat)."""
    if policy.startswith("attn:"):
        return eqx.tree_at(lambda b: b.attn, block, Ckpt(block.attn, UNIFORM[policy[5:]]))
    return block if policy == "none" else Ckpt(block, UNIFORM[policy])


def mixed(blocks: list, name: str) -> list:
    """Per-block policies from `name` like `attn:dots_nb*3+dots_nb*18+none*3` (counts in block order)."""
    policies = [p for part in name.split("+") for p in [part.split("*")[0]] * int((part.split("*") + ["1"])[1])]
    if len(policies) != len(blocks) or not all(p.removeprefix("attn:") in UNIFORM for p in policies):
        raise ValueError(f"strategy {name!r}: {len(policies)} policies of {sorted(UNIFORM)} (or attn:<one>) "
                         f"for {len(blocks)} blocks")
    return [_placed(b, p) for b, p in zip(blocks, policies)]


def strategy(model: Any, name: str, where: Callable | None) -> Any:
    """`model` under a fixed strategy: none, full, dots, dots_nb, alternate, sqrt, or per-block policies
    (`mixed`)."""
    if name == "none":
        return model
    if where is None:  # the module's own call is the only block
        pol = UNIFORM.get(name, cp.nothing_saveable)
        return Ckpt(model, pol) if name in UNIFORM else model
    blocks = list(where(model))
    if name in UNIFORM:
        return eqx.tree_at(where, model, [Ckpt(b, UNIFORM[name]) for b in blocks])
    if name == "alternate":
        return eqx.tree_at(where, model, [Ckpt(b, cp.nothing_saveable) if i % 2 == 0 else b
                                          for i, b in enumerate(blocks)])
    if name == "sqrt":
        k = max(1, round(math.sqrt(len(blocks))))
        return eqx.tree_at(where, model, [Segment(blocks[i:i + k]) for i in range(0, len(blocks), k)])
    if "*" in name or "+" in name:
        return eqx.tree_at(where, model, mixed(blocks, name))
    raise ValueError(f"unknown strategy {name!r}")


def output_loss(out: Any, target: Any) -> jax.Array:
    """A real loss, never `jnp.sum(out)` (a constant cotangent lets XLA simplify the backward):
    cross-entropy against integer labels (next tokens), else the squared error against `target`."""
    out = out.astype(jnp.float32)
    if jnp.issubdtype(target.dtype, jnp.integer):
        logp = jax.nn.log_softmax(out, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, target[..., None], axis=-1))
    return jnp.mean((out - target.astype(jnp.float32)) ** 2)


def loss_of(model: Any, x: Any, target: Any) -> jax.Array:
    return output_loss(model(x), target)


def target_of(model: Any, x: Any) -> Any:
    """The step's targets: the tokens shifted by one for a model of tokens, else fixed noise."""
    out = jax.eval_shape(model, x)
    if jnp.issubdtype(x.dtype, jnp.integer) and out.shape[:-1] == x.shape:
        return jnp.roll(x, -1, axis=-1)
    return jax.random.normal(jax.random.key(7), out.shape, out.dtype)


def exact(model: Any, x: Any) -> dict:
    """`smartremat(**exact(model, x))` verifies plans on exactly this benchmark's loss."""
    t = target_of(model, x)
    return {"loss": output_loss, "loss_args": (jax.ShapeDtypeStruct(t.shape, t.dtype),)}


def grad_step(model: Any, x: Any):
    """`(jitted step, params, target)`: the gradient of `loss_of` w.r.t. the model's arrays."""
    params, static = eqx.partition(model, eqx.is_array)
    step = jax.jit(jax.grad(lambda p, a, t: loss_of(eqx.combine(p, static), a, t)))
    return step, params, target_of(model, x)


def compile_step(model: Any, x: Any, program: bool = False):
    """`(step(params, x), params, temp bytes, FLOPs)` of the training step, compiled once; with
    `program`, also its `program_text`."""
    step, params, target = grad_step(model, x)
    c = step.lower(params, x, target).compile()
    cost = c.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    run = lambda p, a: c(p, a, target)  # noqa: E731  (the targets are part of the step)
    out = (run, params, c.memory_analysis().temp_size_in_bytes, float(cost["flops"]))
    return out + (program_text(c.as_text()),) if program else out


def program_text(hlo: str) -> str:
    """The optimised HLO of a compiled step with what does not change the program left out: the
    source locations (file and function names, line numbers), instruction and parameter names
    (renumbered in order of appearance) and the module's name. Two steps of equal text run the
    same instructions on buffers laid out alike: one program, compiled twice."""
    lines = hlo.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(("%", "ENTRY"))), 0)
    text = re.sub(r",? ?metadata=\{[^}]*\}", "", "\n".join(lines[start:]))
    text = re.sub(r"\b[\w.\-]+: ", "", text)  # parameter names in computation signatures
    names: dict[str, str] = {}
    return re.sub(r"%[\w.\-]+", lambda m: names.setdefault(m.group(0), f"%v{len(names)}"), text)


def figures(model: Any, x: Any) -> tuple[int, float]:
    """Compiled temp bytes and FLOPs of the training step."""
    return compile_step(model, x)[2:]
