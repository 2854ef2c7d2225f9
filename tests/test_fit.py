"""The budget promise, held against the compiler (issue: fit, measured by the compiler)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import smartremat
from smartremat import MB

from helpers import step_figures, uniform
from models import GPT, MLPStack, Transformer, TutorialBlock

UNIFORM = ["none", "dots", "dots_nb", "full"]

CASES = {
    # name: (model, input, where the blocks are for hand-written uniform plans)
    "tutorial": (lambda: TutorialBlock(512, 8192, jax.random.key(0)), (64, 512), None),
    "tutorial_stack": (lambda: MLPStack(4, 512, 8192, jax.random.key(0)), (64, 512), lambda m: m.layers),
    "transformer": (lambda: Transformer(4, 128, 4, jax.random.key(0)), (4, 128, 128), lambda m: m.layers),
    # embedding and head outside the blocks: a fixed part of the peak
    "gpt": (lambda: GPT(3, 64, 4, 64, 512, jax.random.key(0)), (8, 64), lambda m: m.layers),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    make, shape, where = CASES[request.param]
    model = make()
    x = jnp.ones(shape, jnp.float32) if request.param != "gpt" else jnp.arange(8 * 64).reshape(shape) % 512
    uniforms = [(p, *step_figures(uniform(model, p, where), x)) for p in UNIFORM]
    none_temp, full_temp = uniforms[0][1], uniforms[-1][1]
    lo, hi = sorted((none_temp, full_temp))
    budgets = np.linspace(hi, lo, 5) if hi > lo else np.full(5, hi)
    return request.param, model, x, uniforms, budgets


def test_compiled_temp_fits_is_monotone_and_no_costlier_than_uniform(case):
    name, model, x, uniforms, budgets = case
    temps = []
    for budget in budgets:
        wrapped = smartremat.smartremat(budget_mb=float(budget) / MB)(model)
        temp, flops = step_figures(wrapped, x)
        plan = smartremat.explain(wrapped, x)
        assert temp <= plan.budget_bytes, (name, budget, temp, plan.policies)
        fitting = [f for _, t, f in uniforms if t <= plan.budget_bytes]
        assert fitting, "the no-remat or full-remat plan fits every budget tested"
        assert flops <= min(fitting) * (1 + 1e-9), (name, budget, flops, min(fitting))
        assert plan.compiled_peak_bytes == temp
        temps.append(temp)
    assert all(b <= a for a, b in zip(temps, temps[1:])), temps
