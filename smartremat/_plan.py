"""The `Plan`: what smartremat chose for each block, with the figures behind the choice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._options import Option
    from ._solve import Stage

MB = 2**20  #: smartremat's megabyte: `budget_mb=1` means 2**20 bytes.


@dataclass(frozen=True)
class PolicyFigures:
    """One option for one block: `saved_bytes` kept for the backward (below zero where the block's
    gradient buffers hold later blocks' activations), its own `peak_bytes`."""

    name: str
    saved_bytes: int
    peak_bytes: int
    recompute_flops: int
    merged: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"saved_mb": self.saved_bytes / MB, "peak_mb": self.peak_bytes / MB,
                "recompute_flops": self.recompute_flops, "merged": list(self.merged)}


@dataclass(frozen=True)
class PlanBlock:
    """One candidate block: where it is, how often it runs, and the policy chosen for it."""

    path: str
    type: str
    calls: int
    policy: str
    options: tuple[PolicyFigures, ...]

    @property
    def chosen(self) -> PolicyFigures:
        return next(o for o in self.options if o.name == self.policy or self.policy in o.merged)

    def to_dict(self) -> dict:
        return {
            "path": self.path, "type": self.type, "calls": self.calls, "policy": self.policy,
            "saved_mb": self.chosen.saved_bytes * self.calls / MB,
            "recompute_flops": self.chosen.recompute_flops * self.calls,
            "policies": {o.name: o.to_dict() for o in self.options},
        }


@dataclass(frozen=True)
class Plan:
    """An immutable remat plan for one module, input signature and budget.

    Peaks are the activation memory of one forward+backward through the module (see the
    docs: what the budget means). `predicted_*` figures come from smartremat's model;
    `compiled_peak_bytes` and `compiled_flops` from the compiler, when the plan was verified;
    `compiles` is how many whole-step compiles verification asked for (candidates times losses;
    those already cached in this process cost nothing); `checked` holds, per candidate plan it
    compiled, the model's predicted peak and the compiled temp bytes (the largest over the losses
    where it was compiled under all of them); `timed` (with `tune=True`) holds, per fitting
    candidate it ran, its compiled temp bytes, compiled FLOPs and median seconds per step, the
    fewest-FLOPs candidate first.
    """

    budget_bytes: int
    predicted_peak_bytes: int
    no_remat_peak_bytes: int
    full_remat_peak_bytes: int
    min_peak_bytes: int
    recompute_flops: int
    forward_flops: int
    blocks: tuple[PlanBlock, ...]
    compiled_peak_bytes: int | None = None
    compiled_flops: float | None = None
    fixed_bytes: int = 0
    planning_seconds: float = 0.0
    compiles: int = 0
    backend: str = ""
    notes: tuple[str, ...] = ()
    assignment: tuple[tuple[tuple[Any, ...], Option], ...] = field(default=(), compare=False, repr=False)
    stages: tuple[Stage, ...] = field(default=(), compare=False, repr=False)
    menu: tuple[str, ...] = field(default=(), compare=False, repr=False)
    signature: str = ""
    checked: tuple[tuple[int, int], ...] = ()
    timed: tuple[tuple[int, float, float], ...] = ()

    def to_dict(self) -> dict:
        """A JSON-serialisable dict (MB are 2**20 bytes)."""
        return {
            "budget_mb": self.budget_bytes / MB,
            "predicted_peak_mb": self.predicted_peak_bytes / MB,
            "compiled_peak_mb": None if self.compiled_peak_bytes is None else self.compiled_peak_bytes / MB,
            "no_remat_peak_mb": self.no_remat_peak_bytes / MB,
            "full_remat_peak_mb": self.full_remat_peak_bytes / MB,
            "min_peak_mb": self.min_peak_bytes / MB,
            "fixed_mb": self.fixed_bytes / MB,
            "recompute_flops": self.recompute_flops,
            "forward_flops": self.forward_flops,
            "compiled_flops": self.compiled_flops,
            "planning_s": self.planning_seconds,
            "compiles": self.compiles,
            "checked_mb": [[p / MB, c / MB] for p, c in self.checked],
            "timed": [[t / MB, f, s] for t, f, s in self.timed],
            "backend": self.backend,
            "notes": list(self.notes),
            "blocks": [b.to_dict() for b in self.blocks],
        }

    def save(self, path: str) -> None:
        """Write this plan as JSON; `smartremat.load_plan(path)` reads it back for `smartremat(plan=...)`."""
        from ._serialise import plan_to_json

        with open(path, "w") as f:
            f.write(plan_to_json(self))

    def frontier(self) -> list[tuple[float, int]]:
        """The exact memory/recompute Pareto frontier over all budgets, by smartremat's model.

        **Returns:**

        `(peak_mb, recompute_flops)` pairs sorted by peak: each is an optimal plan's predicted
        figures, computed by the same solver that chose this plan. A budget between two peaks
        buys the recompute of the lower one.
        """
        from ._solve import frontier

        if not self.stages:
            raise ValueError(
                "This plan was loaded from JSON (`smartremat.load_plan`), which does not keep the profile "
                "the frontier needs. Call `smartremat.explain(model, *args)` to plan again and get the frontier."
            )
        return [((s.peak + self.fixed_bytes) / MB, s.cost) for s in frontier(self.stages)]

    def uniform(self) -> dict[str, tuple[float, int]]:
        """`{policy name: (predicted peak_mb, recompute_flops)}` of each policy on every block
        (empty for a plan loaded from JSON, which keeps no profile)."""
        from ._memory import cost_of, peak_of

        out: dict[str, tuple[float, int]] = {}
        if not self.stages:
            return out
        n = len(self.stages)
        for i, name in enumerate(self.menu):
            choice = (i,) * n
            out[name] = ((peak_of(self.stages, choice) + self.fixed_bytes) / MB, cost_of(self.stages, choice))
        return out

    def plot(self, path: str) -> None:
        """Draw the frontier, this plan, the budget line and the uniform plans to `path` (PNG, SVG, ...).

        Needs matplotlib (`pip install matplotlib`).
        """
        from ._render import plot

        plot(self, path)

    @property
    def policies(self) -> dict[str, str]:
        """`{block path: chosen policy name}`."""
        return {b.path: b.policy for b in self.blocks}

    def __str__(self) -> str:
        from ._render import render

        return render(self)
