"""The main job, in about two minutes on a 2-core CPU: smartremat on the tutorial block and its stack.

1. The tutorial's own comparison (the standard and the checkpointed gradient of one block), and the
   same step through `smartremat.filter_jit` at the checkpointed step's compiled temp bytes.
2. The tutorial block stack planned under a budget: the plan and why (`smartremat.explain`), the
   compiler's temp bytes of the planned step against the budget, a few training steps; then the
   whole training step (loss, gradient, SGD update) planned with `smartremat.filter_jit`.
3. One model against every fixed strategy (no remat, full remat, uniform `dots_saveable` ...):
   fit (compiled temp bytes against each budget) and speed (step times, in interleaved rounds),
   as the full benchmark (`benchmarks/run.py`) measures every model.

Run with `make demo` (which sets XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander
before JAX starts: on the CPU backend remat outside loops is otherwise undone by XLA).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import equinox as eqx
import jax
import jax.numpy as jnp

import smartremat
from benchmarks import run as bench  # after JAX: the flag is make's (or yours) to set
from benchmarks.models import TutorialStack

#: The full benchmark, printed at the end: every model, smartremat's default and `tune=True` plans.
FULL = "python benchmarks/run.py --quick"


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


def plan_and_train(model, x, loss, batches, lr, fraction=0.5) -> bool:
    """Plan `model` at `fraction` of its no-remat temp bytes, explain, check, train; then plan the
    whole training step with `smartremat.filter_jit`. Whether both fit their budgets."""
    none_temp = compiled_temp(model, loss, batches[0])
    budget_mb = fraction * none_temp / smartremat.MB
    print(f"the gradient of your loss compiles to {none_temp / smartremat.MB:.2f} MB of temp without remat; "
          f"asking for budget_mb={budget_mb:.2f}")
    try:
        plan = smartremat.explain(model, x, budget_mb=budget_mb)
    except ValueError as e:  # the budget is below every plan smartremat compiled: the error says the minimum
        budget_mb = float(str(e).split("at least ")[1].split(",")[0])
        print(f"smartremat refuses it and says what is reachable:\n  {e}\nasking for budget_mb={budget_mb:.2f}")
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
    print(f"\nthe whole step (loss, gradient, SGD update, arguments donated) compiles to "
          f"{step_none / smartremat.MB:.2f} MB of temp without remat; asking smartremat.filter_jit for "
          f"budget_mb={step_mb:.2f}")
    try:
        step = smartremat.filter_jit(sgd_step(loss, lr), budget_mb=step_mb, donate="all")
        step_plan = smartremat.explain(step, fresh(), batches[0])
    except ValueError as e:  # gradients and updates take memory no remat plan can give back
        step_mb = float(str(e).split("at least ")[1].split(",")[0])
        print(f"smartremat refuses it and says what is reachable (the gradients and the update take memory "
              f"no remat gives back):\n  {e}\nasking for budget_mb={step_mb:.2f}")
        step = smartremat.filter_jit(sgd_step(loss, lr), budget_mb=step_mb, donate="all")
        step_plan = smartremat.explain(step, fresh(), batches[0])
    whole = step.lower(fresh(), batches[0]).compile().memory_analysis().temp_size_in_bytes
    fits &= whole <= step_plan.budget_bytes
    print(f"the whole step through smartremat.filter_jit(budget_mb={step_mb:.2f}) compiles to "
          f"{whole / smartremat.MB:.2f} MB: {'fits' if whole <= step_plan.budget_bytes else 'DOES NOT FIT'}; "
          f"policies {step_plan.policies}")
    print(f"training {len(batches)} steps (the planned whole step):")
    train(step, fresh(), batches)
    return fits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tutorial", choices=["tutorial", "tutorial_block", "gpt", "resnet"],
                    help="the model of part 3 (quick size, as `benchmarks/run.py --quick`)")
    ap.add_argument("--out", default="results/demo", help="where part 3 writes its JSON and plot")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")

    print("\n=== 1. The tutorial block x -> gelu(x @ W1) @ W2 (batch 64, 512 -> 8192 -> 512): "
          "its gradient standard, checkpointed by hand, and through smartremat ===")
    print(bench.tutorial_printout(repeat=5))

    print("\n=== 2. A residual stack of 8 tutorial blocks, planned at half its temp bytes without remat ===")
    key = jax.random.key(0)
    x = jax.random.normal(key, (64, 512))
    stack = TutorialStack(8, 512, 8192, key)
    mse = lambda m, xy: jnp.mean((m(xy[0]) - xy[1]) ** 2)  # the tutorial's own loss  # noqa: E731
    ok = plan_and_train(stack, x, mse, [(x, jnp.tanh(x))] * 3, 1e-4)

    print("\n=== 3. Fit and speed against every fixed strategy: smartremat at the budgets of no remat, "
          "of full remat and halfway ===")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = bench.run_model(bench.build(args.model, "quick"), bench.FIXED, n_budgets=3, repeat=5, out=out,
                             tunes=(False,), seconds=1.0)
    ok &= all(r["fits"] for r in result["smartremat"])
    print(f"(timings: {result['rounds']} interleaved rounds, on this machine as it is loaded now; "
          f"{out}/{args.model}.json and .png hold them)")

    print("\nall planned steps fit their budgets" if ok else "\nA PLANNED STEP EXCEEDED ITS BUDGET")
    print(f"demo done in {time.perf_counter() - t0:.0f} s. The full benchmark, every model at nine budgets, "
          f"smartremat's default plans and tune=True's (about 13 minutes on 2 cores):\n    {FULL}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
