"""The main job: plan, explain and train two models on the CPU under a memory budget.

Run with `make demo` (which sets XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander
before JAX starts: on the CPU backend remat outside loops is otherwise undone by XLA).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import equinox as eqx
import jax
import jax.numpy as jnp

import smartremat
from benchmarks.models import GPT, TutorialStack, gpt_loss


def compiled_temp(model, loss, batch) -> int:
    """The compiler's temp bytes for the gradient of the user's own loss (never `jnp.sum(out)`)."""
    params, static = eqx.partition(model, eqx.is_array)
    step = jax.jit(jax.grad(lambda p, b: loss(eqx.combine(p, static), b)))
    return step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes


def sgd_step(loss, lr):
    """The user's whole training step: loss, gradient, SGD update."""

    def step(model, batch):
        value, grads = eqx.filter_value_and_grad(loss)(model, batch)
        return value, jax.tree.map(lambda p, g: p - lr * g, model, grads)

    return step


def train(step, model, batches):
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        value, model = step(model, batch)
        value = float(jax.block_until_ready(value))
        print(f"  step {i}: loss {value:.4f}  ({time.perf_counter() - t0:.2f} s{' incl. planning and compile' if i == 0 else ''})")
    return model


def demo(name, model, x, loss, batches, lr, fraction=0.5):
    """Plan `model` at `fraction` of its no-remat temp bytes, explain, check, train; then plan the
    whole training step with `smartremat.filter_jit`."""
    print(f"\n=== {name} ===")
    none_temp = compiled_temp(model, loss, batches[0])
    budget_mb = fraction * none_temp / smartremat.MB
    print(f"the gradient of your loss compiles to {none_temp / smartremat.MB:.2f} MB of temp without remat; "
          f"asking for budget_mb={budget_mb:.2f}")
    try:
        plan = smartremat.explain(model, x, budget_mb=budget_mb)
    except ValueError as e:  # the budget is below what any plan reaches: the error says the minimum
        print(f"  {e}")
        budget_mb = float(str(e).split("at least ")[1].split(",")[0])
        plan = smartremat.explain(model, x, budget_mb=budget_mb)
    print(plan)
    planned = smartremat.smartremat(budget_mb=budget_mb)(model)
    temp = compiled_temp(planned, loss, batches[0])
    fits = temp <= plan.budget_bytes
    print(f"compiled temp of your gradient step with the planned model: {temp / smartremat.MB:.2f} MB "
          f"(budget {budget_mb:.2f} MB): {'fits' if fits else 'DOES NOT FIT'}")
    print(f"training {len(batches)} steps (decorated model):")
    train(eqx.filter_jit(sgd_step(loss, lr)), planned, batches)

    fresh = lambda: jax.tree.map(lambda a: jnp.array(a, copy=True) if eqx.is_array(a) else a, model)  # noqa: E731
    unbound = smartremat.filter_jit(sgd_step(loss, lr), budget_mb=1e6, donate="all")  # binds nothing: no remat
    step_none = smartremat.explain(unbound, fresh(), batches[0]).compiled_peak_bytes
    step_mb = fraction * step_none / smartremat.MB
    try:
        step = smartremat.filter_jit(sgd_step(loss, lr), budget_mb=step_mb, donate="all")
        step_plan = smartremat.explain(step, fresh(), batches[0])
    except ValueError as e:  # gradients and updates take memory no remat plan can give back
        print(f"  {e}")
        step_mb = float(str(e).split("at least ")[1].split(",")[0])
        step = smartremat.filter_jit(sgd_step(loss, lr), budget_mb=step_mb, donate="all")
        step_plan = smartremat.explain(step, fresh(), batches[0])
    whole = step.lower(fresh(), batches[0]).compile().memory_analysis().temp_size_in_bytes
    fits &= whole <= step_plan.budget_bytes
    print(f"the whole step (loss, gradient, SGD update, arguments donated) compiles to "
          f"{step_none / smartremat.MB:.2f} MB of temp without remat; through "
          f"smartremat.filter_jit(budget_mb={step_mb:.2f}): {whole / smartremat.MB:.2f} MB, "
          f"{'fits' if whole <= step_plan.budget_bytes else 'DOES NOT FIT'}; policies {step_plan.policies}")
    train(step, fresh(), batches)
    return fits


def main() -> int:
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    key = jax.random.key(0)
    x = jax.random.normal(key, (64, 512))
    stack = TutorialStack(8, 512, 8192, key)
    mse = lambda m, xy: jnp.mean((m(xy[0]) - xy[1]) ** 2)  # the tutorial's own loss
    ok = demo("tutorial block x -> gelu(x @ W1) @ W2 (batch 64, 512 -> 8192 -> 512), residual stack of 8",
              stack, x, mse, [(x, jnp.tanh(x))] * 3, 1e-4)

    gpt = GPT(layers=4, d=128, heads=4, seq=128, vocab=256, key=key)
    tokens = jax.random.randint(key, (8, 129), 0, 256)
    ok &= demo("small transformer (4 layers, d=128, 4 heads, T=128, batch 8, vocab 256)",
               gpt, tokens[:, :-1], gpt_loss, [tokens] * 5, 0.5)
    print("\nall planned steps fit their budgets" if ok else "\nA PLANNED STEP EXCEEDED ITS BUDGET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
