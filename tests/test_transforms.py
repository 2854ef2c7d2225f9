"""Transforms (jit, grad, vmap) and caching: one plan per signature, no re-profiling, no retrace."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import smartremat
from smartremat import _model, _planner
from smartremat import smartremat as sr

from benchmarks.models import TutorialStack
from tests.helpers import tree_allclose


def loss(m, x):
    return jnp.sum(m(x) ** 2)


@pytest.fixture(scope="module")
def model():
    return TutorialStack(3, 64, 1024, jax.random.key(0))


@pytest.mark.parametrize("transform", ["jax.jit+grad", "filter_jit+filter_value_and_grad", "grad"])
def test_transforms_give_plain_gradients(model, transform):
    x = jax.random.normal(jax.random.key(1), (16, 64))
    wrapped = sr(budget_mb=0.5)(model)
    want = jax.grad(loss)(model, x)
    if transform == "jax.jit+grad":
        got = jax.jit(jax.grad(loss))(wrapped, x).module
    elif transform == "filter_jit+filter_value_and_grad":
        value, got = eqx.filter_jit(eqx.filter_value_and_grad(loss))(wrapped, x)
        got = got.module
        assert jnp.allclose(value, loss(model, x), rtol=1e-6)
    else:
        got = jax.grad(loss)(wrapped, x).module
    assert tree_allclose(got, want, rtol=1e-6)


def test_vmap_budget_counts_whole_batch(model):
    # Per-example inputs under jax.vmap: the plan must see the batch.
    plans = {}
    for batch in (1, 32):
        xs = jnp.ones((batch, 64))
        wrapped = sr(budget_mb=0.4)(model)
        batched = lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2)
        got = eqx.filter_jit(eqx.filter_grad(batched))(wrapped, xs).module
        want = eqx.filter_grad(lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2))(model, xs)
        assert tree_allclose(got, want, rtol=1e-6)
        plans[batch] = smartremat.explain(wrapped, xs, vmap=True)
    assert plans[32].no_remat_peak_bytes > plans[32].budget_bytes > plans[1].no_remat_peak_bytes
    assert plans[1].policies != plans[32].policies
    assert set(plans[1].policies.values()) == {"none"}  # one example fits without remat
    # the plan explained is the plan the vmapped call made (same cache entry)
    assert smartremat.explain(wrapped, xs, vmap=True) is plans[32]
    assert plans[32].compiled_peak_bytes <= plans[32].budget_bytes


class Centred(eqx.Module):
    """A block whose forward averages over the vmapped batch, as BatchNorm does."""

    lin: eqx.nn.Linear

    def __call__(self, x):
        h = jax.nn.gelu(self.lin(x))
        return x + h - jax.lax.pmean(h, "batch")


class CentredStack(eqx.Module):
    blocks: list

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_vmap_axis_name_reaches_profiling_and_explain(monkeypatch):
    model = CentredStack([Centred(eqx.nn.Linear(32, 32, key=k)) for k in jax.random.split(jax.random.key(0), 3)])
    wrapped, xs = sr(budget_mb=0.05)(model), jnp.ones((64, 32))
    eqx.filter_grad(lambda w: jnp.mean(jax.vmap(w, axis_name="batch")(xs) ** 2))(wrapped)  # plans: pmean needs the name
    monkeypatch.setattr(_planner, "make_plan", lambda *a: pytest.fail("explain should reuse the plan"))
    plan = smartremat.explain(wrapped, xs, vmap="batch")  # the decorator's own cache entry
    assert plan.compiled_peak_bytes <= plan.budget_bytes
    monkeypatch.undo()
    with pytest.raises(NameError, match="unbound axis name: batch"):
        smartremat.explain(wrapped, xs, vmap=True)


def test_second_call_neither_reprofiles_nor_retraces(model, monkeypatch):
    profiled, traced = [], []
    real = _model.profile_block
    monkeypatch.setattr(_model, "profile_block", lambda *a, **k: profiled.append(1) or real(*a, **k))

    @sr(budget_mb=0.45)
    class Counted(TutorialStack):
        pass

    original = Counted.__smartremat__[1]
    m = Counted(3, 64, 1024, jax.random.key(5))

    @eqx.filter_jit
    def step(m, x):
        traced.append(1)
        return eqx.filter_grad(loss)(m, x)

    x = jnp.ones((16, 64))
    step(m, x)
    first = (len(profiled), len(traced))
    assert first[0] >= 1 and first[1] == 1
    step(m, x)
    step(m, x + 1.0)
    assert (len(profiled), len(traced)) == first
    step(m, jnp.ones((8, 64)))  # a new signature: planned and traced once more
    assert len(traced) == 2
    assert Counted.__smartremat__[1] is original
