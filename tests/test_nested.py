"""Nested blocks: a transformer layer's attention and MLP are options too, so smartremat searches
the module tree, not one level of it."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import smartremat
from smartremat import _model, _module_plan
from smartremat._decorator import make_config
from smartremat._spec import make_spec

from tests.helpers import tree_allclose
from tests.models import Transformer

MODEL = Transformer(4, 64, 4, jax.random.key(0))
X = jnp.ones((4, 64, 64))


def plan_of(budget_mb, nested, checked=False):
    config = make_config(budget_mb, calibrate=checked, verify=checked, nested=nested)
    return _module_plan.get_plan(type(MODEL).__call__, make_spec(MODEL, (X,), {}), MODEL, config)


def budgets():
    top = plan_of(1e6, True)
    return np.linspace(top.min_peak_bytes, top.no_remat_peak_bytes, 9)[1:-1] / 2**20


def test_nested_plans_are_never_costlier_and_strictly_cheaper_at_some_budget():
    """Which budget: the sixth of seven between the lowest reachable peak and no remat
    (10.49 MB here), where recomputing only the MLPs beats every layer-level plan."""
    costs = [(plan_of(b, True).recompute_flops, plan_of(b, False).recompute_flops) for b in budgets()]
    assert all(n <= f for n, f in costs)
    nested, flat = costs[4]
    assert nested < flat, costs
    chosen = plan_of(budgets()[4], True)
    assert any(b.policy.startswith("nested(") for b in chosen.blocks)
    assert any(path[-1] == ("attr", "mlp") for path, _ in chosen.assignment)


def test_nested_plan_fits_the_compiler_and_keeps_gradients():
    b = float(budgets()[4])
    nested, flat = plan_of(b, True, checked=True), plan_of(b, False, checked=True)
    assert nested.compiled_peak_bytes <= nested.budget_bytes
    assert nested.compiled_flops <= flat.compiled_flops
    wrapped = smartremat.smartremat(b)(MODEL)
    loss = lambda m, x: jnp.sum(jnp.tanh(m(x)))
    want = eqx.filter_jit(eqx.filter_grad(loss))(MODEL, X)
    got = eqx.filter_jit(eqx.filter_grad(loss))(wrapped, X)
    assert tree_allclose(got.module, want, rtol=1e-6)


@pytest.mark.parametrize("nested", [True, False])
def test_nested_option_names_its_sub_blocks(nested):
    plan = plan_of(float(budgets()[4]), nested)
    names = {o.name for b in plan.blocks for o in b.options}
    assert any(n.startswith("nested(") for n in names) == nested


class TwoShapes(eqx.Module):
    """One block called on two sequence lengths: its calls are tied, so one nested menu."""

    block: eqx.Module

    def __call__(self, x):
        return self.block(x).sum() + self.block(jnp.concatenate([x, x], axis=1)).sum()


def test_a_block_called_twice_has_one_nested_menu():
    model = TwoShapes(MODEL.layers[0])
    config = make_config(1e6, calibrate=False, verify=False)
    built = _model.build_model(type(model).__call__, make_spec(model, (X,), {}), model, config)
    assert len(built.calls) == 2 and built.menus[0] == built.menus[1] and len(built.menus[0]) > 4
