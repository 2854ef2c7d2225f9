"""Bytes come from the real dtypes (bf16, f16, mixed f32-master / bf16-compute); dropout masks recompute exactly."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import smartremat
from smartremat import smartremat as sr

from benchmarks.models import TutorialStack
from tests.helpers import step_figures, tree_allclose, uniform


def cast(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, tree)


class Mixed(eqx.Module):
    """f32 master weights, bf16 compute: the classic mixed-precision pattern."""

    inner: TutorialStack

    def __call__(self, x):
        return cast(self.inner, jnp.bfloat16)(x.astype(jnp.bfloat16)).astype(jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_halves_the_bytes_and_fits(dtype):
    f32 = TutorialStack(3, 64, 512, jax.random.key(0))
    half = cast(f32, dtype)
    x = jnp.ones((32, 64))
    # The jaxpr-level profile (calibrate=False) counts bytes from the dtypes: exactly half.
    # (The compiler's own figures on the CPU are not half: XLA:CPU computes bf16 in f32.)
    p32 = smartremat.explain(sr(budget_mb=100, verify=False, calibrate=False)(f32), x)
    p16 = smartremat.explain(sr(budget_mb=100, verify=False, calibrate=False)(half), x.astype(dtype))
    for b32, b16 in zip(p32.blocks, p16.blocks):
        for o32, o16 in zip(b32.options, b16.options):
            assert o16.saved_bytes * 2 == o32.saved_bytes
    ends = [step_figures(uniform(half, p, lambda m: m.layers), x.astype(dtype))[0] for p in ("none", "full")]
    wrapped = sr(budget_mb=sum(ends) / 2 / 2**20)(half)
    temp, _ = step_figures(wrapped, x.astype(dtype))
    assert temp <= wrapped.config.budget_bytes


def test_mixed_precision_counts_bf16_activations():
    inner = TutorialStack(3, 64, 512, jax.random.key(0))
    x = jnp.ones((32, 64))
    cfg = dict(budget_mb=100, verify=False, calibrate=False)
    plan = smartremat.explain(sr(**cfg, blocks=lambda m: m.inner.layers)(Mixed(inner)), x)
    ref = smartremat.explain(sr(**cfg)(inner), x)
    full = [o for o in plan.blocks[0].options if o.name == "nothing_saveable"][0]
    full32 = [o for o in ref.blocks[0].options if o.name == "nothing_saveable"][0]
    assert full.saved_bytes * 2 == full32.saved_bytes  # the block's saved input is bf16
    for o16, o32 in zip(plan.blocks[1].options, ref.blocks[1].options):
        assert o16.saved_bytes * 2 == o32.saved_bytes


class DropBlock(eqx.Module):
    lin: eqx.nn.Linear
    drop: eqx.nn.Dropout

    def __call__(self, x, *, key):
        return x + self.drop(jax.nn.gelu(jax.vmap(self.lin)(x)), key=key)


class DropNet(eqx.Module):
    blocks: list

    def __call__(self, x, key):
        for block, k in zip(self.blocks, jax.random.split(key, len(self.blocks))):
            x = block(x, key=k)
        return x


def test_dropout_masks_recompute_exactly():
    keys = jax.random.split(jax.random.key(0), 3)
    net = DropNet([DropBlock(eqx.nn.Linear(64, 64, key=k), eqx.nn.Dropout(0.5)) for k in keys])
    x, key = jnp.ones((128, 64)), jax.random.key(1)
    loss = lambda m, x, k: jnp.sum(m(x, k) ** 2)
    want = eqx.filter_grad(loss)(net, x, key)
    seen = set()
    for budget in (1.0, 0.4, 0.33):
        wrapped = sr(budget_mb=budget)(net)
        seen.add(tuple(smartremat.explain(wrapped, x, key).policies.values()))
        got = eqx.filter_jit(eqx.filter_grad(loss))(wrapped, x, key).module
        assert tree_allclose(got, want, rtol=1e-6)
    assert any(p != "none" for plan in seen for p in plan), seen
