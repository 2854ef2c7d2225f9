import itertools

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from smartremat._memory import Stage, cost_of, objective_of, peak_of, segments_of
from smartremat._solve import Solution, frontier, frontier_by_solving, min_peak, solve


def respects_segments(stages, choice):
    limits = {st.run: st.segments for st in stages if st.run is not None}
    return all(n <= limits[r] for r, n in segments_of(stages, choice).items())


def brute_force(stages, limit):
    """Reference solver: enumerate every choice."""
    best = None
    for choice in itertools.product(*[range(len(st.saved)) for st in stages]):
        if any(stages[i].group == stages[j].group and choice[i] != choice[j]
               for i in range(len(stages)) for j in range(i)):
            continue
        if not respects_segments(stages, choice):
            continue
        pk = peak_of(stages, choice)
        if pk > limit:
            continue
        sol = Solution(choice, pk, objective_of(stages, choice))
        if best is None or (sol.cost, sol.peak) < (best.cost, best.peak):
            best = sol
    return best


#: What the objective charges per kept byte: nothing (the CPU), or as much as a few FLOPs (an accelerator).
CHARGES = st.sampled_from([0.0, 0.3, 2.5])


@st.composite
def instances(draw):
    n = draw(st.integers(1, 8))
    m = draw(st.integers(1, 4))
    ints = lambda lo, hi: st.tuples(*[st.integers(lo, hi)] * m)
    groups = draw(st.lists(st.integers(0, n + 1), min_size=n, max_size=n))
    charge = draw(CHARGES)
    # kept bytes below zero: a block lending its gradient buffers to later blocks (facts.md, fact 12)
    stages = [Stage(draw(ints(-30, 50)), draw(ints(0, 100)), draw(ints(0, 20)), g, kept_charge=charge)
              for g in groups]
    return stages, draw(st.integers(0, 500))


@st.composite
def scanned_instances(draw):
    """A few free stages around one scan run whose pieces are limited to `segments`."""
    before, length, after = draw(st.integers(0, 2)), draw(st.integers(1, 6)), draw(st.integers(0, 2))
    m = draw(st.integers(2, 3))
    ints = lambda hi: st.tuples(*[st.integers(0, hi)] * m)
    segments = draw(st.integers(1, 3))
    charge = draw(CHARGES)
    stage = lambda g, run: Stage(draw(ints(50)), draw(ints(100)), draw(ints(20)), g, run, segments, 0, charge)
    run = stage(0, 7)  # iterations of a scan share their figures
    extra = draw(st.integers(0, 30))  # bytes a split run's pieces copy per iteration
    stages = [stage(10 + i, None) for i in range(before)]
    stages += [Stage(run.saved, run.peak, run.cost, 20 + i, 7, segments, extra, charge) for i in range(length)]
    stages += [stage(30 + i, None) for i in range(after)]
    return stages, draw(st.integers(0, 600))


@settings(max_examples=200, deadline=None)
@given(scanned_instances())
def test_solver_respects_scan_pieces_and_matches_brute_force(inst):
    stages, limit = inst
    got, ref = solve(stages, limit), brute_force(stages, limit)
    assert (got is None) == (ref is None)
    if got is not None:
        assert respects_segments(stages, got.choice)
        assert (got.cost, got.peak) == (ref.cost, ref.peak)
    low = min_peak(stages)
    assert respects_segments(stages, low.choice) and solve(stages, low.peak - 1) is None


def test_more_pieces_can_only_help():
    """Early iterations want remat, late ones not: one piece costs more than two."""
    mk = lambda k: [Stage((10, 1), (20, 11), (0, 5), i, 0, k) for i in range(6)]
    one, two = solve(mk(1), 40), solve(mk(2), 40)
    assert two.choice == (1, 1, 1, 1, 0, 0) and two.cost < one.cost == 30


@settings(max_examples=300, deadline=None)
@given(instances())
def test_solver_matches_brute_force(inst):
    stages, limit = inst
    got, ref = solve(stages, limit), brute_force(stages, limit)
    assert (got is None) == (ref is None)
    if got is not None:
        assert got.peak <= limit and got.peak == peak_of(stages, got.choice)
        assert (got.cost, got.peak) == (ref.cost, ref.peak)


@settings(max_examples=100, deadline=None)
@given(instances())
def test_frontier_and_min_peak_are_exact(inst):
    stages, _ = inst
    every = [(peak_of(stages, c), objective_of(stages, c))
             for c in itertools.product(*[range(len(s.saved)) for s in stages])
             if all(stages[i].group != stages[j].group or c[i] == c[j]
                    for i in range(len(c)) for j in range(i))]
    pareto = sorted({(p, c) for p, c in every if not any(q <= p and d <= c and (q, d) != (p, c) for q, d in every)})
    # in one pass, and by solving once per point (the way stages with scan runs take)
    for found in (frontier(stages), frontier_by_solving(stages)):
        assert [(s.peak, s.cost) for s in found] == pareto
        assert all((peak_of(stages, s.choice), objective_of(stages, s.choice)) == (s.peak, s.cost)
                   for s in found)
    # ties on (peak, cost) compile differently: the one-pass frontier picks the choices solving does
    assert [s.choice for s in frontier(stages)] == [s.choice for s in frontier_by_solving(stages)]
    assert min_peak(stages).peak == min(p for p, _ in every)


def test_order_matters():
    big = Stage(saved=(10, 1), peak=(20, 20), cost=(0, 5), group=0)
    stages = [big, Stage(saved=(10, 1), peak=(20, 20), cost=(0, 5), group=1)]
    # Recomputing the first block lowers the peak; recomputing the last saves nothing.
    assert peak_of(stages, (1, 0)) == 21 < peak_of(stages, (0, 1)) == 30
    assert solve(stages, 21).choice == (1, 0)


def test_budget_above_no_remat_peak_gives_zero_recompute():
    stages = [Stage((5, 1, 0), (9, 8, 9), (0, 2, 7), i) for i in range(6)]
    top = peak_of(stages, (0,) * 6)
    sol = solve(stages, top)
    assert sol.cost == 0 and sol.choice == (0,) * 6
    assert solve(stages, min_peak(stages).peak - 1) is None


@pytest.mark.parametrize("n", [1, 50, 200])
def test_solver_handles_long_chains(n):
    stages = [Stage((100, 50, 30, 10), (300, 250, 240, 300), (0, 5, 8, 20), i) for i in range(n)]
    sol = solve(stages, 3000)
    assert sol is not None and sol.peak <= 3000
    if n == 1:
        assert sol.choice == (0,)


def test_tied_block_never_takes_an_option_its_variant_rules_out():
    """Found by hypothesis: untied choices are cheaper here, and must not leak through."""
    stages = [Stage((0, 0, 0), (0, 0, 0), (0, 1, 1), 0), Stage((0, 0, 0), (0, 0, 0), (1, 0, 0), 0)]
    assert [(s.peak, s.cost) for s in frontier(stages)] == [(0, 1)]
    assert solve(stages, 10**18).cost == 1


def test_splitting_a_scan_pays_for_its_copies():
    """Two pieces would be cheaper, but their copies of the stacked operands cost the budget."""
    free = [Stage((10, 1), (20, 11), (0, 5), i, 0, 2, 0) for i in range(6)]
    dear = [Stage((10, 1), (20, 11), (0, 5), i, 0, 2, 3) for i in range(6)]
    assert solve(free, 40).choice == (1, 1, 1, 1, 0, 0)
    assert solve(dear, 40).choice == (1,) * 6 and peak_of(dear, (1, 1, 1, 1, 0, 0)) > 40


def test_kept_bytes_charged_can_make_recompute_the_cheapest():
    """With a charge per kept byte (an accelerator's objective), recomputing is chosen under a
    budget that fits keeping everything, where FLOPs alone keep everything; the charge counts kept
    bytes above zero only, and the FLOPs stay the FLOPs."""
    free = [Stage(saved=(100, 10), peak=(150, 60), cost=(0, 500), group=i) for i in range(3)]
    charged = [Stage(saved=(100, 10), peak=(150, 60), cost=(0, 500), group=i, kept_charge=10.0) for i in range(3)]
    assert solve(free, 10**6).choice == (0, 0, 0)
    assert charged[0].objective == (1000, 600)
    sol = solve(charged, 10**6)
    assert sol.choice == (1, 1, 1) and sol.cost == 1800 and cost_of(charged, sol.choice) == 1500
    lent = Stage(saved=(-40, 10), peak=(150, 60), cost=(0, 500), group=0, kept_charge=10.0)
    assert lent.objective == (0, 600)
