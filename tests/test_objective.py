"""The objective on an accelerator: recompute FLOPs plus a charge per byte kept (docs/facts.md,
fact 22; `smartremat/_objective.py`), on the CPU FLOPs alone."""

import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import smartremat
from smartremat._objective import DEFAULT_RIDGE, ROOFLINES, SCANNED_RIDGES, UNROLLED_RIDGES, KeptCharge, kept_charge

from tests.helpers import tree_allclose
from tests.models import ScannedTransformer
from tests.simulated_chip import simulated_chip

pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
OPT = optax.sgd(1e-2, momentum=0.9)


def test_charges_by_device_kind():
    assert kept_charge("cpu") == KeptCharge(0.0, 0.0)
    v5e = 197e12 / 819e9
    assert kept_charge("TPU v5 lite") == pytest.approx(KeptCharge(UNROLLED_RIDGES * v5e, SCANNED_RIDGES * v5e))
    flops, bandwidth = ROOFLINES["H100"]
    assert kept_charge("NVIDIA H100 80GB HBM3").scanned == pytest.approx(SCANNED_RIDGES * flops / bandwidth)
    assert kept_charge("TPU v5").scanned == pytest.approx(SCANNED_RIDGES * 459e12 / 2765e9)  # a v5p, not a v5e
    assert kept_charge("an accelerator of 2031").scanned == pytest.approx(SCANNED_RIDGES * DEFAULT_RIDGE)
    # a kept byte costs time in a scan (its copy into the stacked residuals), not outside one
    assert all(c.scanned > c.unrolled == 0 for c in map(kept_charge, ROOFLINES))


def step(model, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    updates, opt_state = OPT.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return loss, eqx.apply_updates(model, updates), opt_state


def test_an_accelerator_recomputes_where_the_cpu_keeps():
    """Under a budget that holds no remat, the CPU's objective keeps everything (no FLOPs
    recomputed), a TPU's recomputes the scan's blocks (its kept bytes cost more time than the
    FLOPs they save at this size); both give the plain step's answer. The plan's FLOPs are FLOPs."""
    model = ScannedTransformer(3, 64, 4, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, 64, 64))
    args = (model, OPT.init(eqx.filter(model, eqx.is_array)), x, jnp.tanh(x))
    expected = eqx.filter_jit(step)(*args)
    plans, answers = {}, {}
    for where in ("cpu", "tpu"):
        planned = smartremat.filter_jit(step, budget_mb=4096)
        with simulated_chip(2**40) if where == "tpu" else contextlib.nullcontext():
            plans[where] = planned.plan(*args)
            answers[where] = planned(*args)
    assert plans["cpu"].recompute_flops == 0
    assert {b.policy for b in plans["cpu"].blocks} == {"none"}
    assert plans["tpu"].recompute_flops > 0 and "none" not in {b.policy for b in plans["tpu"].blocks}
    for got in answers.values():
        assert tree_allclose(got, expected)
    # the frontier's cheapest point is the plan chosen under this budget, reported in FLOPs (not charged)
    assert plans["tpu"].frontier()[-1][1] == plans["tpu"].recompute_flops

