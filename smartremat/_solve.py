"""Exact minimum-recompute choice under the order-aware peak, and the whole frontier.

`solve` is a dynamic programme over stages in call order whose state is the bytes kept so
far; states dominated in (kept bytes, cost) are dropped, which loses nothing because every
later constraint only gets harder as kept bytes grow. All figures are integers, so the
result is exact; `tests/test_solve.py` checks it against brute force.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._memory import Stage, cost_of, peak_of

_MAX_TIED_COMBOS = 4096


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]
    peak: int
    cost: int


def _tied_variants(stages: Sequence[Stage]):
    """Stage lists with each multiply-called block fixed to one option (all combinations)."""
    groups: dict[int, list[int]] = {}
    for i, st in enumerate(stages):
        groups.setdefault(st.group, []).append(i)
    tied = [g for g, idx in groups.items() if len(idx) > 1]
    if not tied:
        yield list(stages), None
        return
    sizes = [len(stages[groups[g][0]].saved) for g in tied]
    if np.prod(sizes, dtype=float) > _MAX_TIED_COMBOS:
        raise ValueError(
            f"{len(tied)} blocks are called more than once with {sizes} options each: too many "
            "combinations to plan exactly. Name fewer blocks with `blocks=`."
        )
    for combo in itertools.product(*[range(s) for s in sizes]):
        fixed = {i: o for g, o in zip(tied, combo) for i in groups[g]}
        yield [st if i not in fixed else _only(st, fixed[i]) for i, st in enumerate(stages)], fixed


def _only(st: Stage, o: int) -> Stage:
    big = np.iinfo(np.int64).max // 4
    return Stage(
        tuple(v if k == o else big for k, v in enumerate(st.saved)),
        tuple(v if k == o else big for k, v in enumerate(st.peak)),
        st.cost, st.group)


def _solve_free(stages: Sequence[Stage], limit: int, cap: int | None = None) -> Solution | None:
    """DP over (kept bytes, cost); with `cap`, states costing more are dropped (costs are >= 0)."""
    kept = np.zeros(1, np.int64)
    cost = np.zeros(1, np.int64)
    back: list[tuple[np.ndarray, np.ndarray]] = []
    for st in stages:
        m = len(st.saved)
        cand_k, cand_c, par, opt = [], [], [], []
        for o in range(m):
            feasible = kept + st.peak[o] <= limit
            if cap is not None:
                feasible &= cost + st.cost[o] <= cap
            ok = np.nonzero(feasible)[0]
            cand_k.append(kept[ok] + st.saved[o])
            cand_c.append(cost[ok] + st.cost[o])
            par.append(ok)
            opt.append(np.full(len(ok), o, np.int64))
        k, c, p, op = (np.concatenate(x) for x in (cand_k, cand_c, par, opt))
        if len(k) == 0:
            return None
        order = np.lexsort((c, k))
        k, c, p, op = k[order], c[order], p[order], op[order]
        best_before = np.concatenate([[np.iinfo(np.int64).max], np.minimum.accumulate(c)[:-1]])
        keep = c < best_before
        kept, cost = k[keep], c[keep]
        back.append((p[keep], op[keep]))
    i = int(np.argmin(cost))
    choice = []
    for p, op in reversed(back):
        choice.append(int(op[i]))
        i = int(p[i])
    choice.reverse()
    return Solution(tuple(choice), peak_of(stages, choice), cost_of(stages, choice))


def solve(stages: Sequence[Stage], limit: int) -> Solution | None:
    """The cheapest choice whose modelled peak is `<= limit` bytes, or `None` if none is.

    Among equally cheap choices the one with the lowest peak is returned.
    """
    best = None
    for variant, _ in _tied_variants(stages):
        sol = _solve_free(variant, limit)
        if sol is None:
            continue
        sol = Solution(sol.choice, peak_of(stages, sol.choice), cost_of(stages, sol.choice))
        sol = _lowest_peak_at_cost(variant, sol)
        if best is None or (sol.cost, sol.peak) < (best.cost, best.peak):
            best = sol
    return best


def _lowest_peak_at_cost(stages: Sequence[Stage], sol: Solution) -> Solution:
    """Among choices as cheap as `sol`, one of lowest peak (bisection on the limit)."""
    lo, hi, best = 0, sol.peak, sol
    while lo < hi:
        mid = (lo + hi) // 2
        s = _solve_free(stages, mid, cap=sol.cost)
        if s is not None and s.cost <= sol.cost:
            best, hi = s, min(mid, s.peak)
        else:
            lo = mid + 1
    return Solution(best.choice, peak_of(stages, best.choice), cost_of(stages, best.choice))


def min_peak(stages: Sequence[Stage]) -> Solution:
    """A choice of the lowest modelled peak (ties: cheapest)."""
    best = None
    for variant, _ in _tied_variants(stages):
        front = [(0, 0, ())]  # (kept, worst, choice)
        for st in variant:
            nxt = [(k + st.saved[o], max(w, k + st.peak[o]), ch + (o,))
                   for k, w, ch in front for o in range(len(st.saved))]
            nxt.sort(key=lambda t: (t[0], t[1]))
            front, low = [], None
            for t in nxt:
                if low is None or t[1] < low:
                    front.append(t)
                    low = t[1]
        for _, w, ch in front:
            sol = Solution(ch, peak_of(stages, ch), cost_of(stages, ch))
            if best is None or (sol.peak, sol.cost) < (best.peak, best.cost):
                best = sol
    # cheapest among the lowest-peak choices
    cheapest = solve(stages, best.peak)
    return cheapest if cheapest is not None else best


def frontier(stages: Sequence[Stage], max_points: int = 10_000) -> list[Solution]:
    """Every Pareto-optimal (peak, cost) pair, sorted by peak, each with a choice reaching it."""
    points: list[Solution] = []
    limit = np.iinfo(np.int64).max // 4
    while len(points) < max_points:
        sol = solve(stages, limit)
        if sol is None:
            break
        points.append(sol)
        limit = sol.peak - 1
    return sorted(points, key=lambda s: s.peak)


def brute_force(stages: Sequence[Stage], limit: int) -> Solution | None:
    """Reference solver for tests: enumerate every choice."""
    best = None
    for choice in itertools.product(*[range(len(st.saved)) for st in stages]):
        if any(stages[i].group == stages[j].group and choice[i] != choice[j]
               for i in range(len(stages)) for j in range(i)):
            continue
        pk = peak_of(stages, choice)
        if pk > limit:
            continue
        sol = Solution(choice, pk, cost_of(stages, choice))
        if best is None or (sol.cost, sol.peak) < (best.cost, best.peak):
            best = sol
    return best
