"""Hold the model's frontier against the compiler with few whole-step compiles (docs/how-it-works.md,
step 5, walks the rules).

The candidates are the model's Pareto frontier (sorted by predicted peak: `MAX_CANDIDATES` points
spread evenly, and as many more near the budget, `candidates`) and the uniform plans. `search` compiles the point the model chooses, then
guesses by the predicted peaks scaled by the compiled/predicted ratio of the nearest compiled point
(if the lowest-peak point misses, every candidate the model does not put above the lowest temp
compiled by `FLOOR_MARGIN`, lowest first, and the fallback tiers whole: fusion and buffer reuse can
reorder plans near the floor, and a device that refused the lowest may hold another: fuzz seed
20261206, case 81);
then frontier points until the cheapest fitting one is bracketed (`MISS_MARGIN`); then the uniform
plans that could win (`FIT_MARGIN`, `WIN_MARGIN`), their predicted peaks scaled by the
smallest ratio seen if below 1, never up (an under-predicted mixed plan must not rule out a uniform
plan the model predicts well: with d61ddb0's profile the ResNet's mixed plans were 16-20% under;
after XLA's fusion a uniform policy can take fewer FLOPs than the model says, by up to 1.6% of the
step on the quick benchmark models: docs/facts.md, fact 9). A frontier point compiled alone has
beside it a uniform plan the search would likely compile later (`spare`; for the very first
compile, one the model puts within the margins of the budget and of the point's FLOPs).

The fitting candidate of lowest rank wins: its compiled FLOPs (the model's FLOPs when a block is
scanned: XLA counts a loop body once), plus on an accelerator the model's charge for the bytes it
keeps (`_objective`); ties (within `TIE_MARGIN`, no costlier than a fitting uniform plan) go to
the fewest temp bytes. Which candidates are compiled depends only on the budget and the signature.
Under several losses, candidates are compiled under the first (a lower bound of the largest temp),
and under every loss only when about to be chosen or when one may set the floor an error states.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

MAX_CANDIDATES = 16
#: The next cheaper frontier point than one that fits is not compiled when it is predicted (scaled by
#: the smallest compiled/predicted ratio seen) to miss the budget by more than this share.
MISS_MARGIN = 0.05
#: A uniform plan is compiled if its scaled predicted peak is within this share above the budget...
FIT_MARGIN = 0.10
#: ... and the model's FLOPs exceed the best fitting candidate's by at most this share of its own.
WIN_MARGIN = 0.02
#: Fitting candidates whose rank is within this share of the lowest are tied, and the one of fewest
#: temp bytes is chosen: XLA's fusion moves compiled FLOPs by this much between plans the model
#: orders otherwise, and a choice made on such a difference made the compiled temp bytes rise as the
#: budget fell (tests/test_step.py's and tests/test_fit.py's transformer; docs/fit.md, "Planning time").
TIE_MARGIN = 0.005
#: Frontier points predicted within this share of the budget (either side) are candidates as well
#: as those spread over the whole frontier (`candidates`): the model's error on the TPU's GPT-2-medium
#: is 5.6% either way (docs/fit.md), and up to 20% on the quick benchmark's ResNet.
NEAR_BUDGET = 0.15
#: Where no candidate compiled fits, one not compiled yet is left out when the model puts it above
#: the lowest compiled temp even with its prediction, scaled by the smallest compiled/predicted
#: ratio seen, divided by 1 + this (`_may_set_floor`): on the CPU's ViT of tests/real the ratios of
#: the 24 candidates spread from 0.80 to 1.11, and the TPU model error is 15% (docs/fit.md).
FLOOR_MARGIN = 0.25
#: What a floor stated from compiled candidates covers: the errors of infeasible budgets say it.
FLOOR_SCOPE = (f"the candidate plans not compiled are ones smartremat's model, scaled to the compiled figures, "
               f"puts more than {FLOOR_MARGIN:.0%} above this")
#: Candidates compiled together in one search step: a step that needs one fills the second with a
#: uniform plan that could win (`spare` in `_search`).
SPARE_BATCH = 2

Choice = tuple[int, ...]


class Unbuildable(RuntimeError):
    """Raised by `measure` for a candidate plan that cannot be built (a scan whose pieces cannot
    be made to take the same operands): the search skips it (`UNBUILT`) and says so in the plan."""


#: The figures of a candidate that cannot be built: it fits no budget and wins no comparison.
UNBUILT = (2**62, float("inf"))


def is_compiled(figures: tuple[int, float]) -> bool:
    """Whether a candidate's figures are the compiler's: not one that could not be built, nor one
    the device refused for memory (both have infinite FLOPs)."""
    return math.isfinite(figures[1])


def checked_pair(predicted: float, figures: tuple[int, float]) -> tuple[int, int] | None:
    """`(predicted peak, compiled temp)` of a candidate compiled, `None` for one the device refused
    (its figure is the bytes the refusal named, not a compiled program's)."""
    return (int(predicted), int(figures[0])) if is_compiled(figures) else None


@dataclass(frozen=True)
class Outcome:
    """What the search found: the chosen candidate and the candidates it compiled."""

    choice: Choice
    compiled: tuple[int, float] | None  # the choice's compiled (temp, flops); None: unconfirmed (`_planner`)
    measured: tuple[Choice, ...]  # compiled under the first loss (those not built are counted in `skipped`)
    confirmed: tuple[Choice, ...] = ()  # the candidates also compiled under every loss
    # (predicted peak, compiled temp) per candidate of `measured`; None for one the device refused
    checked: tuple[tuple[int, int] | None, ...] = ()
    timed: tuple[tuple[int, float, float], ...] = ()  # with tune=True: (temp, flops, seconds) per candidate timed
    skipped: int = 0  # candidates that could not be built (`Unbuildable`)


def spread(front: Sequence, n: int) -> list:
    """At most `n` frontier points, evenly spaced, always keeping both ends."""
    if len(front) <= n:
        return list(front)
    idx = sorted({round(k * (len(front) - 1) / (n - 1)) for k in range(n)})
    return [front[i] for i in idx]


def candidates(front: Sequence, peak: Callable[[Any], float], budget: int, n: int = MAX_CANDIDATES) -> list:
    """The frontier points the search may compile, sorted by predicted peak as `front` is: `n`
    spread evenly over the whole frontier, and up to `n` more spread evenly over those the model
    predicts within `NEAR_BUDGET` of `budget`. Spread over the whole frontier alone, neighbours
    near the budget can be far apart: on the TPU's 24-block GPT-2-medium they were about 2 GB
    apart, and at 9500 MB the search compiled uniform `dots_with_no_batch_dims_saveable` (8926 MB)
    with no candidate between it and the next point (docs/fit.md)."""
    near = [p for p in front if budget / (1 + NEAR_BUDGET) <= peak(p) <= budget * (1 + NEAR_BUDGET)]
    keep = {id(p) for p in [*spread(front, n), *spread(near, n)]}
    return [p for p in front if id(p) in keep]


class CandidateFigures:
    """Compiled `(temp, flops)` per candidate, measured in parallel batches, in order asked.

    `figures[c]` is exact once `c` is confirmed (or when there is no `confirm`: one loss), else
    the first loss's temp, a lower bound."""

    def __init__(self, measure: Callable[[Choice], tuple[int, float]], progress: Callable[[str], None],
                 confirm: Callable[[Choice], tuple[int, float]] | None, raising: bool = False):
        self.measure, self.progress, self.confirm = measure, progress, confirm
        self.figures: dict[Choice, tuple[int, float]] = {}
        self.confirmed: set[Choice] = set()
        self.raising = raising  # (`search`'s) a candidate found unbuildable restarts the search

    def __call__(self, *choices: Choice) -> None:
        new = [c for c in dict.fromkeys(choices) if c not in self.figures]
        if not new:
            return
        self.progress(f"compiling {len(new)} candidate plan(s) ({len(self.figures) + len(new)} so far)")
        with ThreadPoolExecutor(max(1, min(len(new), os.cpu_count() or 1))) as pool:
            self.figures.update(zip(new, pool.map(self._measured, new)))
        if self.raising and any(self.figures[c] == UNBUILT for c in new):
            raise _Unbuilt()

    def _measured(self, choice: Choice) -> tuple[int, float]:
        try:
            return self.measure(choice)
        except Unbuildable:
            return UNBUILT

    @property
    def skipped(self) -> int:
        return sum(f == UNBUILT for f in self.figures.values())

    def exact(self, choice: Choice) -> int:
        """`choice`'s temp bytes under every loss (compiled the first time it is asked)."""
        if self.confirm is not None and choice not in self.confirmed:
            self.progress(f"compiling a candidate plan under every loss ({len(self.confirmed) + 1} so far)")
            self.confirmed.add(choice)
            try:
                temp, flops = self.confirm(choice)  # inf FLOPs: refused under some loss
                self.figures[choice] = (temp, self.figures[choice][1] if math.isfinite(flops) else flops)
            except Unbuildable:
                self.figures[choice] = UNBUILT
                if self.raising:
                    raise _Unbuilt() from None
        return self.figures[choice][0]

    def floor(self) -> float:
        """The lowest exact temp bytes among the candidates compiled (branch and bound: a
        first-loss figure at or above the best exact one cannot beat it); candidates not built or
        refused by the device (infinite FLOPs) reach nothing. `inf` where none was compiled."""
        best = float("inf")
        for c in sorted(self.figures, key=lambda c: self.figures[c][0]):
            if self.figures[c][0] >= best:
                break
            if not is_compiled(self.figures[c]):
                continue
            temp = self.exact(c)  # under every loss: it may be refused there (its FLOPs become inf)
            if is_compiled(self.figures[c]):
                best = min(best, temp)
        return best


@dataclass(frozen=True)
class Estimates:
    """What the model says of candidates: predicted peak bytes, and their objective (recompute
    FLOPs, on an accelerator charged for kept bytes: `_objective`) as `flops`."""

    peak: Callable[[Choice], float]
    flops: Callable[[Choice], float]
    #: A lower estimate of a step's FLOPs besides what it recomputes (its blocks' forward and
    #: backward): before anything is compiled, the first compile's spare is judged against it, as
    #: later ones are against a compiled step's FLOPs (`_could_win`). 0: against the point's `flops`.
    step: float = 0.0


def search(points: Sequence[Choice], uniforms: Sequence[Choice], model: Estimates, budget: int,
           measure: Callable[[Choice], tuple[int, float]], rank: Callable[[Choice, float], float],
           error: Callable[[float], Exception], progress: Callable[[str], None],
           confirm: Callable[[Choice], tuple[int, float]] | None = None,
           fallback: Sequence[Sequence[Choice]] = ()) -> Outcome:
    """The cheapest candidate whose compiled temp bytes fit `budget` (within `TIE_MARGIN`, the one
    of fewest temp bytes).

    **Arguments:**

    - `points`: frontier choices sorted by predicted peak, lowest first (so costliest first).
    - `uniforms`: the uniform plans' choices.
    - `model`: the model's predicted peak (bytes) and FLOPs of a choice.
    - `measure`: a choice's compiled `(temp bytes, flops)` (under the first loss).
    - `rank`: the figure to minimise, from a choice and its compiled FLOPs.
    - `error`: the exception to raise, given the lowest compiled temp (`inf` where every
      candidate was refused or not built), when nothing fits.
    - `confirm`: a choice's compiled figures under every loss (the largest temp), if several.
    - `fallback`: tiers of choices compiled only where no other candidate fits, a tier only where
      none of the earlier ones fits (the programs the model was refined on, which the device
      compiled though the model may rule them out; then choices the model rules out that the
      compiler may not).
    """
    compiled = CandidateFigures(measure, progress, confirm, raising=True)
    while True:  # a candidate found unbuildable leaves the frontier, and the search goes on without it
        built = [u for u in uniforms if compiled.figures.get(u) != UNBUILT]
        live = [c for c in points if compiled.figures.get(c) != UNBUILT] or built
        try:
            return _search(live, built, model, budget, compiled, rank, error, fallback)
        except _Unbuilt:
            continue


class _Unbuilt(Exception):
    """A candidate just compiled could not be built: start the search again without it."""


def _search(points: Sequence[Choice], uniforms: Sequence[Choice], model: Estimates, budget: int,
            compiled: CandidateFigures, rank: Callable[[Choice, float], float], error: Callable[[float], Exception],
            fallback: Sequence[Sequence[Choice]]) -> Outcome:
    predicted = [model.peak(p) for p in points]

    def spare(point: Choice, *more: Choice) -> tuple[Choice, ...]:
        """The frontier point about to be compiled alone, with up to `SPARE_BATCH - 1` uniform plans
        that could win if it fits: by the model's FLOPs no more than the point's, within the margin
        of the best fitting candidate's rank (while none fits, the costliest compiled one's, which is
        lower: the plan that fits will cost more). A step compiling one candidate leaves a core
        idle; a uniform plan the search would most likely compile later compiles there in the same
        wall time. The very first compile (nothing compiled yet) is judged against the point
        itself: a uniform plan the model predicts within `FIT_MARGIN` of the budget and within
        `WIN_MARGIN` of the point's step FLOPs (its `flops` and the model's `step` estimate). The batch size is fixed, not the core count, so that
        which candidates are compiled does not depend on the machine."""
        figures, batch = compiled.figures, (point, *more)
        if len(batch) >= SPARE_BATCH:
            return batch
        if not figures:  # the first compile: against the point itself, by the model's FLOPs alone
            could = _could_win(uniforms, model, compiled, points, predicted, budget, None, rank, against=point)
            return batch + tuple(u for u in could if u not in batch)[: SPARE_BATCH - len(batch)]
        best = _best(compiled, budget, rank)
        if best is None:
            built = [c for c in figures if is_compiled(figures[c])]
            if not built:
                return batch
            best = max(built, key=lambda c: rank(c, figures[c][1]))
        could = _could_win(uniforms, model, compiled, points, predicted, budget, best, rank, against=point)
        ready = [u for u in could if u not in batch]
        return batch + tuple(ready[: SPARE_BATCH - len(batch)])

    def settled(lo: int, hi: int) -> bool:
        """No point between `lo` (fits) and `hi` (misses) can win: the model puts the cheapest of
        them that could fit (predicted, scaled by the smallest compiled/predicted ratio seen, within
        `MISS_MARGIN` of the budget) within `TIE_MARGIN` of `lo`'s rank, a tie `lo` wins with its
        fewer temp bytes."""
        low, scale = points[lo], min(_ratios(points, predicted, compiled.figures).values(), default=1.0)
        last = max((i for i in range(lo + 1, hi) if predicted[i] * scale <= budget * (1 + MISS_MARGIN)), default=lo)
        return model.flops(low) - model.flops(points[last]) <= TIE_MARGIN * abs(rank(low, compiled.figures[low][1]))

    guess = _guess(points, predicted, {}, budget, 0, len(points))
    compiled(*spare(points[guess]))
    for attempt in range(2):  # missed: the next guess; missed again: with the lowest-peak point
        if compiled.figures[points[guess]][0] <= budget or guess == 0:
            break
        guess = _guess(points, predicted, compiled.figures, budget, 0, guess)
        compiled(*spare(points[guess], *([points[0]] if attempt else [])))
    while True:
        _bracket(points, predicted, compiled, budget, spare, settled)
        best = _best(compiled, budget, rank)
        if best is not None:
            compiled(*_could_win(uniforms, model, compiled, points, predicted, budget, best, rank))
            best = _chosen(compiled, budget, rank, uniforms)
        if best is None:  # nothing compiled fits: those that may set the floor, then the tiers
            pending = _may_set_floor([*uniforms, *points], model, compiled) or next(
                (t for t in fallback if not all(c in compiled.figures for c in t)), None)
            if pending is None:
                raise error(compiled.floor())
            compiled(*pending)
            continue
        if compiled.exact(best) <= budget:
            built = [c for c, (t, _) in compiled.figures.items() if t < UNBUILT[0]]  # `measured` pairs with `checked`
            checked = tuple(checked_pair(model.peak(c), compiled.figures[c]) for c in built)
            return Outcome(best, compiled.figures[best], tuple(built), tuple(compiled.confirmed), checked,
                           skipped=compiled.skipped)


def _may_set_floor(choices: Sequence[Choice], model: Estimates, compiled: CandidateFigures) -> list[Choice]:
    """Up to `SPARE_BATCH` of `choices` not compiled yet that the model does not put above the
    lowest temp compiled (under every loss: `CandidateFigures.floor`), lowest predicted first: their
    predicted peak, scaled by the smallest compiled/predicted ratio of any candidate compiled (never
    up) and divided by 1 + `FLOOR_MARGIN`, is below it. Every one while none compiled. Two at a time,
    not every one left at once: the floor the first two set leaves out more of the rest (a batch
    wider than the cores, or one sized by them, would also make which candidates are compiled
    depend on the machine)."""
    figures = compiled.figures
    left = sorted((c for c in dict.fromkeys(choices) if c not in figures), key=model.peak)
    ratios = [t / max(model.peak(c), 1.0) for c, (t, f) in figures.items() if is_compiled((t, f))]
    floor = compiled.floor()
    if math.isfinite(floor):
        scale = min([1.0, *ratios]) / (1 + FLOOR_MARGIN)
        left = [c for c in left if model.peak(c) * scale < floor]
    return left[:SPARE_BATCH]


def _best(compiled: CandidateFigures, budget: int, rank: Callable[[Choice, float], float]) -> Choice | None:
    """The compiled candidate that fits (as far as known) with the lowest rank."""
    fits = [(rank(c, f), t, c) for c, (t, f) in compiled.figures.items() if t <= budget]
    return min(fits)[2] if fits else None


def _chosen(compiled: CandidateFigures, budget: int, rank: Callable[[Choice, float], float],
            uniforms: Sequence[Choice]) -> Choice | None:
    """Among the compiled candidates that fit, those within `TIE_MARGIN` of the lowest rank and
    no costlier than any fitting uniform plan are tied; the one of fewest temp bytes wins."""
    fits = [(rank(c, f), t, c) for c, (t, f) in compiled.figures.items() if t <= budget]
    if not fits:
        return None
    low = min(r for r, _, _ in fits)
    cap = min([low + TIE_MARGIN * abs(low)] + [r for r, _, c in fits if c in uniforms])
    return min((t, r, c) for r, t, c in fits if r <= cap)[2]


def _could_win(uniforms: Sequence[Choice], model: Estimates, compiled: CandidateFigures, points: Sequence[Choice],
               predicted: Sequence[float], budget: int, best: Choice | None, rank: Callable[[Choice, float], float],
               against: Choice | None = None) -> list[Choice]:
    """The uniform plans not compiled yet that the model does not rule out: they could fit and
    could cost no more than `best` (see the module docstring); with `against`, no more than it by
    the model's FLOPs, within the margin of `best`'s rank (of `against`'s FLOPs where nothing is
    compiled yet: `best` None)."""
    scale = min([1.0, *_ratios(points, predicted, compiled.figures).values()])  # never scaled up
    judged = against if against is not None else best
    if judged is None:
        raise ValueError("_could_win needs `best` or `against`")
    ref = model.flops(judged)
    slack = WIN_MARGIN * abs(ref + model.step if best is None else rank(best, compiled.figures[best][1]))
    return [u for u in uniforms if u not in compiled.figures
            and model.peak(u) * scale <= budget * (1 + FIT_MARGIN)
            and model.flops(u) - ref <= slack]


def _bracket(points: Sequence[Choice], predicted: Sequence[float], compiled: CandidateFigures, budget: int,
             spare: Callable[..., tuple[Choice, ...]], settled: Callable[[int, int], bool]) -> None:
    """Compile frontier points until a fitting one is known and the next cheaper one misses,
    compiled or as predicted (scaled by the smallest ratio seen) by more than `MISS_MARGIN` (or the
    cheapest point fits), or until no point between them can win (`settled`). Interpolation by
    the calibrated model, falling back to bisection when the bracket does not shrink fast."""
    lo, hi = _known_bracket(points, compiled.figures, budget)
    steps = 0
    while hi - lo > 1:
        ratios = _ratios(points, predicted, compiled.figures).values()
        if lo >= 0 and ratios and predicted[lo + 1] * min(ratios) > budget * (1 + MISS_MARGIN):
            return
        if lo >= 0 and settled(lo, hi):
            return
        i = (lo + hi) // 2 if steps >= 2 else _guess(points, predicted, compiled.figures, budget, lo + 1, hi)
        compiled(*spare(points[i]))
        lo, hi = _known_bracket(points, compiled.figures, budget)
        steps += 1


def _ratios(points: Sequence[Choice], predicted: Sequence[float], figures: dict) -> dict[int, float]:
    """`{index: compiled over predicted bytes}` of each frontier point compiled so far."""
    return {i: figures[p][0] / max(q, 1) for i, (p, q) in enumerate(zip(points, predicted))
            if p in figures and is_compiled(figures[p])}


def _known_bracket(points: Sequence[Choice], figures: dict, budget: int) -> tuple[int, int]:
    """`(lo, hi)`: the cheapest compiled point that fits (index; `-1` if none), and the first
    compiled point above it that misses (`len(points)` if none)."""
    known = [(i, figures[p][0] <= budget) for i, p in enumerate(points) if p in figures]
    lo = max((i for i, ok in known if ok), default=-1)
    hi = min((i for i, ok in known if not ok and i > lo), default=len(points))
    return lo, hi


def _guess(points: Sequence[Choice], predicted: Sequence[float], figures: dict, budget: int,
           lo: int, hi: int) -> int:
    """The cheapest index in `[lo, hi)` whose predicted peak, scaled by the compiled/predicted
    ratio of the nearest compiled frontier point, fits `budget`."""
    known = _ratios(points, predicted, figures)
    best = lo
    for i in range(lo, hi):
        ratio = known[min(known, key=lambda k: abs(k - i))] if known else 1.0
        if predicted[i] * ratio <= budget:
            best = i
    return best
