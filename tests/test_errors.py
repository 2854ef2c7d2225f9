import math

import jax
import jax.numpy as jnp
import pytest

import smartremat
from smartremat import smartremat as sr

from models import MLPStack, TutorialBlock


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, "10", None, True])
def test_bad_budget(bad):
    with pytest.raises(ValueError, match=r"budget_mb=\.\.\.\)` should be a positive, finite number .*not " + __import__("re").escape(repr(bad))):
        sr(budget_mb=bad)


def test_not_a_module_class():
    with pytest.raises(TypeError, match=r"decorates `eqx.Module` subclasses or instances, not the class 'Foo'"):
        @sr(budget_mb=1)
        class Foo:
            pass


def test_not_a_module_instance():
    with pytest.raises(TypeError, match=r"should be applied to an `eqx.Module` subclass or a callable module instance, not function"):
        sr(budget_mb=1)(lambda x: x)


def test_blocks_not_callable_argument():
    with pytest.raises(TypeError, match=r"`smartremat\(blocks=\.\.\.\)` should be a function .* not 3"):
        sr(budget_mb=1, blocks=3)


def test_blocks_naming_nothing_callable():
    model = MLPStack(2, 16, 32, jax.random.key(0))
    wrapped = sr(budget_mb=1, blocks=lambda m: m.layers[0].block.w1)(model)
    with pytest.raises(ValueError, match=r"`smartremat\(blocks=\.\.\.\)` returned ArrayImpl .* not a callable `eqx.Module`"):
        wrapped(jnp.ones((2, 16)))


def test_blocks_returning_nothing():
    model = MLPStack(2, 16, 32, jax.random.key(0))
    with pytest.raises(ValueError, match=r"returned no sub-modules"):
        sr(budget_mb=1, blocks=lambda m: [])(model)(jnp.ones((2, 16)))


def test_bad_policies():
    with pytest.raises(TypeError, match=r"`smartremat\(policies=\.\.\.\)` holds 'dots', which is not a `jax.checkpoint` policy"):
        sr(budget_mb=1, policies=["dots"])
    with pytest.raises(TypeError, match=r"should be a sequence of `jax.checkpoint` policies"):
        sr(budget_mb=1, policies=jax.checkpoint_policies.dots_saveable)


@pytest.mark.parametrize("verify", [True, False])
def test_infeasible_budget_states_minimum(verify):
    model = MLPStack(3, 64, 512, jax.random.key(0))
    x = jnp.ones((32, 64))
    with pytest.raises(ValueError, match=r"`smartremat\(budget_mb=0\.001\)` is below the lowest peak .*: \d+\.\d+ MB .*Raise `budget_mb` to at least") as e:
        sr(budget_mb=0.001, verify=verify)(model)(x)
    floor = float(__import__("re").search(r"at least (\d+\.\d+)", str(e.value)).group(1))
    plan = smartremat.explain(sr(budget_mb=floor, verify=verify)(model), x)  # the minimum is reachable
    assert plan.predicted_peak_bytes <= plan.budget_bytes or plan.compiled_peak_bytes <= plan.budget_bytes
    with pytest.raises(ValueError, match="below the lowest peak"):
        smartremat.explain(sr(budget_mb=floor - 0.02, verify=verify)(model), x)


def test_explain_plain_module_needs_budget():
    with pytest.raises(ValueError, match=r"pass `budget_mb=\.\.\.`"):
        smartremat.explain(TutorialBlock(8, 8, jax.random.key(0)), jnp.ones((2, 8)))
    with pytest.raises(TypeError, match=r"`explain\(model=\.\.\.\)` should be an `eqx.Module`, not function"):
        smartremat.explain(lambda x: x, jnp.ones(2), budget_mb=1)
