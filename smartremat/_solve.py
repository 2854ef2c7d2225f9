"""Exact cheapest choice under the order-aware peak, and the whole frontier. "Cheapest" is the
stages' `objective`: recompute FLOPs, plus on an accelerator a charge per byte kept (`_objective`).

`solve` is a dynamic programme over stages in call order whose state is the bytes kept so far;
states dominated in (kept bytes, cost) are dropped, which loses nothing because every later
constraint only gets harder as kept bytes grow. All figures are integers, so the result is exact
(`tests/test_solve.py` checks it against brute force). Without scan runs the whole frontier comes
from one programme whose states also carry the peak so far (`_frontier_free`), each point's choice
from one programme at its peak and cost: on the quick ResNet's 10 stages, 44 points in 0.12 s, where
solving once per point with a bisection for the lowest peak at each cost (`frontier_by_solving`)
took 2.17 s (`python benchmarks/planning_time.py --breakdown`, docs/results/planning_breakdown_cpu.txt).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ._cache import KeyedCache
from ._memory import Stage, objective_of, peak_of

_MAX_TIED_COMBOS = 4096


@dataclass(frozen=True)
class Solution:
    """A choice (one option per stage), its modelled peak, and its cost by the stages' objective."""

    choice: tuple[int, ...]
    peak: int
    cost: int


def _tied_variants(stages: Sequence[Stage]) -> Iterator[list[Stage]]:
    """Stage lists with each multiply-called block fixed to one option (all combinations)."""
    groups: dict[int, list[int]] = {}
    for i, st in enumerate(stages):
        groups.setdefault(st.group, []).append(i)
    tied = [g for g, idx in groups.items() if len(idx) > 1]
    if not tied:
        yield list(stages)
        return
    sizes = [len(stages[groups[g][0]].saved) for g in tied]
    if np.prod(sizes, dtype=float) > _MAX_TIED_COMBOS:
        raise ValueError(f"{len(tied)} blocks are called more than once with {sizes} options each: too many "
                         "combinations to plan exactly. Name fewer blocks with `blocks=`.")
    for combo in itertools.product(*[range(s) for s in sizes]):
        fixed = {i: o for g, o in zip(tied, combo) for i in groups[g]}
        yield [st if i not in fixed else _only(st, fixed[i]) for i, st in enumerate(stages)]


_FORBIDDEN = np.iinfo(np.int64).max // 4  # an option a tied variant rules out


def _only(st: Stage, o: int) -> Stage:
    return dataclasses.replace(st, saved=tuple(v if k == o else _FORBIDDEN for k, v in enumerate(st.saved)),
                               peak=tuple(v if k == o else _FORBIDDEN for k, v in enumerate(st.peak)))


def _solve_free(stages: Sequence[Stage], limit: int, cap: int | None = None) -> Solution | None:
    """DP over (kept bytes, cost); with `cap`, states costing more are dropped (costs are >= 0).
    Inside a scan run a state also carries its current option, the pieces used so far and whether
    the run was declared split at its start (a split run keeps `split_extra` more bytes per
    iteration, a whole one allows one piece); dominance applies between states of the same label."""
    state = (np.zeros(1, np.int64),) * 2 + (np.full(1, -1, np.int64),) + (np.zeros(1, np.int64),) * 2
    back: list[tuple[np.ndarray, np.ndarray]] = []
    for i, st in enumerate(stages):
        cont = st.run is not None and i > 0 and stages[i - 1].run == st.run
        starts = (0, 1) if st.run is not None and not cont and st.segments > 1 else (0,)
        k, c, p, op, pv, sg, md = _expand(st, state, cont, starts, limit, cap)
        if len(k) == 0:
            return None
        keep = _pareto(k, c, ((pv + 1) * (st.segments + 2) + sg) * 2 + md)
        state = (k[keep], c[keep], pv[keep], sg[keep], md[keep])
        back.append((p[keep], op[keep]))
    choice = _traced_back(back, int(np.argmin(state[1])))
    return Solution(choice, peak_of(stages, choice), objective_of(stages, choice))


def _traced_back(back: list[tuple[np.ndarray, np.ndarray]], i: int) -> tuple[int, ...]:
    """The choice that reached final state `i`, from each stage's `(parent, option)` per state."""
    choice = []
    for parent, option in reversed(back):
        choice.append(int(option[i]))
        i = int(parent[i])
    return tuple(reversed(choice))


def _expand(st: Stage, state: tuple, cont: bool, starts: tuple[int, ...], limit: int,
            cap: int | None) -> tuple[np.ndarray, ...]:
    """The states reached from every current state by taking each option `o` at stage `st`, with
    each run-start mode of `starts`: `(kept, cost, parent state, option, previous option, pieces,
    mode)`, one flat array each, in the order of `(o, mode, parent)` (that of solving them one by one)."""
    kept, cost, prev, segs, mode = state
    opts = np.repeat(np.arange(len(st.saved), dtype=np.int64), len(starts))[:, None]
    if st.run is None:
        mode = np.zeros((len(opts), len(kept)), np.int64)
    elif not cont:
        mode = np.broadcast_to(np.tile(np.array(starts, np.int64), len(st.saved))[:, None], (len(opts), len(kept)))
    else:
        mode = np.broadcast_to(mode, (len(opts), len(kept)))
    peak = np.array(st.peak, np.int64)[opts]
    extra, charge = st.split_extra * mode, np.array(st.objective, np.int64)[opts] + st.split_charge * mode
    feasible = (kept + peak + extra <= limit) & (peak < _FORBIDDEN)
    if cap is not None:
        feasible &= cost + charge <= cap
    if st.run is None:
        new_segs = np.zeros(feasible.shape, np.int64)
    else:
        new_segs = segs + (prev != opts) if cont else np.ones(feasible.shape, np.int64)
        feasible &= new_segs <= np.where(mode == 1, st.segments, 1)
    row, ok = np.nonzero(feasible)
    option = opts[row, 0]
    previous = option.copy() if st.run is not None else np.full(len(ok), -1, np.int64)
    new_kept = kept[ok] + np.array(st.saved, np.int64)[option] + extra[row, ok]
    return new_kept, cost[ok] + charge[row, ok], ok, option, previous, new_segs[row, ok], mode[row, ok]


def _pareto(k: np.ndarray, c: np.ndarray, label: np.ndarray) -> np.ndarray:
    """Indices of states not dominated in (kept, cost) by another state of the same label: in order
    of (label, kept, cost), a state is kept where its cost is below every earlier one of its label.
    One running minimum over all labels does it: each label's costs are lowered by more than the
    costs span times its place in that order, so that they are below those of every label before."""
    order = np.lexsort((c, k, label))
    if len(order) < 2:
        return order
    ls, cs = label[order], c[order]
    group = np.cumsum(np.concatenate(([0], ls[1:] != ls[:-1])))
    low, span = int(cs.min()), int(cs.max()) - int(cs.min()) + 1
    if span * (int(group[-1]) + 1) >= 2**62:  # too wide for int64: their ranks span fewer
        cs, low, span = np.unique(cs, return_inverse=True)[1].reshape(-1), 0, len(cs)
    value = (cs - low) - group * span
    before = np.concatenate(([np.iinfo(np.int64).max], np.minimum.accumulate(value)[:-1]))
    return order[value < before]


def solve(stages: Sequence[Stage], limit: int) -> Solution | None:
    """The cheapest choice whose modelled peak is `<= limit` bytes, or `None` if none is.

    Among equally cheap choices the one with the lowest peak is returned.
    """
    found = [_lowest_peak_at_cost(v, sol) for v in _tied_variants(stages) if (sol := _solve_free(v, limit))]
    return min(found, key=lambda s: (s.cost, s.peak), default=None)


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
    return best


def min_peak(stages: Sequence[Stage]) -> Solution:
    """A choice of the lowest modelled peak (ties: cheapest)."""
    variants = list(_tied_variants(stages))
    if any(st.run is not None for st in stages):  # the lowest limit any choice fits: bisection on the DP
        lo, hi = 0, max(max(st.peak) + st.split_extra for st in stages)
        hi += sum(max(max(st.saved), 0) + st.split_extra for st in stages)  # kept bytes below 0 only lower it
        while lo < hi:
            mid = (lo + hi) // 2
            if any(_solve_free(v, mid) is not None for v in variants):
                hi = mid
            else:
                lo = mid + 1
    else:
        lo = min(_lowest_peak(v) for v in variants)
    sol = solve(stages, lo)
    assert sol is not None
    return sol


def _lowest_peak(stages: Sequence[Stage]) -> int:
    """The lowest peak of stages without scan runs: a DP over (kept bytes, peak so far), keeping the
    states no other state beats in both."""
    kept = worst = np.zeros(1, np.int64)
    for st in stages:
        options = [o for o in range(len(st.saved)) if st.peak[o] < _FORBIDDEN]
        k = np.concatenate([kept + st.saved[o] for o in options])
        w = np.concatenate([np.maximum(worst, kept + st.peak[o]) for o in options])
        keep = _pareto(k, w, np.zeros_like(k))
        kept, worst = k[keep], w[keep]
    return int(worst.min())


#: Frontiers by their stages: a plan, `explain` and the plans of other budgets for the same model
#: share one (with scan runs, solving per point took 45 s per plan of tests/test_scan.py's GRU).
_FRONTIERS: KeyedCache[tuple[Solution, ...]] = KeyedCache(max_entries=16)


def frontier(stages: Sequence[Stage], max_points: int = 10_000) -> list[Solution]:
    """Every Pareto-optimal (peak, cost) pair, sorted by peak, each with a choice reaching it
    (at most `max_points`, the highest-peak ones); once per `(stages, max_points)`."""
    key = tuple(stages)
    return list(_FRONTIERS.get((key, max_points), lambda: tuple(_frontier(key, max_points))))


def _frontier(stages: Sequence[Stage], max_points: int) -> list[Solution]:
    """`frontier`, made."""
    if any(st.run is not None for st in stages):
        return frontier_by_solving(stages, max_points)
    found = sorted((s for variant in _tied_variants(stages) for s in _frontier_free(variant)),
                   key=lambda s: (s.peak, s.cost, s.choice))
    points: list[Solution] = []
    for sol in found:  # the (peak, cost) Pareto points, one choice each
        if not points or sol.cost < points[-1].cost:
            points.append(sol)
    return [_as_solved(stages, p) for p in points[max(0, len(points) - max_points):]]


def _as_solved(stages: Sequence[Stage], point: Solution) -> Solution:
    """`point` with the choice that solving at its peak and cost gives (only choices reaching the
    point are left there), as solving once per point does (`tests/test_solve.py` checks). Choices
    tied on peak and cost (the same options on identical blocks, in another order) do not compile
    alike: on tests/test_fit.py's transformer another choice of a tie made the compiled temp bytes
    rise as the budget fell (docs/fit.md, "Planning time")."""
    for variant in _tied_variants(stages):
        sol = _solve_free(variant, point.peak, cap=point.cost)
        if sol is not None and (sol.peak, sol.cost) == (point.peak, point.cost):
            return sol
    raise AssertionError(f"no choice reaches the frontier point (peak {point.peak}, cost {point.cost})")


def frontier_by_solving(stages: Sequence[Stage], max_points: int = 10_000) -> list[Solution]:
    """`frontier` by solving once per point, each under a limit just below the last point's
    peak: for stages with scan runs, whose pieces the one-pass programme does not track."""
    points: list[Solution] = []
    limit = _FORBIDDEN
    while len(points) < max_points and (sol := solve(stages, limit)) is not None:
        points.append(sol)
        limit = sol.peak - 1
    return sorted(points, key=lambda s: s.peak)


def _frontier_free(stages: Sequence[Stage]) -> list[Solution]:
    """The (peak, cost) Pareto points of stages without scan runs, in one pass: a dynamic
    programme whose states are (kept bytes, peak so far, cost), keeping those no other state
    beats in all three (each later peak and cost only grows with them)."""
    kept, worst, cost = (np.zeros(1, np.int64) for _ in range(3))
    back: list[tuple[np.ndarray, np.ndarray]] = []
    for st in stages:
        options = [o for o in range(len(st.saved)) if st.peak[o] < _FORBIDDEN]
        k = np.concatenate([kept + st.saved[o] for o in options])
        w = np.concatenate([np.maximum(worst, kept + st.peak[o]) for o in options])
        c = np.concatenate([cost + st.objective[o] for o in options])
        parent = np.tile(np.arange(len(kept)), len(options))
        option = np.repeat(np.array(options, np.int64), len(kept))
        keep = _undominated(k, w, c)
        kept, worst, cost = k[keep], w[keep], c[keep]
        back.append((parent[keep], option[keep]))
    return [Solution(_traced_back(back, int(i)), int(worst[i]), int(cost[i]))
            for i in _undominated(np.zeros_like(worst), worst, cost)]


def _undominated(k: np.ndarray, w: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Indices of the states that no other state matches or beats in all of `k`, `w` and `c`
    (one of equal states is kept). A sweep in order of `k`, holding the states kept so far as a
    staircase: `w` rising, `c` falling."""
    order = np.lexsort((c, w, k))
    stair_w: list[int] = []
    stair_c: list[int] = []
    keep = []
    for i in order.tolist():
        wi, ci = int(w[i]), int(c[i])
        j = bisect.bisect_right(stair_w, wi)
        if j and stair_c[j - 1] <= ci:  # a state with no more kept bytes, peak and cost
            continue
        keep.append(i)
        end = j
        while end < len(stair_c) and stair_c[end] >= ci:
            end += 1
        stair_w[j:end], stair_c[j:end] = [wi], [ci]
    return np.array(sorted(keep), np.int64)

