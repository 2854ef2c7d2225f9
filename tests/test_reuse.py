"""Serialisation and reuse: eqx serialisation, optax, saved plans, planning from two threads."""

import io

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import smartremat
from smartremat import _planner
from smartremat import smartremat as sr

from benchmarks.models import TutorialStack
from tests.helpers import backward, in_threads, tree_allclose


@sr(budget_mb=0.5)
class Stack(TutorialStack):
    pass


def test_decorated_model_round_trips_through_eqx_serialisation():
    model = Stack(3, 64, 1024, jax.random.key(0))
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, model)
    buf.seek(0)
    loaded = eqx.tree_deserialise_leaves(buf, Stack(3, 64, 1024, jax.random.key(1)))
    assert type(loaded) is Stack and tree_allclose(loaded, model, rtol=0)


@pytest.mark.usefixtures("standard_promotion")  # optax's own `decay ** count`
def test_optax_adamw_trains_a_decorated_model():
    model = Stack(3, 64, 1024, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, 64))
    opt = optax.adamw(1e-3)
    state = opt.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(m, s):
        loss, g = eqx.filter_value_and_grad(lambda m: jnp.mean(m(x) ** 2))(m)
        updates, s = opt.update(g, s, eqx.filter(m, eqx.is_array))
        return loss, eqx.apply_updates(m, updates), s

    losses = []
    for _ in range(3):
        loss, model, state = step(model, state)
        losses.append(float(loss))
    assert type(model) is Stack and losses[-1] < losses[0]


def test_saved_plan_loads_and_skips_planning(tmp_path, monkeypatch):
    model = TutorialStack(3, 64, 1024, jax.random.key(0))
    x = jnp.ones((16, 64))
    plan = smartremat.explain(sr(budget_mb=0.5)(model), x)
    plan.save(str(tmp_path / "plan.json"))
    loaded = smartremat.load_plan(tmp_path / "plan.json")
    assert loaded.policies == plan.policies and loaded.assignment == plan.assignment
    assert loaded.blocks == plan.blocks and loaded.signature == plan.signature
    monkeypatch.setattr(_planner, "make_plan", lambda *a: pytest.fail("planned despite a loaded plan"))
    reused = sr(budget_mb=0.5, plan=loaded)(model)
    want = eqx.filter_grad(lambda m: jnp.sum(m(x)))(model)
    got = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(x))))(reused).module
    assert tree_allclose(got, want, rtol=1e-6)
    with pytest.raises(ValueError, match=r"`smartremat\(plan=\.\.\.\)` was made for a different module or input signature"):
        backward(reused, jnp.ones((8, 64)))
    with pytest.raises(TypeError, match=r"`smartremat\(plan=\.\.\.\)` should be a `smartremat.Plan`.*not str"):
        sr(budget_mb=0.5, plan=str(tmp_path / "plan.json"))
    with pytest.raises(ValueError, match=r"needs the JSON that `Plan.save` writes"):
        smartremat.load_plan({"blocks": []})


def test_two_threads_plan_once_and_agree(monkeypatch):
    model = TutorialStack(3, 64, 512, jax.random.key(3))
    x = jnp.ones((24, 64))
    smartremat.clear_caches()
    made, make_plan = [], _planner.make_plan
    monkeypatch.setattr(_planner, "make_plan", lambda *a: made.append(1) or make_plan(*a))
    plans = [None, None]

    def work(i):
        plans[i] = smartremat.explain(sr(budget_mb=0.3)(model), x)

    assert in_threads(work, 2) == [] and len(made) == 1 and plans[0] is plans[1]
