"""Verification's search along the frontier, on synthetic compiled figures (no compiler)."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smartremat._search import FLOOR_MARGIN, NEAR_BUDGET, Estimates, candidates, search, spread


def _run(temps, predicted, uniform_temps, budget, flops=None, uniform_flops=0.5, exact=None,
         uniform_predicted=None, model_flops=None, asked=None, confirmed=None):
    """Frontier point i is the choice `(i,)` (temp `temps[i]`, FLOPs falling with i); uniform plan
    j is `(100 + j,)`. The model predicts `predicted[i]` and `uniform_predicted[j]` (by default
    the uniform temps scaled like the last frontier point), and FLOPs `model_flops` (by default
    the compiled ones). With `exact` (`{choice: temp under every loss}`), `temps` are the first
    loss's. Returns the outcome, the choices compiled in order (also appended to `asked`, if given:
    an error leaves them there; those compiled under every loss to `confirmed`), and the exact table."""
    n = len(temps)
    flops = flops or [float(n - i) for i in range(n)]
    table = {(i,): (temps[i], flops[i]) for i in range(n)}
    table.update({(100 + j,): (t, uniform_flops + j) for j, t in enumerate(uniform_temps)})
    if uniform_predicted is None:
        uniform_predicted = [t * predicted[-1] / max(temps[-1], 1) for t in uniform_temps]
    peaks = {(i,): p for i, p in enumerate(predicted)} | {(100 + j,): p for j, p in enumerate(uniform_predicted)}
    model_flops = model_flops or {c: f for c, (_, f) in table.items()}
    asked = [] if asked is None else asked

    def measure(choice):
        asked.append(choice)
        return table[choice]

    def confirm(choice):
        if confirmed is not None:
            confirmed.append(choice)
        return exact[choice], table[choice][1]

    out = search([(i,) for i in range(n)], [(100 + j,) for j in range(len(uniform_temps))],
                 Estimates(peaks.__getitem__, model_flops.__getitem__), budget, measure, lambda c, f: f,
                 lambda floor: ValueError(f"floor {floor}"), lambda _: None, None if exact is None else confirm)
    if exact is not None:
        table = {c: (exact[c], f) for c, (_, f) in table.items()}
    return out, asked, table


def _exhaustive(table, budget):
    fits = [(f, t, c) for c, (t, f) in table.items() if t <= budget]
    return min(fits)[2]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=16), st.floats(0.3, 3.0),
       st.lists(st.integers(1, 400), max_size=3), st.integers(0, 400))
def test_with_monotone_compiled_temps_the_search_finds_what_compiling_everything_finds(steps, ratio, uniforms, budget):
    temps = [sum(steps[: i + 1]) for i in range(len(steps))]  # rising along the frontier
    predicted = [t * ratio for t in temps]  # the model off by a constant factor
    floor = min([temps[0]] + uniforms)
    if budget < floor:
        with pytest.raises(ValueError, match=f"floor {floor}"):
            _run(temps, predicted, uniforms, budget)
        return
    out, asked, table = _run(temps, predicted, uniforms, budget)
    assert out.compiled[0] <= budget
    assert out.choice == _exhaustive(table, budget)
    assert len(asked) == len(set(asked)) == len(out.measured)  # each candidate compiled once


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=16), st.floats(0.5, 1.0), st.floats(0.3, 3.0),
       st.lists(st.tuples(st.integers(1, 400), st.integers(0, 100)), max_size=3), st.integers(0, 500))
def test_with_several_losses_the_largest_temp_decides_and_is_compiled_only_where_needed(
        steps, first_share, ratio, uniforms, budget):
    exact_temps = [sum(steps[: i + 1]) for i in range(len(steps))]
    temps = [int(t * first_share) for t in exact_temps]  # the first loss's figure, a lower bound
    exact = {(i,): t for i, t in enumerate(exact_temps)}
    exact.update({(100 + j,): t + extra for j, (t, extra) in enumerate(uniforms)})
    floor = min(exact.values())
    if budget < floor:
        with pytest.raises(ValueError, match=f"floor {floor}$"):
            _run(temps, [t * ratio for t in temps], [t for t, _ in uniforms], budget, exact=exact)
        return
    out, asked, table = _run(temps, [t * ratio for t in temps], [t for t, _ in uniforms], budget, exact=exact)
    assert out.compiled[0] == exact[out.choice] <= budget
    assert out.choice == _exhaustive(table, budget)
    assert set(out.confirmed) <= set(asked)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 60)), min_size=1, max_size=16),
       st.lists(st.integers(1, 400), min_size=1, max_size=16),
       st.lists(st.tuples(st.integers(1, 400), st.integers(0, 60)), max_size=3), st.integers(0, 400),
       st.booleans())
def test_whatever_the_compiler_says_the_choice_fits_and_a_refusal_states_the_true_floor(
        frontier, predicted, uniforms, budget, several_losses):
    """Temps in any order along the frontier, any predictions: the search ends, its choice fits
    under every loss, each candidate is compiled once, and a refused budget is below the floor it
    states: the lowest temp compiled under every loss, and every candidate not compiled is put
    above it by the model, at the smallest compiled/predicted ratio (never above 1) lowered by
    `FLOOR_MARGIN`."""
    n = len(frontier)
    predicted = sorted((predicted * n)[:n])
    temps = [t for t, _ in frontier]
    exact = {(i,): t + (extra if several_losses else 0) for i, (t, extra) in enumerate(frontier)}
    exact.update({(100 + j,): t + (extra if several_losses else 0) for j, (t, extra) in enumerate(uniforms)})
    asked, confirmed = [], []
    try:
        out, _, _ = _run(temps, predicted, [t for t, _ in uniforms], budget, exact=exact, asked=asked,
                         confirmed=confirmed)
    except ValueError as e:
        # the search's figure of a candidate: under every loss where it was confirmed, else the first's
        held = {(i,): t for i, t in enumerate(temps)} | {(100 + j,): t for j, (t, _) in enumerate(uniforms)}
        held |= {c: exact[c] for c in confirmed}
        peaks = {(i,): p for i, p in enumerate(predicted)}
        peaks |= {(100 + j,): t * predicted[-1] / max(temps[-1], 1) for j, (t, _) in enumerate(uniforms)}
        floor = min(exact[c] for c in asked)
        scale = min([1.0] + [held[c] / max(peaks[c], 1.0) for c in asked]) / (1 + FLOOR_MARGIN)
        assert budget < floor and str(e) == f"floor {floor}"
        assert all(peaks[c] * scale >= floor for c in exact if c not in asked)
        return
    assert exact[out.choice] == out.compiled[0] <= budget
    assert len(asked) == len(set(asked))


def test_below_the_floor_candidates_the_model_puts_far_above_it_are_not_compiled():
    """At a budget below every plan, with the compiled temps (MB x 1000) and predictions of the
    ViT of tests/real (its 15 frontier points and 4 uniform plans): the floor is the lowest of all
    (full remat, a uniform plan), and those the model puts above it by more than `FLOOR_MARGIN` at
    the smallest ratio seen are not compiled: 3 of the 19, all compiled before."""
    predicted = [240, 291, 342, 368, 393, 444, 470, 497, 523, 540, 567, 593, 611, 629, 664]
    temps = [265, 282, 332, 332, 381, 407, 433, 508, 534, 433, 508, 534, 552, 621, 656]
    compiled = dict(zip([(i,) for i in range(15)] + [(100,), (101,), (102,), (103,)], temps + [681, 422, 370, 254]))
    peaks = dict(zip(compiled, predicted + [681, 470, 393, 240]))
    asked = []

    def measure(choice):
        asked.append(choice)
        return compiled[choice], 1.0

    with pytest.raises(ValueError, match="floor 254$"):
        search([(i,) for i in range(15)], [(100,), (101,), (102,), (103,)], Estimates(peaks.__getitem__, lambda c: 1.0),
               100, measure, lambda c, f: f, lambda floor: ValueError(f"floor {floor}"), lambda _: None)
    scale = min([1.0] + [compiled[c] / peaks[c] for c in asked]) / (1 + FLOOR_MARGIN)
    left = [c for c in peaks if c not in asked]
    assert left and all(peaks[c] * scale >= 254 for c in left)
    # the first guess (the lowest point) with its spare (full remat), then the one point predicted
    # within the margin: 291 * 0.8 < 254 (the smallest ratio seen is above 1), 342 * 0.775 > 254
    assert sorted(asked) == [(0,), (1,), (103,)]


def test_a_plan_that_fits_the_first_loss_only_is_refuted():
    temps = list(range(10, 170, 10))
    exact = {(i,): t + (30 if i == 8 else 0) for i, t in enumerate(temps)} | {(100,): 10, (101,): 160}
    out, asked, _ = _run(temps, temps, [10, 160], budget=95, uniform_flops=1e3, exact=exact)
    assert out.choice == (7,) and out.compiled[0] == 80 and len(out.confirmed) == 2


def test_an_accurate_model_needs_one_compile():
    temps = list(range(10, 170, 10))  # 16 points
    out, asked, _ = _run(temps, temps, [10, 160], budget=95, uniform_flops=1e3)
    assert out.choice == (8,) and out.compiled == (90, 8.0)
    # the guess (8) fits; its cheaper neighbour is predicted 100 MB, beyond 5% over the budget; the
    # uniform plans cannot fit (160) or cost 1000 FLOPs against 8
    assert asked == [(8,)]


@pytest.mark.parametrize("budget,neighbour", [(95, False), (96, True)])
def test_a_neighbour_predicted_within_the_margin_is_compiled(budget, neighbour):
    # the cheaper neighbour is trusted to miss only if it does by more than 5% of the budget
    temps = list(range(10, 170, 10))
    out, asked, _ = _run(temps, temps, [], budget=budget)
    assert out.choice == (8,) and ((9,) in asked) == neighbour  # 100 > 1.05 * 95, 100 <= 1.05 * 96


def test_when_the_guess_misses_the_next_guess_is_compiled():
    temps = [t + 20 for t in range(10, 170, 10)]  # the model 20 under everywhere
    out, asked, _ = _run(temps, list(range(10, 170, 10)), [], budget=95)
    # 8 compiles to 110 against 90 predicted: scaled by 110/90, point 6 (70 -> 85.6) fits and point
    # 7 (80 -> 97.8) does not, but not by 5%; between two compiled neighbours the smaller ratio counts
    assert asked == [(8,), (6,), (7,)]
    assert out.choice == (6,) and out.compiled[0] == 90


def test_a_uniform_plan_that_could_win_compiles_beside_a_lone_candidate():
    # the guess (8) misses; the next guess (6) compiles with the uniform plan the model puts within
    # 2% of the FLOPs, on the core a lone compile leaves idle: two steps where there were three
    temps = [t + 20 for t in range(10, 170, 10)]
    flops = {(i,): float(16 - i) for i in range(16)} | {(100,): 10.1}
    batches = []
    out = search([(i,) for i in range(16)], [(100,)],
                 Estimates(({(i,): 10.0 * (i + 1) for i in range(16)} | {(100,): 50.0}).__getitem__, flops.__getitem__),
                 95, lambda c: (temps[c[0]], flops[c]) if c != (100,) else (60, 9.9), lambda c, f: f,
                 lambda floor: ValueError(floor), batches.append)
    assert out.choice == (100,)
    assert [int(b.split()[1]) for b in batches] == [1, 2, 1]  # (8); (6) and (100); (7), the bracket


def test_when_two_guesses_miss_the_lowest_plan_is_compiled():
    temps = [10, 60, 70, 80, 90, 100, 110, 120]  # the model 2x under beyond the first point
    out, asked, _ = _run(temps, [10, 20, 30, 40, 50, 60, 70, 80], [], budget=45)
    assert asked == [(3,), (1,), (0,)] and out.choice == (0,)  # 40 -> 80; 20 * 2 -> 60; the lowest


@pytest.mark.parametrize("model_flops,compiled", [(8.1, True), (9.0, False)])
def test_a_uniform_plan_is_compiled_where_the_model_says_it_could_win(model_flops, compiled):
    # the best fitting frontier point (8) takes 8 FLOPs; a uniform plan the model puts within 2% of
    # that is compiled (and wins, at 7.9 compiled); one it puts 12.5% above is left out
    temps = list(range(10, 170, 10))
    table_flops = {(i,): float(16 - i) for i in range(16)} | {(100,): model_flops}
    out, asked, _ = _run(temps, temps, [50], budget=95, uniform_flops=7.9, model_flops=table_flops)
    assert ((100,) in asked) == compiled
    assert out.choice == ((100,) if compiled else (8,))


def test_below_the_lowest_plan_every_candidate_is_compiled_before_the_budget_is_refused():
    temps = [30, 20] + list(range(40, 180, 10))  # the model's lowest plan is not the compiler's
    with pytest.raises(ValueError, match="floor 7"):
        _run(temps, list(range(16)), [7, 160], budget=5)
    out, asked, _ = _run(temps, list(range(16)), [50, 160], budget=25)
    # guesses, scaled, find it; the uniform plans, predicted to fit and cheaper, miss: the first
    # compiled beside the first guess (the model puts it at fewer FLOPs), the second beside the
    # second guess (each would compile alone otherwise: 4 steps, not 5)
    assert out.choice == (1,) and sorted(asked[:2]) == [(15,), (100,)]
    assert sorted(asked[2:4]) == [(2,), (101,)] and asked[4:] == [(1,), (0,)]


def test_a_uniform_plan_with_fewer_flops_wins():
    temps = list(range(10, 170, 10))
    flops = [100.0 - i for i in range(16)]
    out, _, _ = _run(temps, temps, [50], budget=95, flops=flops)
    assert out.choice == (100,)  # uniform FLOPs 0.5 < the frontier's 92


@pytest.mark.parametrize("n,k", [(3, 16), (40, 16), (17, 16)])
def test_spread_keeps_both_ends(n, k):
    got = spread(list(range(n)), k)
    assert got[0] == 0 and got[-1] == n - 1 and len(got) == min(n, k) and got == sorted(set(got))


def test_planning_says_what_it_is_doing_and_counts_its_compiles(monkeypatch, caplog):
    """Progress on the `smartremat` logger (here from the first second on), and `Plan.compiles`."""
    import logging

    import jax
    import jax.numpy as jnp

    import smartremat
    from smartremat import _planner
    from benchmarks.models import TutorialStack

    monkeypatch.setattr(_planner, "_QUIET_SECONDS", 0.0)
    smartremat.clear_caches()
    model = TutorialStack(3, 16, 64, jax.random.key(0))
    with caplog.at_level(logging.INFO, logger="smartremat"):
        plan = smartremat.explain(smartremat.smartremat(budget_mb=0.05, nested=False)(model), jnp.ones((8, 16)))
    assert "profiling block call 1 of 3: layers[0]" in caplog.text
    def last(what):  # the "(N so far)" count of the last message about `what`
        said = [r.getMessage() for r in caplog.records if what in r.getMessage()]
        return int(said[-1].split("(")[-1].split()[0]) if said else 0

    candidates, confirmed = last("candidate plan(s)"), last("under every loss")
    assert candidates > 0 and confirmed > 0  # three default losses: the chosen plan is confirmed
    assert plan.compiles == candidates + 2 * confirmed
    assert len(plan.checked) == candidates  # each candidate's predicted peak beside its compiled temp
    assert (plan.predicted_peak_bytes, plan.compiled_peak_bytes) in plan.checked
    assert f"{plan.compiles} whole-step compiles" in str(plan)
    named = re.findall(r"candidate (.+): predicted ([0-9.]+) MB, compiled ([0-9.]+) MB, [0-9.]+ GFLOP", caplog.text)
    assert len(named) == candidates  # each candidate named with its figures, as the plan records them
    said = sorted(float(x) for _, p, c in named for x in (p, c))
    assert said == pytest.approx(sorted(x / 2**20 for pair in plan.checked for x in pair), abs=0.051)


def test_an_over_predicted_cheaper_neighbour_is_compiled():
    # point 0 compiles to half its prediction: scaled by that, point 1 (20 -> 10) could fit, so it is
    # compiled (9) and chosen; point 2 (30 -> 13.5 at the smallest ratio, 0.45) misses by over 5%
    out, asked, _ = _run([5, 9, 30], [10, 20, 30], [], budget=11)
    assert asked == [(0,), (1,)] and out.choice == (1,)


def test_a_uniform_plan_is_not_scaled_up_by_under_predicted_mixed_plans():
    # mixed frontier points compile 20% over their prediction, the uniform plan (100) exactly; scaled
    # up by 1.2 it would seem to miss by more than 10%, and it fits and costs less
    temps = [round(t * 1.2) for t in range(10, 170, 10)]
    out, asked, _ = _run(temps, list(range(10, 170, 10)), [90], budget=95, uniform_predicted=[90],
                         uniform_flops=1.0)
    assert (100,) in asked and out.choice == (100,)


def test_uniform_policies_merged_for_every_block_are_one_choice():
    # the tutorial block saves the same residuals under `dots_saveable` and
    # `dots_with_no_batch_dims_saveable` (no batched products): one program, so one choice to compile
    import jax
    import jax.numpy as jnp

    from smartremat import _model
    from smartremat._discover import call_module
    from smartremat._policies import DEFAULT_MENU
    from smartremat._spec import make_spec
    from benchmarks.models import TutorialStack

    model, x = TutorialStack(3, 16, 64, jax.random.key(0)), jnp.ones((8, 16))
    config = _model.Config(budget_bytes=10**9, policies=DEFAULT_MENU, calibrate=False, nested=False)
    built = _model.build_model(call_module, make_spec(model, (x,), {}), model, config)
    names = [p.name for p in DEFAULT_MENU]
    dots, no_batch = (DEFAULT_MENU[names.index(n)] for n in ("dots_saveable", "dots_with_no_batch_dims_saveable"))
    assert _model.uniform(built, no_batch) == _model.uniform(built, dots) != _model.uniform(built, DEFAULT_MENU[0])


@pytest.mark.parametrize("uniform_flops,want", [(3.0, (0,)), (2.0, (1,))])
def test_candidates_within_the_tie_margin_go_to_the_fewest_temp_bytes(uniform_flops, want):
    # compiled FLOPs 0.25% apart are a tie (XLA's fusion moves them that much between plans the model
    # counts alike): the plan of fewer temp bytes wins, unless it costs more than a fitting uniform plan
    from types import SimpleNamespace

    from smartremat._search import TIE_MARGIN, _chosen

    figures = {(0,): (10, 2.005), (1,): (12, 2.0), (100,): (15, uniform_flops), (2,): (30, 1.0)}
    assert (2.005 - 2.0) / 2.0 < TIE_MARGIN
    assert _chosen(SimpleNamespace(figures=figures), 20, lambda c, f: f, [(100,)]) == want
    assert _chosen(SimpleNamespace(figures=figures), 9, lambda c, f: f, [(100,)]) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=2, max_size=16), st.floats(0.3, 3.0), st.data())
def test_candidates_that_cannot_be_built_are_skipped_not_raised(steps, ratio, data):
    """A candidate whose `measure` raises `Unbuildable` (a scan split whose pieces take different
    operands) is skipped: the search returns the best of the others and counts the skipped."""
    from smartremat._search import Unbuildable

    temps = [sum(steps[: i + 1]) for i in range(len(steps))]
    broken = set(data.draw(st.sets(st.integers(0, len(temps) - 2), max_size=len(temps) - 1)))
    budget = data.draw(st.integers(temps[-1], temps[-1] + 50))  # the last point (never broken) fits
    flops = [float(len(temps) - i) for i in range(len(temps))]

    asked = []

    def measure(choice):
        asked.append(choice)
        if choice[0] in broken:
            raise Unbuildable("cannot split")
        return temps[choice[0]], flops[choice[0]]

    out = search([(i,) for i in range(len(temps))], [], Estimates(lambda c: temps[c[0]] * ratio, lambda c: flops[c[0]]),
                 budget, measure, lambda c, f: f, lambda floor: ValueError(f"floor {floor}"), lambda _: None)
    fits = [i for i in range(len(temps)) if i not in broken and temps[i] <= budget]
    assert out.choice[0] not in broken and out.compiled[0] <= budget
    assert out.choice == (max(fits),)  # the cheapest buildable plan that fits
    assert out.skipped == len(broken & {c[0] for c in asked})
    assert not broken & {c[0] for c in out.measured} and len(out.measured) == len(out.checked)  # paired


def test_candidates_are_spread_over_the_frontier_and_dense_near_the_budget():
    """Spread over the whole frontier alone, the points near the budget were 2 GB apart on the
    TPU's GPT-2-medium (docs/fit.md): here 400 points spread alone are 26-27 apart everywhere."""
    front = [(i,) for i in range(400)]  # predicted peak i
    got = candidates(front, lambda p: p[0], 200, n=16)
    assert got == sorted(got) and len(got) <= 32
    assert set(spread(front, 16)) <= set(got)
    near = [p[0] for p in got if 200 / (1 + NEAR_BUDGET) <= p[0] <= 200 * (1 + NEAR_BUDGET)]
    assert max(b - a for a, b in zip(near, near[1:])) <= 5


@pytest.mark.parametrize("step,want,compiles", [(0.5, (3,), 1), (10.0, (4,), 2)])
def test_the_bracket_stops_where_no_point_left_can_beat_the_fitting_one_by_the_tie_margin(step, want, compiles):
    """The model over-predicts by 20%: the first guess (3,) fits, and (4,) would too. Where the
    model's FLOPs between them differ by less than `TIE_MARGIN` of the rank, (3,) would win the
    tie anyway (fewer temp bytes): nothing more is compiled. Where they differ by more, the
    bracket goes on and (4,) wins."""
    temps = [10 * (i + 1) for i in range(10)]
    out, asked, _ = _run(temps, [t * 1.2 for t in temps], [], 55, flops=[1000 - step * i for i in range(10)])
    assert out.choice == want and len(asked) == compiles


def test_the_bracket_stops_where_no_point_that_could_fit_can_beat_the_fitting_one():
    """The model over-predicts by 20%: the first guess (3,) fits, and (4,) would too, 0.05% cheaper
    (a tie (3,) wins). The points above take half the FLOPs, but even scaled by the compiled ratio
    they are predicted to miss the budget by more than `MISS_MARGIN`: they cannot win, so nothing
    more is compiled (on the TPU's GPT-2-medium the bracket compiled three more candidates at 9500 MB,
    each 35-50 s, and the tie rule kept the first: docs/fit.md)."""
    temps = [10 * (i + 1) for i in range(10)]
    flops = [1000 - 0.5 * i if i <= 5 else 500.0 for i in range(10)]
    out, asked, table = _run(temps, [t * 1.2 for t in temps], [], 55, flops=flops)
    assert out.choice == (3,) and asked == [(3,)]
    assert _exhaustive(table, 55) == (4,)  # by FLOPs alone; the tie goes to (3,)'s fewer temp bytes


@pytest.mark.parametrize("step,first", [(0.0, 1), (1000.0, 2)])
def test_the_first_compile_judges_its_spare_against_the_step_not_the_recompute(step, first):
    """Before anything is compiled, a uniform plan compiles beside the guess where the model puts
    it within `WIN_MARGIN` of the guess's step FLOPs: its recompute and the model's `step`
    estimate (on the CPU's GPT-2-small the guess recomputes less than `dots_saveable` on every
    block, which then compiled alone after it, and won). Against the recompute alone (no `step`),
    a difference of 5 of 10 FLOPs is far beyond the margin; against a step of 1010, within it."""
    temps = [10 * (i + 1) for i in range(16)]
    flops = {(i,): float(16 - i) for i in range(16)} | {(100,): 15.0}
    batches = []
    out = search([(i,) for i in range(16)], [(100,)],
                 Estimates(({(i,): 10.0 * (i + 1) for i in range(16)} | {(100,): 90.0}).__getitem__, flops.__getitem__,
                           step),
                 105, lambda c: (temps[c[0]], flops[c]) if c != (100,) else (90, 15.0), lambda c, f: f,
                 lambda floor: ValueError(floor), batches.append)
    assert int(batches[0].split()[1]) == first and out.choice == (9,)  # (9,): 100 bytes, 7 FLOPs


def test_fallback_tiers_are_compiled_in_order_and_only_while_nothing_fits():
    """Where no frontier point or uniform plan fits, the first fallback tier is compiled; the
    second only where none of the first fits, and the floor the error states is the lowest
    compiled over every tier."""
    temps = {(0,): 50, (1,): 40, (100,): 45, (200,): 30, (300,): 20, (301,): 10}

    def run(budget):
        asked = []

        def measure(choice):
            asked.append(choice)
            return temps[choice], 1.0

        try:
            out = search([(0,), (1,)], [(100,)], Estimates(lambda c: 1, lambda c: 1.0), budget, measure,
                         lambda c, f: f, lambda floor: ValueError(f"floor {floor}"), lambda _: None,
                         fallback=([(200,)], [(300,), (301,)]))
        except ValueError as e:
            return str(e), asked
        return out.choice, asked

    choice, asked = run(35)  # the first tier fits: the second is not compiled
    assert choice == (200,) and sorted(asked[:-1]) == [(0,), (1,), (100,)] and asked[-1] == (200,)
    choice, asked = run(15)
    assert choice == (301,) and asked[-3:] == [(200,), (300,), (301,)]
    error, asked = run(5)
    assert error == "floor 10" and sorted(asked) == sorted(temps) and len(asked) == len(temps)
