import itertools

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from smartremat._memory import Stage, peak_of
from smartremat._solve import brute_force, frontier, min_peak, solve


@st.composite
def instances(draw):
    n = draw(st.integers(1, 8))
    m = draw(st.integers(1, 4))
    ints = lambda hi: st.tuples(*[st.integers(0, hi)] * m)
    groups = draw(st.lists(st.integers(0, n + 1), min_size=n, max_size=n))
    stages = [Stage(draw(ints(50)), draw(ints(100)), draw(ints(20)), g) for g in groups]
    return stages, draw(st.integers(0, 500))


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
    every = [(peak_of(stages, c), sum(s.cost[o] for s, o in zip(stages, c)))
             for c in itertools.product(*[range(len(s.saved)) for s in stages])
             if all(stages[i].group != stages[j].group or c[i] == c[j]
                    for i in range(len(c)) for j in range(i))]
    pareto = sorted({(p, c) for p, c in every if not any(q <= p and d <= c and (q, d) != (p, c) for q, d in every)})
    assert [(s.peak, s.cost) for s in frontier(stages)] == pareto
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
