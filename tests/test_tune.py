"""`tune=True`: the fastest fitting candidate is kept, timed on synthetic inputs, never re-timed,
and the user's arrays and gradients are untouched."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import smartremat
from smartremat import MB, _module_plan, _planner, _tune
from smartremat._search import Outcome, CandidateFigures

from benchmarks.models import TutorialStack
from tests.helpers import backward, tree_allclose


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


def _rounds(wins, base, by=0.5):
    """Round times faster than `base` by `by` in the first `wins` rounds, slower by 5 in the rest."""
    return tuple(b - by if i < wins else b + 5.0 for i, b in enumerate(base))


@pytest.mark.parametrize("times_of_2, switch", [
    (lambda base: tuple(b - 0.5 for b in base), True),  # faster in every round
    (lambda base: _rounds(ROUNDS // 2 + 1, base, 0.1), True),  # a lower median, though slower on the mean
    (lambda base: base, False),  # a tie: the search's choice stays
    (lambda base: _rounds(ROUNDS // 2, base, 0.1), False),  # faster in fewer than half the rounds
])
def test_the_fitting_candidate_of_the_lowest_median_time_is_kept(times_of_2, switch):
    temps = {(1,): 90, (2,): 80, (3,): 120}
    compiled = CandidateFigures(lambda c: (temps[c], 10.0 * c[0]), lambda _: None, None)
    base = tuple(10.0 + i for i in range(ROUNDS))  # drift: later rounds slower for all alike
    times = {(1,): base, (2,): times_of_2(base), (3,): (0.1,) * ROUNDS}
    asked = []

    def time_of(choices):
        asked.append(list(choices))
        return [times[c] for c in choices]

    out = Outcome((1,), (90, 10.0), ((1,),))
    choice, timed = _tune.tuned(out, [(1,), (2,), (3,)], 100, compiled, time_of, lambda _: None)
    assert choice == ((2,) if switch else (1,))
    assert asked == [[(1,), (2,)]]  # (3,) is fastest but misses the budget: never timed
    assert [t[:2] for t in timed] == [(90, 10.0), (80, 20.0)]


def _stack():
    model = TutorialStack(4, 64, 512, jax.random.key(0))
    return model, jax.random.normal(jax.random.key(1), (32, 64))


@pytest.mark.parametrize("pattern, last_kept", [("every round", True), ("a hair in most rounds", True),
                                                ("a hair in fewer than half", False)])
def test_tune_keeps_the_candidate_of_the_lowest_median_and_gradients_are_unchanged(monkeypatch, pattern, last_kept):
    """Times are faked (the clock decides nothing a test can assert): the last candidate timed is
    faster in every round, by a hair in 13 of 25 rounds and far slower in the rest (a lower median
    all the same), or by a hair in 12 (a higher median): the plan must be it, it, the untuned plan."""
    smartremat.clear_caches()
    model, x = _stack()
    seen = []

    def timings(steps, rounds=_tune.TUNE_ROUNDS):
        seen.append([s.key for s in steps])
        base = tuple(10.0 + r for r in range(rounds))
        wins = {"every round": rounds, "a hair in most rounds": rounds // 2 + 1}.get(pattern, rounds // 2)
        last = tuple(b - 0.5 for b in base) if wins == rounds else _rounds(wins, base, 0.1)
        return [base] * (len(steps) - 1) + [last]

    monkeypatch.setattr(_planner, "timings", timings)
    budget = 1.2
    plan = smartremat.explain(smartremat.smartremat(budget_mb=budget, tune=True)(model), x)
    assert len(seen) == 1 and len(plan.timed) == len(seen[0]) >= 2
    assert all(t <= budget * MB for t, _, _ in plan.timed)
    lowest = min(range(len(plan.timed)), key=lambda i: (plan.timed[i][2], i))
    assert lowest == (len(plan.timed) - 1 if last_kept else 0)
    kept = plan.timed[lowest]
    assert (plan.compiled_peak_bytes, plan.compiled_flops) == kept[:2]
    default = smartremat.explain(smartremat.smartremat(budget_mb=budget)(model), x)
    assert (default.compiled_peak_bytes, default.compiled_flops) == plan.timed[0][:2]  # the untuned plan first
    marked = [line for line in str(plan).splitlines() if "<- chosen" in line]
    assert len(marked) == 1 and marked[0].lstrip().startswith("candidate" if last_kept else "untuned")
    tuned = smartremat.smartremat(budget_mb=budget, tune=True)(model)
    assert tree_allclose(backward(tuned, x).module, backward(model, x))


def test_each_candidate_is_timed_once_per_process(monkeypatch):
    smartremat.clear_caches()
    model, x = _stack()
    runs = []
    once = _tune.TimedRun.once
    monkeypatch.setattr(_tune.TimedRun, "once", lambda self: runs.append(self) or once(self))
    first = smartremat.explain(smartremat.smartremat(budget_mb=1.2, tune=True)(model), x)
    n = len(runs)
    rounds, rest = divmod(n, len(first.timed))  # every candidate alike: two warm-ups and its rounds
    assert rest == 0 and _tune.TUNE_ROUNDS <= rounds - 2 <= _tune.TUNE_MAX_ROUNDS
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


def test_a_timing_failure_warns_keeps_the_untuned_plan_and_stores_nothing(monkeypatch, tmp_path):
    """Out of device memory while timing (a second copy of the inputs): the fewest-FLOPs plan
    that fits is used, a warning says why, and nothing goes to the disk cache (the next process
    tries again)."""
    smartremat.clear_caches()
    monkeypatch.setenv("SMARTREMAT_DISK_CACHE", "1")
    monkeypatch.setenv("SMARTREMAT_CACHE_DIR", str(tmp_path))
    model, x = _stack()

    def timings(steps, rounds=_tune.TUNE_ROUNDS):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9 bytes.")

    monkeypatch.setattr(_planner, "timings", timings)
    with pytest.warns(UserWarning, match=r"`tune=True` could not time .*RESOURCE_EXHAUSTED.*`tune=False`"):
        plan = smartremat.explain(smartremat.smartremat(budget_mb=1.2, tune=True)(model), x)
    assert plan.timed == () and not list(tmp_path.rglob("*.json"))
    monkeypatch.setenv("SMARTREMAT_DISK_CACHE", "0")
    default = smartremat.explain(smartremat.smartremat(budget_mb=1.2)(model), x)
    assert (plan.compiled_peak_bytes, plan.compiled_flops) == (default.compiled_peak_bytes, default.compiled_flops)


def test_filter_jit_after_a_timing_failure_warns_and_stores_nothing(monkeypatch, tmp_path):
    smartremat.clear_caches()
    monkeypatch.setenv("SMARTREMAT_DISK_CACHE", "1")
    monkeypatch.setenv("SMARTREMAT_CACHE_DIR", str(tmp_path))
    model, x = _stack()
    opt_state = OPT.init(eqx.filter(model, eqx.is_array))

    def timings(steps, rounds=_tune.TUNE_ROUNDS):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9 bytes.")

    monkeypatch.setattr(_planner, "timings", timings)
    with pytest.warns(UserWarning, match=r"`tune=True` could not time .*RESOURCE_EXHAUSTED"):
        plan = smartremat.filter_jit(_step, budget_mb=1.5, tune=True).plan(model, opt_state, x, jnp.tanh(x))
    assert plan.timed == () and plan.compiled_peak_bytes <= 1.5 * MB and not list(tmp_path.rglob("*.json"))


def test_rounds_are_shuffled_afresh_so_no_step_keeps_its_predecessor():
    """A step run right after a memory-hungry one runs slower (docs/facts.md, fact 18): an order
    only rotated from round to round gives step 1 step 0 as predecessor in 3 rounds of 4."""
    orders = _tune.round_orders(4, 40)
    assert all(sorted(o) == [0, 1, 2, 3] for o in orders) and orders == _tune.round_orders(4, 40)
    sequence = [i for o in orders for i in o]
    before_1 = [a for a, b in zip(sequence, sequence[1:]) if b == 1]
    assert max(before_1.count(j) for j in range(4)) <= len(before_1) / 2


@pytest.mark.parametrize("seconds, want", [
    (_tune.TUNE_SECONDS, _tune.TUNE_ROUNDS),  # long steps: the floor
    (_tune.TUNE_SECONDS / 64, 64),  # about TUNE_SECONDS per candidate
    (_tune.TUNE_SECONDS / 10_000, _tune.TUNE_MAX_ROUNDS),  # very short steps: the cap
    (0.0, _tune.TUNE_MAX_ROUNDS),
])
def test_shorter_steps_get_more_rounds_between_a_floor_and_a_cap(seconds, want):
    assert _tune.rounds_for(seconds) == want


def test_the_rounds_follow_the_warm_steps_median_time(monkeypatch):
    """Steps of `TUNE_SECONDS / 64` each after warm-up are timed in 64 rounds, every one alike."""
    monkeypatch.setattr(_tune.TimedRun, "once", lambda self: _tune.TUNE_SECONDS / 64)
    aval = jax.ShapeDtypeStruct((2,), jnp.float32)
    steps = [_tune.Timed(("rounds follow the warm time", i), lambda: None, (aval,)) for i in range(3)]
    assert [len(t) for t in _tune.timings(steps)] == [64, 64, 64]
    assert [len(t) for t in _tune.timings(steps, rounds=7)] == [7, 7, 7]  # asked for: as many


def test_plan_compiles_counts_each_candidate_once_when_tune_re_confirms_the_choice(monkeypatch):
    """Without `loss=`, the search confirms its choice under every loss, and `tune=True` asks for
    it again: `Plan.compiles` counts distinct whole-step compiles, not requests."""
    from smartremat import _verify

    smartremat.clear_caches()
    model, x = _stack()
    asked = set()
    compiled_step = _module_plan.compiled_step

    def counting(call, spec, assignment, losses=_verify.DEFAULT_LOSSES):
        asked.add((_verify.assignment_key(assignment), len(losses)))
        return compiled_step(call, spec, assignment, losses)

    monkeypatch.setattr(_module_plan, "compiled_step", counting)
    plan = smartremat.explain(smartremat.smartremat(budget_mb=1.2, tune=True)(model), x)
    n_losses = len(_verify.DEFAULT_LOSSES)
    confirmed = {k for k, n in asked if n == n_losses}
    assert n_losses > 1 and confirmed and plan.timed
    assert plan.compiles == len({k for k, _ in asked}) + (n_losses - 1) * len(confirmed)
