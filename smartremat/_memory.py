"""The order-aware peak of forward then backward (docs/facts.md, fact 4).

A model is a sequence of stages in call order, one per block call. Choosing option `o` for
stage `i` keeps `saved[i][o]` bytes alive from stage `i`'s forward until its backward, and
stage `i`'s own forward and backward need `peak[i][o]` bytes (its kept bytes included) while
the kept bytes of every earlier stage are still alive. So

    peak(choice) = max_i ( sum_{j<i} saved[j][c_j] + peak[i][c_i] ),

which is not a sum of saved bytes: the same choices placed on late blocks cost more than
on early ones, and recomputing the last block saves nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """One block call: per option, bytes kept, own peak, and recompute cost (FLOPs).

    Stages with the same `group` are calls of the same block and must take the same option.
    Consecutive stages with the same `run` are the iterations of one `jax.lax.scan`: their
    options may change along the run, but the run splits into at most `segments` pieces of
    one option each (each piece becomes its own scan). A split run's pieces read copies of
    their slices of the scanned operands (the stacked parameters), `split_extra` bytes per
    iteration kept from the piece's forward to its backward; a whole run copies nothing.

    `kept_charge` is what the objective charges per byte kept, in FLOPs (`_objective`): the
    solver minimises `objective`, each option's recompute FLOPs plus that charge for its kept bytes.
    """

    saved: tuple[int, ...]
    peak: tuple[int, ...]
    cost: tuple[int, ...]
    group: int
    run: int | None = None
    segments: int = 1
    split_extra: int = 0
    kept_charge: float = 0.0

    @functools.cached_property
    def objective(self) -> tuple[int, ...]:
        """Per option, what the solver minimises: recompute FLOPs plus `kept_charge` per byte
        kept (kept bytes below zero, lent by gradient buffers, are charged nothing)."""
        if not self.kept_charge:
            return self.cost
        return tuple(c + min(round(self.kept_charge * max(s, 0)), _MOST) for c, s in zip(self.cost, self.saved))

    @functools.cached_property
    def split_charge(self) -> int:
        """The charge for `split_extra`, the bytes a split run's piece copies per iteration."""
        return min(round(self.kept_charge * self.split_extra), _MOST)

    def __post_init__(self) -> None:
        if not (len(self.saved) == len(self.peak) == len(self.cost) > 0):
            raise ValueError("a Stage needs the same number (>0) of saved, peak and cost entries")
        if min(self.cost) < 0:
            raise ValueError(f"Stage costs are recompute FLOPs and must be >= 0, got {self.cost}")


def raised_peaks(saved: Sequence[int], peak: Sequence[int], after: Sequence[int]) -> tuple[int, ...]:
    """Per option, the own peak raised to at least the kept bytes plus `after`: what a compiled
    program shows runs beside those kept bytes in the block's backward. The one formula by which
    a compiled program refines a profiled peak: the last block under a real loss (`_profile`), the
    head after a stack's last block (`_head`), the rest of a training step (`_step_plan`)."""
    return tuple(max(p, s + a) for p, s, a in zip(peak, saved, after, strict=True))


def raised(stage: Stage, after: int) -> Stage:
    """`stage` with `raised_peaks` applied, `after` the same under every option."""
    return dataclasses.replace(stage, peak=raised_peaks(stage.saved, stage.peak, (after,) * len(stage.peak)))


def peak_of(stages: Sequence[Stage], choice: Sequence[int]) -> int:
    """Modelled peak bytes of `choice` (one option index per stage)."""
    return peak_at(stages, choice)[0]


def peak_at(stages: Sequence[Stage], choice: Sequence[int]) -> tuple[int, int, int]:
    """`(peak, i, kept)`: the modelled peak bytes of `choice`, the first stage `i` whose backward
    reaches it, and the bytes kept by the stages before `i` while it runs."""
    split = {r for r, n in segments_of(stages, choice).items() if n > 1}
    kept, worst, at, prior = 0, 0, 0, 0
    for i, (st, c) in enumerate(zip(stages, choice, strict=True)):
        extra = st.split_extra if st.run in split else 0
        if kept + st.peak[c] + extra > worst:
            worst, at, prior = kept + st.peak[c] + extra, i, kept
        kept += st.saved[c] + extra
    return worst, at, prior


#: The largest charge for one option's kept bytes: an option the solver rules out keeps an
#: absurd number of bytes, whose charge must still add up without overflowing 64 bits.
_MOST = 2**52


def cost_of(stages: Sequence[Stage], choice: Sequence[int]) -> int:
    """The FLOPs `choice` recomputes."""
    return sum(st.cost[c] for st, c in zip(stages, choice, strict=True))


def objective_of(stages: Sequence[Stage], choice: Sequence[int]) -> int:
    """What the solver minimises for `choice`: `cost_of` plus the charge for the bytes it keeps
    (a split run's copies of its scanned operands included)."""
    split = {r for r, n in segments_of(stages, choice).items() if n > 1}
    return sum(st.objective[c] + (st.split_charge if st.run in split else 0)
               for st, c in zip(stages, choice, strict=True))


def segments_of(stages: Sequence[Stage], choice: Sequence[int]) -> dict[int, int]:
    """`{run: number of constant pieces}` of `choice` along each scan run."""
    out: dict[int, int] = {}
    prev: tuple[int | None, int] = (None, -1)
    for st, c in zip(stages, choice, strict=True):
        if st.run is not None:
            out[st.run] = out.get(st.run, 0) + (prev != (st.run, c))
        prev = (st.run, c)
    return out

