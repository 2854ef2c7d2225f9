"""The decorator's default verification holds for the losses users write, not only the ones it compiles.

Without `loss=`, plans are verified on squared error and softmax cross-entropy (soft targets and
integer labels). Here the user's own step uses other real losses: optax's integer-label
cross-entropy, a logsumexp, a Huber loss, and a loss that also reads an intermediate output the
module returns. At three budgets between the lowest smartremat accepts and no remat, the compiled
temp bytes of `jax.jit(jax.grad(user_loss))` fit.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import smartremat
from smartremat import MB

from benchmarks.models import TutorialStack
from tests.helpers import short_plan, tier, tree_allclose
from tests.models import Transformer


class WithHidden(eqx.Module):
    """Returns the output and the first layer's output (a loss may regularise it)."""

    layers: list

    def __call__(self, x):
        hidden = None
        for layer in self.layers:
            x = layer(x)
            hidden = x if hidden is None else hidden
        return x, hidden


LOSSES = {
    "optax_ce_labels": lambda out, y: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        out, jnp.argmax(y, axis=-1))),
    "logsumexp": lambda out, y: jnp.mean(jax.nn.logsumexp(out, axis=-1) - jnp.sum(out * y, axis=-1)),
    "huber": lambda out, y: jnp.mean(optax.huber_loss(out, y)),
    "reads_intermediate": lambda out, y: jnp.mean((out[0] - y) ** 2) + 0.1 * jnp.mean(out[1] ** 2),
}

MODELS = {
    "stack": (lambda: TutorialStack(4, 256, 2048, jax.random.key(0)).layers, (64, 256)),
    "transformer": (lambda: Transformer(3, 64, 4, jax.random.key(0)).layers, (4, 64, 64)),
}


def user_step(model, loss, x, y):
    params, static = eqx.partition(model, eqx.is_array)
    step = jax.jit(jax.grad(lambda p: loss(eqx.combine(p, static)(x), y)))
    compiled = step.lower(params).compile()
    return compiled.memory_analysis().temp_size_in_bytes, compiled(params)


# CI: every loss on the stack, and on the transformer (blocks of two pieces, nested options) the
# loss that reads an intermediate output; `make test-full`: every pair
PAIRS = tier([(m, l) for l in sorted(LOSSES) for m in sorted(MODELS)],
             [*((("stack", l) for l in LOSSES)), ("transformer", "reads_intermediate")])


@pytest.mark.parametrize("model_name,loss_name", PAIRS, ids=[f"{l}-{m}" for m, l in PAIRS])
def test_default_verification_fits_other_real_losses(model_name, loss_name, fit_log):
    make, shape = MODELS[model_name]
    model = WithHidden(make())
    loss = LOSSES[loss_name]
    x = jax.random.normal(jax.random.key(1), shape)
    y = jax.nn.softmax(jax.random.normal(jax.random.key(2), shape), axis=-1)
    if loss_name != "reads_intermediate":  # the module's output only
        loss = (lambda f: lambda out, y: f(out[0], y))(loss)
    none, want = user_step(model, loss, x, y)
    tiny = smartremat.smartremat(budget_mb=1e-3)(model)
    with pytest.raises(ValueError, match="at least") as e:
        smartremat.explain(tiny, x)
    floor = float(re.search(r"at least ([0-9.]+)", str(e.value)).group(1)) * MB
    assert floor < none, "remat should lower the peak below no remat's under this loss"
    for budget in np.linspace(none, floor, 3):
        wrapped = smartremat.smartremat(budget_mb=float(budget) / MB)(model)
        temp, got = user_step(wrapped, loss, x, y)
        plan = smartremat.explain(wrapped, x)
        fit_log.append((f"decorator, user loss {loss_name}", model_name, budget / MB, temp / MB,
                        short_plan(plan.policies)))
        assert temp <= budget, (loss_name, budget / MB, temp / MB, plan.policies)
        assert tree_allclose(jax.tree.leaves(got), jax.tree.leaves(want), rtol=1e-6)
