"""`tune=True`: the fastest fitting candidate is kept, timed on synthetic inputs, never re-timed,
and the user's arrays and gradients are untouched."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import smartremat
from smartremat import MB, _planner, _tune
from smartremat._search import Outcome, _Compiled

from tests.helpers import backward, tree_allclose
from tests.models import MLPStack


@pytest.mark.parametrize("aval", [
    jax.ShapeDtypeStruct((3, 4), jnp.float32),
    jax.ShapeDtypeStruct((2,), jnp.bfloat16),
    jax.ShapeDtypeStruct((5,), jnp.int32),
    jax.ShapeDtypeStruct((), jnp.bool_),
    jax.ShapeDtypeStruct((2,), jax.random.key(0).dtype),
])
def test_synthetic_inputs_have_the_shapes_and_dtypes_asked_and_small_finite_floats(aval):
    (x,) = _tune.synthetic([aval])
    assert x.shape == aval.shape and x.dtype == aval.dtype
    if jnp.issubdtype(aval.dtype, jnp.floating):
        values = np.asarray(x, np.float32)
        assert np.all(np.abs(values) <= _tune.SCALE) and np.any(values != 0)
    elif not jnp.issubdtype(aval.dtype, jax.dtypes.prng_key):
        assert not np.any(np.asarray(x))  # zeros: valid indices, False masks


@pytest.mark.parametrize("n_below, want", [(0, 0), (2, 2), (8, _tune.TUNE_FRONTIER)])
def test_the_pool_is_the_choice_every_uniform_plan_and_a_few_lower_frontier_points(n_below, want):
    points = [(i,) for i in range(n_below)] + [(100,), (101,)]
    uniforms = [(7,), (100,), (8,)]
    got = _tune.pool(points, uniforms, (100,))
    assert got[0] == (100,) and {(7,), (8,)} <= set(got) and len(got) == len(set(got))
    below = [c for c in got if c[0] < n_below]
    assert len(below) == want and (n_below == 0 or (0,) in below)  # the lowest-peak point is kept
    assert (101,) not in got  # above the choice: predicted not to fit


ROUNDS = _tune.TUNE_ROUNDS


def _rounds(wins, base):
    """Round times faster than `base` in the first `wins` rounds, slower in the rest, all by 0.5."""
    return tuple(b - 0.5 if i < wins else b + 0.5 for i, b in enumerate(base))


def _fewest_wins(n: int) -> int:
    """Rounds of `n` that a step must win, all by the same margin, to be faster at 5%: with equal
    margins the signed-rank test is the sign test, whose tail is binomial."""
    return next(k for k in range(n + 1) if sum(math.comb(n, j) for j in range(k, n + 1)) / 2**n <= 0.05)


@pytest.mark.parametrize("wins, switch", [(ROUNDS, True), (_fewest_wins(ROUNDS), True),
                                          (_fewest_wins(ROUNDS) - 1, False), (0, False)])
def test_a_candidate_replaces_the_fewest_flops_choice_only_when_faster_beyond_the_noise(wins, switch):
    temps = {(1,): 90, (2,): 80, (3,): 120}
    compiled = _Compiled(lambda c: (temps[c], 10.0 * c[0]), lambda _: None, None)
    base = tuple(10.0 + i for i in range(ROUNDS))  # drift: later rounds slower for all alike
    times = {(1,): base, (2,): _rounds(wins, base), (3,): (0.1,) * ROUNDS}
    asked = []

    def time_of(choices):
        asked.append(list(choices))
        return [times[c] for c in choices]

    out = Outcome((1,), (90, 10.0), ((1,),))
    choice, timed = _tune.tuned(out, [(1,), (2,), (3,)], 100, compiled, time_of, lambda _: None)
    assert choice == ((2,) if switch else (1,))
    assert asked == [[(1,), (2,)]]  # (3,) is fastest but misses the budget: never timed
    assert [t[:2] for t in timed] == [(90, 10.0), (80, 20.0)]


@pytest.mark.parametrize("a, b, want", [
    ([5.0] * 7 + [10.1] * 4, [10.0] * 11, True),  # 7 of 11 won, by far: significant by rank, not by count
    ([9.9] * 7 + [15.0] * 4, [10.0] * 11, False),  # 7 won by a hair, 4 lost by far
    ([9.0] * 5, [10.0] * 5, True),  # every one of 5 rounds: p = 1/32
    ([9.0] * 4, [10.0] * 4, False),  # every one of 4: p = 1/16
    ([10.0] * 11, [10.0] * 11, False),  # equal
])
def test_faster_is_a_one_sided_signed_rank_test_at_five_percent(a, b, want):
    assert _tune.faster(a, b) is want


def _stack():
    model = MLPStack(4, 64, 512, jax.random.key(0))
    return model, jax.random.normal(jax.random.key(1), (32, 64))


@pytest.mark.parametrize("significant", [True, False])
def test_tune_keeps_the_candidate_timed_fastest_and_gradients_are_unchanged(monkeypatch, significant):
    """Times are faked (the clock decides nothing a test can assert): the last candidate timed has
    the lowest median, faster in every round (`significant`) or by a hair in 13 of 25 rounds and
    far slower in the rest (not significant): the plan must be it, or the untuned plan."""
    smartremat.clear_caches()
    model, x = _stack()
    seen = []

    def timings(steps, rounds=_tune.TUNE_ROUNDS):
        seen.append([s.key for s in steps])
        base = tuple(10.0 + r for r in range(rounds))
        last = _rounds(rounds, base) if significant else tuple(
            b - 0.1 if r <= rounds // 2 else b + 5.0 for r, b in enumerate(base))
        return [base] * (len(steps) - 1) + [last]

    monkeypatch.setattr(_planner, "timings", timings)
    budget = 1.2
    plan = smartremat.explain(smartremat.smartremat(budget_mb=budget, tune=True)(model), x)
    assert len(seen) == 1 and len(plan.timed) == len(seen[0]) >= 2
    assert all(t <= budget * MB for t, _, _ in plan.timed)
    assert min(range(len(plan.timed)), key=lambda i: plan.timed[i][2]) == len(plan.timed) - 1
    kept = plan.timed[-1] if significant else plan.timed[0]
    assert (plan.compiled_peak_bytes, plan.compiled_flops) == kept[:2]
    default = smartremat.explain(smartremat.smartremat(budget_mb=budget)(model), x)
    assert (default.compiled_peak_bytes, default.compiled_flops) == plan.timed[0][:2]  # the untuned plan first
    marked = [line for line in str(plan).splitlines() if "<- chosen" in line]
    assert len(marked) == 1 and marked[0].lstrip().startswith("candidate" if significant else "untuned")
    tuned = smartremat.smartremat(budget_mb=budget, tune=True)(model)
    assert tree_allclose(backward(tuned, x).module, backward(model, x))


def test_each_candidate_is_timed_once_per_process(monkeypatch):
    smartremat.clear_caches()
    model, x = _stack()
    runs = []
    once = _tune._Run.once
    monkeypatch.setattr(_tune._Run, "once", lambda self: runs.append(self) or once(self))
    first = smartremat.explain(smartremat.smartremat(budget_mb=1.2, tune=True)(model), x)
    n = len(runs)
    assert n == len(first.timed) * (_tune.TUNE_ROUNDS + 2)
    _planner._PLANS.clear()  # plan again: the candidates' times are known
    again = smartremat.explain(smartremat.smartremat(budget_mb=1.2, tune=True)(model), x)
    assert len(runs) == n and again.timed == first.timed


def test_a_tuned_plan_round_trips_through_json(tmp_path):
    model, x = _stack()
    plan = smartremat.explain(smartremat.smartremat(budget_mb=1.2, tune=True)(model), x)
    plan.save(str(tmp_path / "p.json"))
    loaded = smartremat.load_plan(str(tmp_path / "p.json"))
    assert [s for _, _, s in loaded.timed] == [s for _, _, s in plan.timed]
    assert [t for t, _, _ in loaded.timed] == [t for t, _, _ in plan.timed]


OPT = optax.sgd(1e-2)


def _step(model, opt_state, x, y):
    value, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    updates, opt_state = OPT.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return value, eqx.apply_updates(model, updates), opt_state


def test_filter_jit_tunes_the_whole_step_without_touching_donated_arguments():
    model, x = _stack()
    opt_state = OPT.init(eqx.filter(model, eqx.is_array))
    y = jnp.tanh(x)
    planned = smartremat.filter_jit(_step, budget_mb=1.5, donate="all", tune=True)
    plan = planned.plan(model, opt_state, x, y)
    assert len(plan.timed) >= 2 and all(t <= 1.5 * MB for t, _, _ in plan.timed)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(eqx.filter((model, opt_state, x), eqx.is_array)))
    want = eqx.filter_jit(_step)(model, opt_state, x, y)
    got = planned(model, opt_state, x, y)
    assert tree_allclose(eqx.filter(got, eqx.is_array), eqx.filter(want, eqx.is_array))


def test_tune_without_verify_is_refused():
    with pytest.raises(ValueError, match=r"`smartremat\(tune=True, verify=False\)`.*needs `verify=True`"):
        smartremat.smartremat(budget_mb=1, tune=True, verify=False)


def test_tune_with_a_saved_plan_is_refused(tmp_path):
    model, x = _stack()
    smartremat.explain(smartremat.smartremat(budget_mb=1.2)(model), x).save(str(tmp_path / "p.json"))
    plan = smartremat.load_plan(str(tmp_path / "p.json"))
    with pytest.raises(ValueError, match=r"`smartremat\(tune=True, plan=...\)`: a saved plan runs as saved"):
        smartremat.smartremat(budget_mb=1.2, plan=plan, tune=True)
