"""Stateful and random-access layers under real remat plans: BatchNorm (with `eqx.nn.State`),
MultiheadAttention, Conv2d, LayerNorm, Embedding.

Each model is a stack of residual blocks holding the layer and an MLP, sized so that memory
binds: at budgets strictly between the compiled full-remat and no-remat temp bytes the plan must
checkpoint some block, its compiled peak must fit, and its gradients (and outputs, and for
BatchNorm the returned `State`) must equal the undecorated model's at rtol 1e-6 in f32.
Both sides are jitted: the undecorated BatchNorm model's eager and jitted gradients already differ
by ~1e-6 (9e-7 relative here), which would leave no margin at rtol 1e-6.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import smartremat

from tests.helpers import tier, tree_allclose, uniform

split = jax.random.split


def mlp(d: int, hidden: int, key) -> eqx.nn.MLP:
    return eqx.nn.MLP(d, d, hidden, depth=1, activation=jax.nn.gelu, key=key)


class LayerNormBlock(eqx.Module):
    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __call__(self, x):  # (T, d)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm)(x))


class AttentionBlock(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP

    def __call__(self, x):  # (T, d), per example
        x = x + self.attn(x, x, x)
        return x + jax.vmap(self.mlp)(x)


class ConvBlock(eqx.Module):
    up: eqx.nn.Conv2d
    down: eqx.nn.Conv2d

    def __call__(self, x):  # (C, H, W), per example
        return x + self.down(jax.nn.gelu(self.up(x)))


class EmbeddingBlock(eqx.Module):
    embed: eqx.nn.Embedding
    mlp: eqx.nn.MLP

    def __call__(self, x, tokens):  # (T, d), (T,) int
        return x + jax.vmap(self.mlp)(x + jax.vmap(self.embed)(tokens))


class BatchNormBlock(eqx.Module):
    norm: eqx.nn.BatchNorm
    mlp: eqx.nn.MLP

    def __call__(self, x, state):  # (d,) per example, state unbatched
        y, state = self.norm(x, state)
        return x + self.mlp(y), state


class Stack(eqx.Module):
    blocks: list

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class EmbeddingStack(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x, tokens)
        return x


class BatchNormStack(eqx.Module):
    blocks: list

    def __call__(self, x, state):
        for block in self.blocks:
            x, state = block(x, state)
        return x, state


@dataclass(frozen=True)
class Case:
    """`make()` -> `(model, args)`; `in_axes` None: called directly, else under one named vmap."""

    make: Callable[[], tuple[Any, tuple]]
    in_axes: tuple | None = None
    out_axes: Any = 0


def _layernorm():
    d, ks = 64, split(jax.random.key(0), 3)
    blocks = [LayerNormBlock(eqx.nn.LayerNorm(d), mlp(d, 256, k)) for k in ks]
    return Stack(blocks), (jax.random.normal(jax.random.key(1), (128, d)),)


def _attention():  # two blocks: tracing and compiling attention dominates the runtime
    d, ks = 32, split(jax.random.key(0), 2)
    blocks = [AttentionBlock(eqx.nn.MultiheadAttention(4, d, key=k1), mlp(d, 128, k2))
              for k1, k2 in (split(k) for k in ks)]
    return Stack(blocks), (jax.random.normal(jax.random.key(1), (8, 32, d)),)


def _conv():
    c, ks = 8, split(jax.random.key(0), 3)
    blocks = [ConvBlock(eqx.nn.Conv2d(c, 4 * c, 3, padding=1, key=k1),
                        eqx.nn.Conv2d(4 * c, c, 3, padding=1, key=k2))
              for k1, k2 in (split(k) for k in ks)]
    return Stack(blocks), (jax.random.normal(jax.random.key(1), (8, c, 16, 16)),)


def _embedding():
    d, vocab, ks = 64, 50, split(jax.random.key(0), 4)
    blocks = [EmbeddingBlock(eqx.nn.Embedding(vocab, d, key=k1), mlp(d, 256, k2))
              for k1, k2 in (split(k) for k in ks[1:])]
    tokens = jax.random.randint(jax.random.key(1), (128,), 0, vocab)  # repeats: scatter-adds
    return EmbeddingStack(eqx.nn.Embedding(vocab, d, key=ks[0]), blocks), (tokens,)


def _batchnorm(inference: bool = False):
    d, ks = 64, split(jax.random.key(0), 3)
    norm = lambda: eqx.nn.BatchNorm(d, axis_name="batch", mode="batch", inference=inference)
    model, state = eqx.nn.make_with_state(BatchNormStack)(
        [BatchNormBlock(norm(), mlp(d, 512, k)) for k in ks])
    return model, (jax.random.normal(jax.random.key(1), (64, d)) * 2.0 + 1.0, state)



CASES = {
    "layernorm": Case(_layernorm),
    "attention": Case(_attention, in_axes=(0,)),
    "conv2d": Case(_conv, in_axes=(0,)),
    "embedding": Case(_embedding),
    "batchnorm": Case(_batchnorm, in_axes=(0, None), out_axes=(0, None)),
    # running statistics only, no collective: State still threads through every checkpoint
    "batchnorm_inference": Case(functools.partial(_batchnorm, inference=True), in_axes=(0, None),
                                out_axes=(0, None)),
}


def run(model, case: Case, *args):
    if case.in_axes is None:
        return model(*args)
    return jax.vmap(model, in_axes=case.in_axes, out_axes=case.out_axes, axis_name="batch")(*args)


def loss(model, case: Case, *args):
    out = run(model, case, *args)
    y = out[0] if isinstance(out, tuple) else out
    return jnp.sum(jnp.tanh(y)), out


def compiled_temp(model, case: Case, args) -> int:
    params, static = eqx.partition(model, eqx.is_array)
    step = jax.jit(jax.grad(lambda p, *a: loss(eqx.combine(p, static), case, *a)[0]))
    return step.lower(params, *args).compile().memory_analysis().temp_size_in_bytes


def plan_of(wrapped, case: Case, args) -> smartremat.Plan:
    """The plan for the call exactly as `run` makes it (explain inside the same vmap, so an
    unbatched `State` keeps in_axes None, which `explain(vmap=True)` cannot express)."""
    if case.in_axes is None:
        return smartremat.explain(wrapped, *args)
    plans = []
    grab = lambda *a: plans.append(smartremat.explain(wrapped, *a)) or jnp.float32(0)
    jax.eval_shape(jax.vmap(grab, in_axes=case.in_axes, axis_name="batch"), *args)
    return plans[0]


# CI: every layer; BatchNorm with running statistics only under `make test-full` (the training
# BatchNorm threads the same State through every checkpoint)
@pytest.mark.parametrize("name", tier([
    *[n for n in CASES if n != "batchnorm"],
    "batchnorm",
], [n for n in CASES if n != "batchnorm_inference"]))
def test_remat_plans_fit_and_match_no_remat(name, request):
    if name == "batchnorm_inference":
        request.getfixturevalue("standard_promotion")
    case = CASES[name]
    model, args = case.make()
    where = lambda m: m.blocks
    none, full = (compiled_temp(uniform(model, p, where), case, args) for p in ("none", "full"))
    assert full < 0.8 * none, (full, none)  # memory binds: remat has room to act
    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))
    (_, want_out), want = grad(model, case, *args)
    for frac in (0.75, 0.1):
        budget_mb = (full + frac * (none - full)) / 2**20
        wrapped = smartremat.smartremat(budget_mb=budget_mb)(model)
        plan = plan_of(wrapped, case, args)
        assert any(b.policy != "none" for b in plan.blocks), plan.policies
        assert plan.compiled_peak_bytes <= plan.budget_bytes
        (_, out), got = grad(wrapped, case, *args)
        assert tree_allclose(got.module, want, rtol=1e-6)
        assert tree_allclose(out, want_out, rtol=1e-6)  # outputs; for BatchNorm also its State
