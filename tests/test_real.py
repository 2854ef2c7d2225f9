"""Real Equinox models written by others (`tests/real/`), planned with `smartremat.filter_jit`.

Each model is copied from its public source with only its sizes shrunk (see each module's
docstring): the Equinox docs' U-Net (score-based diffusion), BERT and vision transformer,
midGPT's scanned GPT trained per sequence under `jax.vmap`, and jaxonmodels' ResNet-18 with
BatchNorm state. The step is the source's own loss and its gradient,
`eqx.filter_grad(loss)(model, batch)` (with the new BatchNorm state as aux for the ResNet).

Per model: the plain step's compiled temp bytes (no remat) and the lowest budget smartremat
accepts (as its error states it) bracket the budgets: half way and the lowest one (`make test-full`:
three, from two thirds of the way up to the lowest one). At each, the planned step's own compiled temp bytes fit the budget and its outputs
equal the plain step's (1e-6 relative to each array's largest entry, or twice the error of a
hand-written checkpoint of the whole loss where that is larger; arrays that are zero up to
rounding, below 1e-6 of the largest gradient entry, count as zero); at the lowest, the
plan recomputes something. For BERT, some budget's plan checkpoints one encoder layer (or part
of one) on its own. Every check runs and the failures are reported together. The blocks found, planning time,
budgets, compiled temps and the model's predicted peaks are printed (`pytest -s`) and logged to `fit_log`.
"""

import os
import re
import time
from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest

import smartremat
from smartremat import MB

from tests.helpers import FULL, short_plan
from tests.real import bert, nanogpt, resnet, unet, vit

MODELS = {m.NAME: m for m in (unet, bert, vit, nanogpt, resnet)}
# Planning takes minutes per model on 2 CPU cores (issue 12): CI runs the vision transformer (a
# scanned GPT under `jax.vmap`, nanoGPT's idiom, is planned in tests/test_scan.py);
# SMARTREMAT_REAL_MODELS=all (or a comma-separated list) runs them all.
_CHOSEN = os.environ.get("SMARTREMAT_REAL_MODELS", "vit")
CHOSEN = list(MODELS) if _CHOSEN == "all" else [n for n in _CHOSEN.split(",") if n]

# jaxonmodels' ResNet predates `eqx.nn.BatchNorm(mode=...)`; Equinox warns that it defaults to 'ema'
pytestmark = pytest.mark.filterwarnings("ignore:When `eqx.nn.BatchNorm")


def make_step(module):
    """The user's step: the gradient of the source's loss (and the new state, when it has one)."""
    if getattr(module, "HAS_AUX", False):

        def step(model, batch):
            return eqx.filter_grad(module.loss, has_aux=True)(model, batch)

    else:

        def step(model, batch):
            return eqx.filter_grad(module.loss)(model, batch)

    return step


def _temp(jitted, *args) -> int:
    lowered = jitted.lower(*args)
    lowered = getattr(lowered, "lowered", lowered)  # eqx.filter_jit's Lowered wraps JAX's
    return int(lowered.compile().memory_analysis().temp_size_in_bytes)


def _floor(step, model, batch) -> float:
    """The lowest budget smartremat accepts for the step, as its error states it (MB)."""
    with pytest.raises(ValueError, match=r"Raise `budget_mb` to at least") as e:
        smartremat.filter_jit(step, budget_mb=1e-3).plan(model, batch)
    return float(re.search(r"at least ([0-9.]+)", str(e.value)).group(1))


def _worst(got, want) -> tuple[float, str]:
    """The largest `|got - want|` relative to the largest `|want|` of its array, and where."""
    worst, where = 0.0, ""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            return float("inf"), f"{jax.tree_util.keystr(path)} shape {a.shape} != {b.shape}"
        if b.size and np.max(np.abs(a - b)) > worst * np.max(np.abs(b)):
            worst = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
            where = f"{jax.tree_util.keystr(path)} (largest entry {np.max(np.abs(b)):.3g})"
    return worst, where


def _remat_noise(module, model, batch, want) -> float:
    """How far a hand-written `eqx.filter_checkpoint` of the whole loss lands from the plain step
    (the worst of `nothing_saveable` and `dots_saveable`): the rounding any remat brings on this
    model, as XLA fuses the recomputed forward differently."""
    worst = 0.0
    for policy in (jax.checkpoint_policies.nothing_saveable, jax.checkpoint_policies.dots_saveable):
        remat_loss = eqx.filter_checkpoint(module.loss, policy=policy)
        aux = getattr(module, "HAS_AUX", False)
        ref = eqx.filter_jit(lambda m, b: eqx.filter_grad(remat_loss, has_aux=aux)(m, b))(model, batch)
        worst = max(worst, _worst(_negligible(ref), want)[0])
    return worst


def _negligible(want) -> Any:
    """`want` with every array whose largest entry is below 1e-6 of the largest entry of all (a
    gradient that is zero up to rounding, e.g. of a bias a softmax cancels) set to zero."""
    top = max((float(np.max(np.abs(np.asarray(x, np.float64)))) for x in jax.tree.leaves(want)
               if np.size(x) and np.issubdtype(np.asarray(x).dtype, np.inexact)), default=0.0)
    def zero(x):
        a = np.asarray(x)
        small = np.issubdtype(a.dtype, np.inexact) and a.size and np.max(np.abs(a)) < 1e-6 * top
        return np.zeros_like(a) if small else x
    return jax.tree.map(zero, want)


ENCODER_LAYER = re.compile(r"(^|\.)encoder\.layers\[\d+\]")


@pytest.mark.parametrize("name", CHOSEN)
def test_real_model_fits_and_equals_the_plain_step(name, fit_log):
    module = MODELS[name]
    model, batch = module.make(jax.random.PRNGKey(0))
    step = make_step(module)

    plain = eqx.filter_jit(step)
    start = time.perf_counter()
    none = _temp(plain, model, batch)
    compile_s = time.perf_counter() - start
    want = plain(model, batch)

    # rtol 1e-6 relative to each array's largest entry, unless a hand-written remat of the whole
    # loss is itself further off (then twice that: no plan can be closer than remat's rounding)
    noise = _remat_noise(module, model, batch, _negligible(want))
    allowed = max(1e-6, 2 * noise)
    floor = _floor(step, model, batch)
    high = max(none / MB, floor)
    budgets = [floor + f * (high - floor) for f in ((2 / 3, 1 / 3, 0.0) if FULL else (1 / 2, 0.0))]
    print(f"\n{name}: plain step compiled in {compile_s:.1f} s, no-remat temp {none / MB:.3f} MB, "
          f"lowest budget accepted {floor:.3f} MB")

    plans, failures = [], []  # every check runs; the failures are reported together at the end
    for budget in budgets:
        planned = smartremat.filter_jit(step, budget_mb=float(budget))
        start = time.perf_counter()
        plan = planned.plan(model, batch)
        wall = time.perf_counter() - start
        temp = _temp(planned, model, batch)
        got = planned(model, batch)
        policies = {b.path: b.policy for b in plan.blocks}
        error = (plan.predicted_peak_bytes - temp) / temp
        print(f"  budget {budget:.3f} MB: compiled temp {temp / MB:.3f} MB, predicted "
              f"{plan.predicted_peak_bytes / MB:.3f} MB (model error {error:+.3f}), planned in {wall:.1f} s "
              f"(plan.planning_seconds {plan.planning_seconds:.1f}, {plan.compiles} whole-step compiles), "
              f"blocks {policies}")
        fit_log.append((f"real models, {name}", name, budget, temp / MB, short_plan(policies)))
        if temp > budget * MB:
            failures.append(f"at budget {budget:.3f} MB the compiled temp is {temp / MB:.3f} MB ({policies})")
        if jax.tree.structure(got) != jax.tree.structure(want):
            failures.append(f"at budget {budget:.3f} MB the outputs' structure differs from the plain step's")
        else:
            worst, where = _worst(_negligible(got), _negligible(want))
            print(f"    gradients: worst relative error {worst:.2g} at {where}; allowed {allowed:.2g}")
            if worst > allowed:
                failures.append(f"at budget {budget:.3f} MB ({policies}) the outputs differ from the plain "
                                f"step's by {worst:.3g} at {where}, beyond {allowed:.3g}")
        plans.append(plan)

    lowest = plans[-1]
    if not any(b.policy != "none" for b in lowest.blocks):
        failures.append(f"at the lowest budget ({budgets[-1]:.3f} MB) nothing is recomputed: "
                        f"{[(b.path, b.policy) for b in lowest.blocks]}")
    if name == "bert":
        rows = [(b.path, b.policy) for plan in plans for b in plan.blocks]
        if not any(ENCODER_LAYER.search(path) and policy != "none" for path, policy in rows):
            failures.append(f"no plan checkpoints one encoder layer (or part of one) on its own: {rows}")
    assert not failures, f"{name}:\n" + "\n".join(failures)
