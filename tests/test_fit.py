"""The budget promise, held against the compiler on the user's own training step.

Every step here uses a real loss (`benchmarks.strategies.output_loss`: squared error against targets,
or next-token cross-entropy for the GPT), never `jnp.sum(out)`. Four budgets from full remat's
compiled temp bytes to no remat's, per model: the decorated model's step fits, its temp bytes
never rise as the budget falls, and its gradients equal no remat's, with the model's own pytree
structure.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import smartremat
from benchmarks.strategies import compile_step, exact
from smartremat import MB

from benchmarks.models import TutorialBlock, TutorialStack
from tests.helpers import short_plan, tier, tree_allclose, uniform
from tests.models import Batched, ConvNet, TokenTransformer, Transformer

UNIFORM = ["none", "dots", "dots_nb", "full"]

CASES = {
    # name: (model, input, where the blocks are for hand-written uniform plans, run under jax.vmap)
    "tutorial": (lambda: TutorialBlock(512, 8192, jax.random.key(0)), (64, 512), None, False),  # seed size
    "stack": (lambda: TutorialStack(4, 256, 2048, jax.random.key(0)), (64, 256), lambda m: m.layers, False),
    "transformer": (lambda: Transformer(4, 128, 4, jax.random.key(0)), (4, 128, 128), lambda m: m.layers, False),
    # embedding and head outside the blocks: a fixed part of the peak; next-token cross-entropy
    "gpt": (lambda: TokenTransformer(3, 64, 4, 64, 512, jax.random.key(0)), (8, 64), lambda m: m.layers, False),
    "convnet_vmap": (lambda: ConvNet(3, 16, 10, jax.random.key(0)), (16, 3, 32, 32), lambda m: m.blocks, True),
}


def _input(name, shape):
    if name == "gpt":
        return jnp.arange(np.prod(shape)).reshape(shape) % 512
    return jax.random.normal(jax.random.key(3), shape)


# CI: the transformer and the GPT are planned whole-step in tests/test_step.py, the transformer's
# layers under other losses in tests/test_losses.py; `make test-full` runs them here too
@pytest.fixture(scope="module", params=tier(sorted(CASES), ["convnet_vmap", "stack", "tutorial"]))
def case(request):
    make, shape, where, vmapped = CASES[request.param]
    model = make()
    x = _input(request.param, shape)
    user = Batched if vmapped else (lambda m: m)  # what the user's loss calls
    uniforms = {p: compile_step(user(uniform(model, p, where)), x) for p in UNIFORM}
    temps = [uniforms[p][2] for p in ("none", "full")]
    run, params = uniforms["none"][:2]
    want = run(params, x)  # gradients of the plain model (its own pytree)
    want = want.model if vmapped else want
    figures = {p: (u[2], u[3]) for p, u in uniforms.items()}
    return request.param, model, x, user, figures, temps, want


def _floor(model, x, vmapped, **options) -> float:
    """The lowest budget smartremat accepts, as its error states it (MB, rounded up)."""
    tiny = smartremat.smartremat(budget_mb=1e-3, **options)(model)
    with pytest.raises(ValueError, match=r"Raise `budget_mb` to at least") as e:
        smartremat.explain(tiny, x, vmap=vmapped)
    return float(re.search(r"at least ([0-9.]+)", str(e.value)).group(1))


def _check(case, fit_log, test, **options):
    """Four budgets from the lowest smartremat accepts (at or above full remat's temp bytes in the
    user's step) to no remat's: each fits, temp bytes never rise, gradients equal no remat's."""
    name, model, x, user, uniforms, (none, full), want = case
    low = max(full, _floor(model, x, user is Batched, **options) * MB)
    budgets = np.linspace(max(none, low), low, 4)
    temps, flops_seen = [], []
    for budget in budgets:
        wrapped = smartremat.smartremat(budget_mb=float(budget) / MB, **options)(model)
        run, params, temp, flops = compile_step(user(wrapped), x)
        plan = smartremat.explain(wrapped, x, vmap=user is Batched)
        assert temp <= plan.budget_bytes, (name, budget, temp, plan.policies)
        assert temp <= plan.compiled_peak_bytes  # the plan's figure bounds the user's step
        got = run(params, x)
        got = got.model.module if user is Batched else got.module  # the wrapper holds the same arrays
        assert jax.tree.structure(got) == jax.tree.structure(want)  # the gradient pytree is the model's
        assert tree_allclose(got, want, rtol=1e-6), (name, plan.policies)
        temps.append(temp)
        flops_seen.append(flops)
        fit_log.append((test, name, budget / MB, temp / MB, short_plan(plan.policies)))
    assert all(b <= a for a, b in zip(temps, temps[1:])), temps
    return budgets, temps, flops_seen


def test_fits_the_users_step_with_the_default_losses(case, fit_log):
    """No `loss=`: plans are verified on squared error and cross-entropy, and fit the user's loss."""
    _, temps, _ = _check(case, fit_log, "decorator, default losses")
    assert temps[-1] < temps[0], "the lowest budget should need remat"


def test_exact_loss_is_never_costlier_than_the_best_fitting_uniform_plan(case, fit_log):
    """With `loss=` the user's own loss is compiled, so fit and cost are exact on their step."""
    name, model, x, user, uniforms, _, _ = case
    budgets, _, flops_seen = _check(case, fit_log, "decorator, loss=", **exact(user(model), x))
    for budget, flops in zip(budgets, flops_seen):
        fitting = [f for t, f in uniforms.values() if t <= budget]
        assert flops <= min(fitting) * (1 + 1e-9), (name, budget, flops, min(fitting))
