"""The `Plan`: what smartremat chose for each block, with the figures behind the choice."""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from ._env import MB
from ._memory import Stage, cost_of, peak_of
from ._options import Option, assignment_to_json, short_name
from ._solve import frontier


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

    Peaks are the activation memory of one forward+backward through the module (docs: what the
    budget means). `predicted_*` figures are smartremat's model's; `compiled_peak_bytes` and
    `compiled_flops` the compiler's, when the plan was verified; `compiles` counts the whole-step
    compiles verification asked for (candidates times losses; those cached in this process cost
    nothing); `checked` holds, per candidate compiled, the predicted peak and the compiled temp
    bytes (the largest over the losses it was compiled under; a candidate the device refused is
    left out, and counted in `notes`); `timed` (with `tune=True`), per
    fitting candidate run, its compiled temp bytes, compiled FLOPs and median seconds per step,
    the default objective's candidate first.
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
            "budget_mb": self.budget_bytes / MB, "predicted_peak_mb": self.predicted_peak_bytes / MB,
            "compiled_peak_mb": None if self.compiled_peak_bytes is None else self.compiled_peak_bytes / MB,
            "no_remat_peak_mb": self.no_remat_peak_bytes / MB,
            "full_remat_peak_mb": self.full_remat_peak_bytes / MB,
            "min_peak_mb": self.min_peak_bytes / MB, "fixed_mb": self.fixed_bytes / MB,
            "recompute_flops": self.recompute_flops, "forward_flops": self.forward_flops,
            "compiled_flops": self.compiled_flops, "planning_s": self.planning_seconds,
            "compiles": self.compiles, "checked_mb": [[p / MB, c / MB] for p, c in self.checked],
            "timed": [[t / MB, f, s] for t, f, s in self.timed],
            "backend": self.backend, "notes": list(self.notes), "blocks": [b.to_dict() for b in self.blocks],
        }

    def save(self, path: str) -> None:
        """Write this plan as JSON; `smartremat.load_plan(path)` reads it back for `smartremat(plan=...)`."""
        with open(path, "w") as f:
            f.write(json.dumps(plan_data(self), indent=1))

    def frontier(self) -> list[tuple[float, int]]:
        """The exact memory/recompute Pareto frontier over all budgets, by smartremat's model.

        **Returns:**

        `(peak_mb, recompute_flops)` pairs sorted by peak: each is an optimal plan's predicted
        figures, computed by the same solver that chose this plan. A budget between two peaks
        buys the recompute of the lower one. On an accelerator "optimal" weighs the bytes a plan
        keeps in a scan as well as its FLOPs (docs/how-it-works.md, step 4), so a point of higher
        peak can recompute more.
        """
        if not self.stages:
            raise ValueError(
                "This plan was loaded from JSON (`smartremat.load_plan`) without the profile the frontier needs "
                "(its 'stages': a file written before `Plan.save` kept them). Call `smartremat.explain(model, *args)` "
                "to plan again and get the frontier, and save that plan.")
        return [((s.peak + self.fixed_bytes) / MB, cost_of(self.stages, s.choice)) for s in frontier(self.stages)]

    def uniform(self) -> dict[str, tuple[float, int]]:
        """`{policy name: (predicted peak_mb, recompute_flops)}` of each policy on every block
        (empty for a plan loaded from a file written before `Plan.save` kept the profile)."""
        choices = {name: (i,) * len(self.stages) for i, name in enumerate(self.menu)} if self.stages else {}
        return {name: ((peak_of(self.stages, c) + self.fixed_bytes) / MB, cost_of(self.stages, c))
                for name, c in choices.items()}

    def plot(self, path: str) -> None:
        """Draw the frontier, this plan, the budget line and the uniform plans to `path` (PNG, SVG, ...).

        Needs matplotlib (`pip install matplotlib`).
        """
        _plot(self, path)

    @property
    def policies(self) -> dict[str, str]:
        """`{block path: chosen policy name}`."""
        return {b.path: b.policy for b in self.blocks}

    def __str__(self) -> str:
        return _render(self)


def plan_data(plan: Plan) -> dict:
    """The JSON-ready dict of a saved plan, the one format `Plan.save` writes, `load_plan` reads
    and the disk cache keeps: the figures (`Plan.to_dict`), the signature, the assignment, and the
    profile the frontier needs (its stages and menu)."""
    return {**plan.to_dict(), "signature": plan.signature, "assignment": assignment_to_json(plan.assignment),
            "stages": [list(dataclasses.astuple(st)) for st in plan.stages], "menu": list(plan.menu)}


def _group(blocks: tuple[PlanBlock, ...]) -> list[tuple[str, PlanBlock, int]]:
    """Consecutive blocks whose rows read the same (`_shown`) as `path[a:b]  Type xN`."""
    out = []
    for _, run in itertools.groupby(blocks, key=_shown):
        first, *rest = run
        out.append((_range_label(first.path, rest[-1].path) if rest else first.path, first, 1 + len(rest)))
    return out


def _shown(b: PlanBlock) -> tuple:
    """What a block's row shows (its own peaks, not shown, may differ)."""
    figures = tuple((o.name, o.saved_bytes, o.recompute_flops, o.merged) for o in b.options)
    return b.type, b.policy, b.calls, figures


def _range_label(first: str, last: str) -> str:
    (base, bracket, a), (other, _, b) = first.rpartition("["), last.rpartition("[")
    if bracket and first.endswith("]") and base == other and a[:-1].isdigit() and b[:-1].isdigit():
        return f"{base}[{a[:-1]}:{int(b[:-1]) + 1}]"
    return f"{first} .. {last}"


def _render(plan: Plan) -> str:
    names = list(dict.fromkeys(o.name for b in plan.blocks for o in b.options))
    head = ["block", "type", "calls", "policy"] + [f"MB {short_name(n)}" for n in names] + ["recompute GFLOP"]
    rows = []
    for label, b, n in _group(plan.blocks):
        cells = [label, b.type + (f" x{n}" if n > 1 else ""), str(b.calls), b.policy]
        by_name = {o.name: o for o in b.options}
        for name in names:
            o = by_name.get(name) or next((x for x in b.options if name in x.merged), None)
            mark = "*" if o is not None and o is b.chosen else " "
            cells.append("-" if o is None else f"{max(o.saved_bytes, 0) * b.calls / MB:.2f}{mark}")
        cells.append(f"{b.chosen.recompute_flops * b.calls * n / 1e9:.3f}")
        rows.append(cells)
    return "\n".join([_table(head, rows), "", *_totals(plan), *_lending(plan)])


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(head), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def _totals(plan: Plan) -> list[str]:
    overhead = 100 * plan.recompute_flops / plan.forward_flops if plan.forward_flops else 0.0
    return [
        f"predicted peak  {plan.predicted_peak_bytes / MB:10.2f} MB   budget {plan.budget_bytes / MB:.2f} MB"
        + ("" if plan.compiled_peak_bytes is None
           else f"   compiled {plan.compiled_peak_bytes / MB:.2f} MB"),
        f"no remat        {plan.no_remat_peak_bytes / MB:10.2f} MB   full remat {plan.full_remat_peak_bytes / MB:.2f} MB"
        f"   lowest {plan.min_peak_bytes / MB:.2f} MB (the model's; the compiler decides fit)",
        f"recompute       {plan.recompute_flops / 1e9:10.3f} GFLOP ({overhead:.1f}% of the forward)",
        f"planned in      {plan.planning_seconds:10.2f} s on {plan.backend}, {plan.compiles} whole-step compiles   "
        "(* = chosen; MB kept for the backward)",
    ] + _timed_rows(plan) + [f"note: {n}" for n in plan.notes]


def _lending(plan: Plan) -> list[str]:
    """A note per option whose kept bytes the model counts below zero (shown as 0.00 in the table):
    the block keeps almost nothing, and its weight gradients' output buffers, written last in the
    backward, hold that many bytes of later blocks' activations (docs/facts.md, fact 12)."""
    lent = {}
    for label, b, _ in _group(plan.blocks):
        for o in b.options:
            if o.saved_bytes < 0:
                each = " each" if ":" in label.rsplit("[", 1)[-1] else ""  # a range of identical blocks
                lent.setdefault(o.name, []).append(f"{label} {-o.saved_bytes * b.calls / MB:.2f} MB{each}")
    return [f"note: under {short_name(name)} ({name}) the gradient buffers of these blocks hold later blocks' "
            f"activations, counted in the peak (shown as 0.00 kept): {', '.join(rows)}" for name, rows in lent.items()]


def _timed_rows(plan: Plan) -> list[str]:
    """With `tune=True`: each fitting candidate timed, the plan chosen without tuning first, the
    one applied marked."""
    if not plan.timed:
        return []
    applied = (plan.compiled_peak_bytes, plan.compiled_flops)
    chosen = next((i for i, (t, f, _) in enumerate(plan.timed) if (t, f) == applied), None)
    rows = [f"  {'untuned' if i == 0 else 'candidate':12s} {t / MB:10.2f} MB {f / 1e9:10.3f} GFLOP "
            f"{s * 1e3:10.2f} ms" + ("  <- chosen" if i == chosen else "")
            for i, (t, f, s) in enumerate(plan.timed)]
    return [f"tuned           {len(plan.timed)} fitting candidates timed (compiled temp, compiled FLOPs, median step):",
            *rows]


def _plot(plan: Plan, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            f"`Plan.plot({path!r})` needs matplotlib, which is not installed. Install it with "
            "`pip install matplotlib` (or `pip install 'smartremat[bench]'`), or read the figures "
            "from `plan.frontier()` instead.") from e
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    pts = plan.frontier()
    ax.step([p for p, _ in pts], [c / 1e9 for _, c in pts], "k.-", where="post", label="frontier (optimal plans, at their FLOPs)")
    for name, (peak, cost) in plan.uniform().items():
        ax.scatter(peak, cost / 1e9, marker="s", zorder=3)
        ax.annotate(short_name(name), (peak, cost / 1e9), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.scatter(plan.predicted_peak_bytes / MB, plan.recompute_flops / 1e9, s=80, c="red", zorder=4, label="this plan")
    ax.axvline(plan.budget_bytes / MB, color="red", ls="--", lw=1, label="budget")
    ax.set(xlabel="predicted peak (MB)", ylabel="recompute (GFLOP)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
