"""Hold the model's frontier against the compiler with few whole-step compiles.

The candidates are the model's Pareto frontier (sorted by predicted peak, at most
`MAX_CANDIDATES` points spread evenly) and the uniform plans. Compiling all of them costs one
whole-step compile per candidate and loss; `search` compiles only:

1. the lowest-peak frontier point and the uniform plans, first, in parallel. If the lowest-peak
   point fits, the budget is feasible. If it misses, every candidate is compiled (the model's
   lowest peak is not always the compiler's: fusion and buffer reuse can reorder plans near the
   floor), and the budget is infeasible if none fits; the error then states the lowest compiled
   temp of them all. The uniform plans do not depend on the budget (compiled once per signature
   and cached), and after XLA's fusion a uniform policy can take fewer FLOPs than the frontier
   says (docs/facts.md, fact 9);
2. frontier points chosen by the model's predicted peak, scaled by the ratio of compiled to
   predicted bytes measured so far, until the cheapest fitting point is bracketed: it fits and
   the next cheaper point misses (or is the cheapest of all).

Among the candidates compiled for this budget that fit, the one with the fewest compiled FLOPs
wins (the model's FLOPs when a block is scanned: XLA counts a loop body once). Fit, and never
costing more than a fitting uniform plan, are therefore read off the compiler. Which candidates
are compiled depends only on the budget and the signature, never on what was planned before.

With several losses (the decorator without `loss=`), the search compiles each candidate under
the first loss only; a candidate's temp bytes under every loss (the largest counts) are compiled
when it is about to be chosen, or when it may set the floor an error states. The first loss's
figure is a lower bound of the largest, so a candidate refuted this way is marked as missing and
the search goes on.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

MAX_CANDIDATES = 16

Choice = tuple[int, ...]


@dataclass(frozen=True)
class Outcome:
    """What the search found: the chosen candidate, its compiled `(temp, flops)`, the candidates
    it compiled (under the first loss), and how many of them it also compiled under every loss."""

    choice: Choice
    compiled: tuple[int, float]
    measured: tuple[Choice, ...]
    confirmed: int = 0


def spread(front: Sequence, n: int) -> list:
    """At most `n` frontier points, evenly spaced, always keeping both ends."""
    if len(front) <= n:
        return list(front)
    idx = sorted({round(k * (len(front) - 1) / (n - 1)) for k in range(n)})
    return [front[i] for i in idx]


class _Compiled:
    """Compiled `(temp, flops)` per candidate, measured in parallel batches, in order asked.

    `figures[c]` is exact once `c` is confirmed (or when there is no `confirm`: one loss), else
    the first loss's temp, a lower bound."""

    def __init__(self, measure: Callable[[Choice], tuple[int, float]], progress: Callable[[str], None],
                 confirm: Callable[[Choice], tuple[int, float]] | None):
        self.measure, self.progress, self.confirm = measure, progress, confirm
        self.figures: dict[Choice, tuple[int, float]] = {}
        self.confirmed: set[Choice] = set()

    def __call__(self, *choices: Choice) -> None:
        new = [c for c in dict.fromkeys(choices) if c not in self.figures]
        if not new:
            return
        self.progress(f"compiling {len(new)} candidate plan(s) ({len(self.figures) + len(new)} so far)")
        with ThreadPoolExecutor(max(1, min(len(new), os.cpu_count() or 1))) as pool:
            self.figures.update(zip(new, pool.map(self.measure, new)))

    def exact(self, choice: Choice) -> int:
        """`choice`'s temp bytes under every loss (compiled the first time it is asked)."""
        if self.confirm is not None and choice not in self.confirmed:
            self.progress(f"compiling a candidate plan under every loss ({len(self.confirmed) + 1} so far)")
            self.confirmed.add(choice)
            self.figures[choice] = (self.confirm(choice)[0], self.figures[choice][1])
        return self.figures[choice][0]

    def floor(self) -> int:
        """The lowest exact temp bytes among the candidates compiled (branch and bound: a
        first-loss figure at or above the best exact one cannot beat it)."""
        best = None
        for c in sorted(self.figures, key=lambda c: self.figures[c][0]):
            if best is not None and self.figures[c][0] >= best:
                break
            t = self.exact(c)
            best = t if best is None else min(best, t)
        assert best is not None
        return best


def search(points: Sequence[Choice], predicted: Sequence[int], uniforms: Sequence[Choice], budget: int,
           measure: Callable[[Choice], tuple[int, float]], rank: Callable[[Choice, float], float],
           error: Callable[[int], Exception], progress: Callable[[str], None],
           confirm: Callable[[Choice], tuple[int, float]] | None = None) -> Outcome:
    """The cheapest candidate whose compiled temp bytes fit `budget`.

    **Arguments:**

    - `points`: frontier choices sorted by predicted peak, lowest first (so costliest first).
    - `predicted`: their predicted peaks (bytes), ascending.
    - `uniforms`: the uniform plans' choices.
    - `measure`: a choice's compiled `(temp bytes, flops)` (under the first loss).
    - `rank`: the figure to minimise, from a choice and its compiled FLOPs.
    - `error`: the exception to raise, given the lowest compiled temp, when nothing fits.
    - `confirm`: a choice's compiled figures under every loss (the largest temp), if several.
    """
    compiled = _Compiled(measure, progress, confirm)
    compiled(points[0], *uniforms)  # the uniform plans are needed whether or not the lowest plan fits
    if compiled.figures[points[0]][0] <= budget:
        compiled(points[_guess(points, predicted, compiled.figures, budget, 0, len(points))])
    while True:
        _bracket(points, predicted, compiled, budget)
        fits = [(rank(c, f), t, c) for c, (t, f) in compiled.figures.items() if t <= budget]
        if not fits:
            everything = (*uniforms, *points)
            if all(c in compiled.figures for c in everything):
                raise error(compiled.floor())
            compiled(*everything)  # the model's lowest plan is not the compiler's: try them all
            continue
        choice = min(fits)[2]
        if compiled.exact(choice) <= budget:
            return Outcome(choice, compiled.figures[choice], tuple(compiled.figures), len(compiled.confirmed))


def _bracket(points: Sequence[Choice], predicted: Sequence[int], compiled: _Compiled, budget: int) -> None:
    """Compile frontier points until a fitting one and the next cheaper one, which misses, are
    both known (or the cheapest point fits). Interpolation by the calibrated model, falling back
    to bisection when the bracket does not shrink fast."""
    lo, hi = _known_bracket(points, compiled.figures, budget)
    steps = 0
    while hi - lo > 1:
        i = (lo + hi) // 2 if steps >= 2 else _guess(points, predicted, compiled.figures, budget, lo + 1, hi)
        compiled(points[i])
        lo, hi = _known_bracket(points, compiled.figures, budget)
        steps += 1


def _known_bracket(points: Sequence[Choice], figures: dict, budget: int) -> tuple[int, int]:
    """`(lo, hi)`: the cheapest compiled point that fits (index; `-1` if none), and the first
    compiled point above it that misses (`len(points)` if none)."""
    known = [(i, figures[p][0] <= budget) for i, p in enumerate(points) if p in figures]
    lo = max((i for i, ok in known if ok), default=-1)
    hi = min((i for i, ok in known if not ok and i > lo), default=len(points))
    return lo, hi


def _guess(points: Sequence[Choice], predicted: Sequence[int], figures: dict, budget: int,
           lo: int, hi: int) -> int:
    """The cheapest index in `[lo, hi)` whose predicted peak, scaled by the compiled/predicted
    ratio of the nearest compiled frontier point, fits `budget`."""
    known = [(i, figures[p][0] / max(predicted[i], 1)) for i, p in enumerate(points) if p in figures]
    best = lo
    for i in range(lo, hi):
        ratio = min(known, key=lambda k: abs(k[0] - i))[1] if known else 1.0
        if predicted[i] * ratio <= budget:
            best = i
    return best
