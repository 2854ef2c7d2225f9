"""Calls and blocks smartremat cannot plan as usual: no crash where the plain model runs."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import smartremat
from smartremat import _planner
from smartremat import smartremat as sr

from tests.helpers import tree_allclose


class Iterate(eqx.Module):
    """Runs a `lax.while_loop` on its input: it cannot be reverse-differentiated w.r.t. it."""

    w: jax.Array

    def __call__(self, x):
        w = jax.lax.stop_gradient(self.w)
        return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.tanh(w @ c[0]), c[1] + 1), (x, 0))[0]


class Pipeline(eqx.Module):
    pre: Iterate
    body: eqx.nn.MLP

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.pre = Iterate(jax.random.normal(k1, (16, 16)) / 4)
        self.body = eqx.nn.MLP(16, 16, 64, 2, key=k2)

    def __call__(self, x):
        return self.body(self.pre(x))


def _loss(model, x):
    return jnp.mean((model(x) - 0.5) ** 2)


def test_forward_only_call_runs_the_plain_forward_without_planning(monkeypatch):
    model = Pipeline(jax.random.key(0))
    x = jnp.linspace(-1, 1, 16)

    def no_planning(*args, **kwargs):
        raise AssertionError("a forward-only call planned")

    monkeypatch.setattr(_planner, "make_plan", no_planning)
    wrapped = sr(budget_mb=0.01)(model)
    assert jnp.array_equal(wrapped(x), model(x))  # eager
    assert jnp.allclose(eqx.filter_jit(wrapped)(x), model(x), rtol=1e-6)  # under jit, nothing differentiated
    assert jnp.allclose(jax.vmap(wrapped)(jnp.stack([x, -x])), jax.vmap(model)(jnp.stack([x, -x])), rtol=1e-6)


def test_block_that_cannot_be_differentiated_is_left_alone_and_noted():
    model = Pipeline(jax.random.key(0))
    x = jnp.linspace(-1, 1, 16)
    wrapped = sr(budget_mb=1.0)(model)
    plan = smartremat.explain(wrapped, x)
    row = next(b for b in plan.blocks if b.path == "pre")
    assert row.policy == "none" and [o.name for o in row.options] == ["none"]
    assert any("pre (Iterate)" in n and "cannot be reverse-differentiated" in n for n in plan.notes)
    got = eqx.filter_jit(eqx.filter_grad(_loss))(wrapped, x)
    assert tree_allclose(got.module, eqx.filter_grad(_loss)(model, x))


class Complex(eqx.Module):
    """A complex matmul: `dots_saveable` raises inside JAX for it (`reduce_precision` of complex64)."""

    w: jax.Array

    def __call__(self, x):
        z = x.astype(jnp.complex64) @ (self.w.astype(jnp.complex64) * (1 + 1j))
        return jnp.real(z * jnp.conj(z)) @ self.w.T


class Mixed(eqx.Module):
    a: Complex
    b: eqx.nn.Linear

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


def test_option_that_fails_for_a_block_is_skipped_for_that_block_only():
    model = Mixed(Complex(jnp.eye(16) / 4), eqx.nn.Linear(16, 16, key=jax.random.key(1)))
    x = jnp.linspace(-1, 1, 16)
    with pytest.raises(TypeError, match="reduce_precision"):  # what JAX does with the policy itself
        jax.grad(lambda m: jnp.sum(jax.checkpoint(lambda a: a(x), policy=jax.checkpoint_policies.dots_saveable)(m)))(model.a)
    plan = smartremat.explain(model, x, budget_mb=1.0)
    rows = {b.path: b for b in plan.blocks}
    names_a = {o.name for o in rows["a"].options} | {m for o in rows["a"].options for m in o.merged}
    names_b = {o.name for o in rows["b"].options} | {m for o in rows["b"].options for m in o.merged}
    assert "dots_saveable" not in names_a and "nothing_saveable" in names_a
    assert "dots_saveable" in names_b
    assert any(n.startswith("a (Complex): dots_saveable left out") and "reduce_precision" in n for n in plan.notes)
    wrapped = sr(budget_mb=plan.min_peak_bytes / 2**20)(model)
    got = eqx.filter_jit(eqx.filter_grad(_loss))(wrapped, x)
    assert tree_allclose(got.module, eqx.filter_grad(_loss)(model, x))
