"""The model fuzzer's CI subset (issue 28): a fixed set of generated Equinox models and training
steps (`tests/fuzz/grammar.py`), each held against smartremat's invariants (`tests/fuzz/check.py`).

`make fuzz` runs many more (`tests/fuzz/run.py`); this file runs `CI_CASES` cases drawn from
`CI_SEED`, chosen so that together they draw every value of every field of the grammar (but the
`LATE` ones, left at their first value: the subset is the one chosen before they were added), and
`CHIP_CASES`, which draw the simulated chip's values, and holds rule 6 (a float32 difference judged
by the same plan in float64) to a case it once failed and to differences it must report.
"""

import dataclasses
from types import SimpleNamespace
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings

from tests.fuzz.check import (Failed, _check_chip, _check_decorator, _compare, _mismatches, _reference, check_case,
                               float64, promotion)
from tests.fuzz import check
from tests.fuzz.grammar import CHOICES, LATE, LR, Case, build, case_at, cases, covering, normalise, working
from tests.helpers import MISMATCH_RTOL

CI_SEED = 28
CI_CASES = 8  # the fewest that draw every value of every field (CI time: 24 cases took 8 minutes of the suite)
CI_INDEXES = covering(CI_SEED, CI_CASES)

#: The simulated chip (`Case.chip`): a step of three blocks whose chip refuses it without remat
#: (about 6 s each). Under "tight" the budget is the plain temp, above what the chip leaves; the
#: "auto" one donates its arguments (aliased bytes) to an optax step.
CHIP_CASES = {
    "tight": Case(layout="loop", width=32, batch=8, depth=3, budget=1.0, chip="tight"),
    "auto": Case(layout="loop", width=32, batch=8, depth=3, step="sgd", donate=True, chip="auto"),
    # seed 777, case 51, shrunk: the model's lowest-peak plans (the reference steps) were all
    # refused while `dots_saveable` fits the chip; planning gave up ("does not fit the device")
    "refused references": Case(block="checkpointed", vmap="inner", control="cond", wrapper=True, width=16,
                               batch=8, depth=2, budget=0.0, chip="tight"),
    # seed 20261206, case 81, shrunk: the device refused full remat and the lowest-peak frontier plan,
    # and a plan the model put far above them fits; a search that gave up there said "no plan fits"
    "refused lowest": Case(layout="shared", block="mlp", method="loss", step="sgd", width=16, batch=4, depth=2,
                           budget=0.5, chip="tight"),
    # seed 20261214, case 1473, shrunk: the reference refused, the unrefined model ruled out the floor
    # plan (nested(layers=dots), below full remat); every uniform plan was refused ("does not fit")
    "refused nested floor": Case(layout="shared", block="linear", vmap="inner", dtype="f16", outputs="tuple",
                                 wrapper=True, loss="xent_soft", step="value_and_grad", width=16, batch=4, depth=3,
                                 budget=0.5, chip="tight"),
    # seed 20261214, case 1406, shrunk: the same under "auto", where the error then stated a floor
    # ("at least 0.17") that the chip refused
    "refused floor, auto": Case(layout="loop", block="custom_vjp", dtype="bf16", wrapper=True, loss="mse",
                                step="value_and_grad", accum="fori", width=64, batch=4, depth=2, budget=0.25,
                                chip="auto"),
}


def ci_case(index: int) -> Case:
    """The `index`-th case of `CI_SEED`, its `LATE` fields at their first value."""
    return normalise(dataclasses.replace(case_at(CI_SEED, index), **{k: CHOICES[k][0] for k in LATE}))


def test_ci_subset_draws_every_idiom():
    drawn = {(k, getattr(ci_case(i), k)) for i in CI_INDEXES for k in CHOICES}
    drawn |= {(k, getattr(case, k)) for case in CHIP_CASES.values() for k in CHOICES}
    assert {(k, v) for k, values in CHOICES.items() for v in values} - drawn == set()


@settings(derandomize=True, max_examples=30, deadline=None, database=None)
@given(cases())
def test_a_case_is_plain_data_and_builds_the_same_values_each_time(case):
    assert normalise(case) == case
    assert Case(**dataclasses.asdict(case)) == case
    assert eval(str(case), {"Case": Case}) == case  # printed, it reads back
    a, b = build(case), build(case)
    assert a.names == b.names and len(a.args) == len(a.names)
    leaves = lambda built: [x for x in jax.tree.leaves(built.args) if isinstance(x, jax.Array)]  # noqa: E731
    for x, y in zip(leaves(a), leaves(b), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("index", CI_INDEXES)
def test_generated_model_keeps_the_invariants(index):
    case = ci_case(index)
    outcome = check_case(case)
    assert outcome.ok, f"{case}\n{outcome.report()}"


@pytest.mark.parametrize("chip", sorted(CHIP_CASES))
def test_on_a_simulated_chip_the_planned_step_fits_it(chip):
    """Planned, compiled, run and explained on a chip that refuses the step without remat."""
    case = CHIP_CASES[chip]
    assert normalise(case) == case
    outcome = check_case(case)
    assert outcome.ok, f"{case}\n{outcome.report()}"
    assert outcome.figures["chip_refused"] > 0  # the step without remat, at least, was refused
    assert outcome.figures["planned_mb"] <= min(outcome.figures["budget_mb"], outcome.figures["plain_mb"])


def test_the_chip_invariant_reports_a_step_larger_than_the_chip():
    memory = SimpleNamespace(temp_size_in_bytes=600, argument_size_in_bytes=300, output_size_in_bytes=200,
                             alias_size_in_bytes=100)
    _check_chip(memory, 1000)  # 600 + 300 + 200 - 100: fits
    _check_chip(memory, None)  # no chip
    with pytest.raises(Failed, match=r"1000 bytes > chip 999 bytes") as e:
        _check_chip(memory, 999)
    assert e.value.kind == "over budget"


#: Seed 2026, case 212, shrunk: a float32 difference of 3.9e-6 of a leaf's scale on one entry of
#: Adam's second moment, where the earlier rule 6 (the planned answer within twice the plain step's
#: distance from the plain step's float64 answer) failed it: 3.57e-6 from it, the plain one 3.27e-7.
CASE_2026_212 = Case(seed=41255, layout="rnn", block="mlp", vmap="outer", norm="batchnorm", dropout=False,
                     control="none", dtype="f32", method="call", kwargs=False, inputs="array", outputs="array",
                     wrapper=False, loss="xent_int", step="adam", accum="none", donate=True, path="filter_jit",
                     width=8, batch=16, depth=2, budget=0.75)


def test_case_2026_212_now_agrees_in_float32():
    """Its float32 difference (`nu.layers.bias`, 1 of 24 entries, judged rounding by rule 6) came from
    candidates lowered in worker threads without the case's dtype-promotion context
    (`tests/test_jax_config.py`): lowered under it, the planned step agrees with the plain one, up to
    rounding in the biases before the BatchNorm, the leaves rule 6 is for. Whether any rounding
    shows depends on the CPU: none on the machines of earlier sessions, one entry of `nu.layers.bias`
    by 3.9e-6 of its value on an AMD EPYC without AVX-512 (2026-12-07; the same on the commit before
    this test last changed, and none under a budget that plans no remat)."""
    outcome = check_case(CASE_2026_212)
    assert outcome.ok, f"{CASE_2026_212}\n{outcome.report()}"
    judged = outcome.figures.get("rule 6", ([], None))[0]
    assert all(".layers.bias:" in d for d in judged), judged


CASE_20261208_36 = Case(seed=0, layout="loop", block="linear", vmap="outer", norm="batchnorm", dropout=False,
                       control="none", dtype="f32", method="call", kwargs=False, inputs="array", outputs="array",
                       wrapper=False, loss="mse", step="value_and_grad", accum="none", donate=False,
                       path="decorator", width=8, batch=16, depth=3, budget=0.25)


def test_case_20261208_36_rule_6_runs_the_decorators_plans_in_float64(monkeypatch):
    """A float32 difference under the decorator (`w2.bias` right before a BatchNorm, 1 of 8
    entries, 1.5e-6 of its scale) is judged by rule 6: the wrapper's plans are recorded on the
    float32 call, not traced under the float64 run (where the BatchNorm's float32 state refused
    its float64 update, so no float64 answer was made and the case failed). Whether that float32
    difference shows depends on the CPU (none on an AMD EPYC without AVX-512, 2026-12-07), so every
    difference is sent to rule 6 here: the float64 run is made on any CPU."""
    monkeypatch.setattr(check, "MISMATCH_RTOL", 0.0)
    outcome = check_case(CASE_20261208_36)
    assert outcome.ok, f"{CASE_20261208_36}\n{outcome.report()}"
    assert "rule 6" in outcome.figures  # the float32 difference was there, and judged rounding


def _step_outputs(grad: np.ndarray, dtype: Any) -> tuple:
    """A value_and_grad step's outputs: `(loss, {"w": grad})` (numpy arrays, as from the device)."""
    return np.asarray(0.5, dtype), {"w": np.asarray(grad, dtype)}


@pytest.mark.parametrize("off", [1e-4, 1e-10])
def test_rule_6_reports_a_float32_difference_that_the_same_plan_shows_in_float64_too(off):
    """A wrong gradient (one entry off by 1e-4 of the leaf's scale, or by 1e-10: beyond float64
    rounding) differs from the plain step in float64 as it does in float32."""
    g = np.random.default_rng(0).standard_normal((8, 16))
    wrong = g.copy()
    wrong[3, 5] += 1e-4 * np.max(np.abs(g))
    wrong64 = g.copy()
    wrong64[3, 5] += off * np.max(np.abs(g))
    figures: dict = {}
    with pytest.raises(Failed, match=r"(?s)\['w'\]: 1 of 128 entries differ.*rule 6: the same plan in float64 "
                                     r"differs.*\n\[1\]\['w'\]: 1 of 128 entries differ beyond 1\.0e-12"):
        _compare(Case(step="value_and_grad"), _step_outputs(wrong, np.float32), _step_outputs(g, np.float32),
                 lambda: (_step_outputs(wrong64, np.float64), _step_outputs(g, np.float64)), figures)
    assert "rule 6" not in figures


def test_rule_6_passes_a_float32_difference_that_the_same_plan_does_not_show_in_float64():
    g = np.random.default_rng(0).standard_normal((8, 16))
    off = g.copy()
    off[3, 5] += 3e-6 * np.max(np.abs(g))  # beyond rule 2's 1e-6: reported in float32
    rounded = g * (1 + 4e-16 * np.random.default_rng(1).uniform(-1, 1, g.shape))  # float64 rounding
    figures: dict = {}
    _compare(Case(step="value_and_grad"), _step_outputs(off, np.float32), _step_outputs(g, np.float32),
             lambda: (_step_outputs(rounded, np.float64), _step_outputs(g, np.float64)), figures)
    found, (leaf, share) = figures["rule 6"]
    assert [m[:31] for m in found] == ["[1]['w']: 1 of 128 entries diff"] and leaf == "[1]['w']"
    assert 0 < share <= 1e-15


def test_rule_6_does_not_judge_a_float64_run_that_computed_in_float32():
    """A float32 leaf left in the float64 run carries float32 rounding: no float64 judgement."""
    g = np.random.default_rng(0).standard_normal((8, 16))
    off = g.copy()
    off[3, 5] += 3e-6 * np.max(np.abs(g))
    with pytest.raises(Failed, match=r"the float64 run computed in another dtype: \[0\] is float32, "
                                     r"\[1\]\['w'\] is float32"):
        _compare(Case(step="value_and_grad"), _step_outputs(off, np.float32), _step_outputs(g, np.float32),
                 lambda: (_step_outputs(g, np.float32), _step_outputs(g, np.float32)))


def test_the_grammar_computes_in_float64_where_float64_is_enabled():
    assert (working("f32"), working("bf16")) == (jnp.float32, jnp.bfloat16)
    with float64():
        assert (working("f32"), working("bf16"), working("f16")) == (jnp.float64, jnp.bfloat16, jnp.float16)


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")  # as check_case ignores it
def test_rule_6_runs_the_decorators_own_plan_in_float64():
    """The decorator plans per input signature: rule 6 replays the plan it made for the float32 call."""
    case = dataclasses.replace(CASE_2026_212, path="decorator")
    figures: dict = {}
    with promotion(case):  # Adam's bias correction needs standard promotion (as check_case sets it)
        built, _, _, expected = _reference(case)
        _check_decorator(case, built, 0.0202, expected, figures)  # raises on a difference beyond rounding
    assert "rule 6" not in figures, figures["rule 6"]  # as `test_case_2026_212_now_agrees_in_float32`


#: Seed 8675309, case 0 (issue 39, item 4), and the case it shrinks to: the bias right before the
#: BatchNorm has a gradient that is mathematically zero, rounding noise of 4e-8 of the gradient's
#: scale (rule 3), which Adam's first step turns into a move of `lr * g / (|g| + eps)`: the new
#: biases of the planned and the plain step differed by up to 1.2e-4 (rule 5 alone allowed 1e-8).
ZERO_GRADIENT_CASES = {
    "8675309/0": Case(seed=50741, layout="scan", block="linear", vmap="outer", norm="batchnorm", dropout=False,
                      control="none", dtype="f32", method="encode", kwargs=False, inputs="tuple", outputs="array",
                      wrapper=False, loss="huber", step="adamw", accum="none", donate=True, path="filter_jit",
                      width=32, batch=16, depth=1, budget=0.0, chip="none"),
    "shrunk": Case(block="linear", vmap="outer", norm="batchnorm", method="encode", step="adam"),
}


@pytest.mark.parametrize("name", sorted(ZERO_GRADIENT_CASES))
def test_adam_on_a_gradient_zero_up_to_rounding_is_judged_on_the_gradient(name):
    case = ZERO_GRADIENT_CASES[name]
    assert normalise(case) == case
    outcome = check_case(case)
    assert outcome.ok, f"{case}\n{outcome.report()}"


def test_adams_step_on_a_zero_gradient_is_judged_on_the_gradient():
    """Rounding noise of opposite signs on a zero gradient entry (`b`, 4e-8 of the gradient's scale)
    moves Adam's parameter by up to `2 * lr` (rule 5 with rule 4); 1e-4 of the gradient's scale on
    it is a real difference, reported on the first moment and on the parameter."""
    case, params = Case(step="adam"), {"w": jnp.ones((2, 2)), "b": jnp.zeros(2)}
    opt = optax.adam(LR[case.step])

    def step(b: list) -> tuple:
        grads = {"w": jnp.array([[0.5, -2.0], [1.0, 0.25]]), "b": jnp.array(b)}
        updates, state = opt.update(grads, opt.init(params), params)
        return jax.device_get((jnp.float32(1.5), eqx.apply_updates(params, updates), state))

    with promotion(case):  # optax's bias correction
        plain, noise, real = step([-2e-8, 1e-8]), step([6e-8, -3e-8]), step([2e-4, 1e-8])
    assert np.max(np.abs(noise[1]["b"] - plain[1]["b"])) > 1e-3  # about 1.5 lr
    assert _mismatches(case, noise, plain, MISMATCH_RTOL, None) == []
    found = _mismatches(case, real, plain, MISMATCH_RTOL, None)
    assert {m.split(":")[0] for m in found} == {"[1]['b']", "[1][0].mu['b']"}  # the moments: outputs but [1]


#: Seed 20261208, case 198, shrunk: a Dropout called twice; the step without remat is refused, and
#: the reference (the first call under `dots`, the second without remat) fits the chip, but the
#: model refined on it left only `(dots, dots)` on its frontier, and that and no remat were refused:
#: planning said no plan fits. Where nothing else fits, the programs the model was refined on are
#: candidates too.
REFERENCE_FITS = Case(layout="loop", block="mlp", dropout=True, control="fori", loss="mse", step="value_and_grad",
                      path="filter_jit", width=8, batch=4, depth=1, budget=0.5, chip="tight")


def test_case_20261208_198_the_reference_that_fits_the_chip_is_a_candidate():
    assert normalise(REFERENCE_FITS) == REFERENCE_FITS
    outcome = check_case(REFERENCE_FITS)
    assert outcome.ok, outcome.report()
    assert outcome.figures["chip_refused"] >= 1  # the chip refused something: the case is under pressure


#: Seed 20261207, case 82, shrunk (older than the objective change: it fails on cc61669 too). The
#: decorator verifies plans on the module's gradient under its default losses, whose targets are
#: arguments: a few hundred bytes more than the user's step, which the tight chip holds exactly
#: ("Used 35.58K of 35.46K hbm"), so every candidate is refused (it used to raise that no plan fits).
DECORATOR_ON_A_FULL_CHIP = Case(layout="loop", block="mlp", loss="xent_int", path="decorator", width=32, batch=4,
                                depth=1, budget=0.5, chip="tight")


def test_the_decorator_plans_on_a_chip_that_holds_only_the_step():
    """Seed 20261207 case 82 (and 20261209 case 124): the decorator's candidates (the module's
    gradient under its losses) need a kilobyte more than the user's step, and the chip holds only
    the step: every candidate is refused, and the plan is the model's lowest, unconfirmed, with a
    warning (`_planner.UNCONFIRMED`), not an error."""
    assert normalise(DECORATOR_ON_A_FULL_CHIP) == DECORATOR_ON_A_FULL_CHIP
    outcome = check_case(DECORATOR_ON_A_FULL_CHIP)
    assert outcome.ok, outcome.report()
