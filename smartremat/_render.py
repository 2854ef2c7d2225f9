"""`str(plan)`: a table a person reads at a glance in a terminal."""

from __future__ import annotations

from ._plan import MB, Plan, PlanBlock


def _group(blocks: tuple[PlanBlock, ...]) -> list[tuple[str, PlanBlock, int]]:
    """Consecutive blocks whose rows read the same (type, policy, figures shown) as `path[a:b]  Type xN`."""
    out: list[tuple[str, PlanBlock, int]] = []
    i = 0
    while i < len(blocks):
        j = i + 1
        while j < len(blocks) and _same(blocks[i], blocks[j]):
            j += 1
        label = blocks[i].path if j == i + 1 else _range_label(blocks[i].path, blocks[j - 1].path, j - i)
        out.append((label, blocks[i], j - i))
        i = j
    return out


def _same(a: PlanBlock, b: PlanBlock) -> bool:
    """Whether two blocks' rows read the same: own peaks, which the table does not show, may differ
    (the block the loss is taken on has a larger one)."""
    def shown(p: PlanBlock) -> tuple:
        figures = tuple((o.name, o.saved_bytes, o.recompute_flops, o.merged) for o in p.options)
        return (p.type, p.policy, p.calls, figures)

    return shown(a) == shown(b)


def _range_label(first: str, last: str, n: int) -> str:
    if first.endswith("]") and "[" in first and first.rsplit("[", 1)[0] == last.rsplit("[", 1)[0]:
        base = first.rsplit("[", 1)[0]
        a, b = first.rsplit("[", 1)[1][:-1], last.rsplit("[", 1)[1][:-1]
        if a.isdigit() and b.isdigit():
            return f"{base}[{a}:{int(b) + 1}]"
    return f"{first} .. {last}"


def render(plan: Plan) -> str:
    names = []
    for b in plan.blocks:
        for o in b.options:
            if o.name not in names:
                names.append(o.name)
    short = {n: short_name(n) for n in names}
    head = ["block", "type", "calls", "policy"] + [f"MB {short[n]}" for n in names] + ["recompute GFLOP"]
    rows = []
    for label, b, n in _group(plan.blocks):
        cells = [label, b.type + (f" x{n}" if n > 1 else ""), str(b.calls), b.policy]
        by_name = {o.name: o for o in b.options}
        for name in names:
            o = by_name.get(name) or next((x for x in b.options if name in x.merged), None)
            mark = "*" if o is not None and o is b.chosen else " "
            cells.append("-" if o is None else f"{o.saved_bytes * b.calls / MB:.2f}{mark}")
        cells.append(f"{b.chosen.recompute_flops * b.calls * n / 1e9:.3f}")
        rows.append(cells)
    return "\n".join([_table(head, rows), "", *_totals(plan)])


def short_name(name: str) -> str:
    return {"dots_saveable": "dots", "dots_with_no_batch_dims_saveable": "dots_nb",
            "nothing_saveable": "full"}.get(name, name)


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(head), "  ".join("-" * w for w in widths), *map(fmt, rows)])


_LENDS = "; below zero where a block's gradient buffers hold later blocks' activations"


def _lends(plan: Plan) -> bool:
    """Whether a block's kept bytes are below zero (it lends its gradient buffers)."""
    return any(o.saved_bytes < 0 for b in plan.blocks for o in b.options)


def _totals(plan: Plan) -> list[str]:
    overhead = 100 * plan.recompute_flops / plan.forward_flops if plan.forward_flops else 0.0
    lines = [
        f"predicted peak  {plan.predicted_peak_bytes / MB:10.2f} MB   budget {plan.budget_bytes / MB:.2f} MB"
        + ("" if plan.compiled_peak_bytes is None
           else f"   compiled {plan.compiled_peak_bytes / MB:.2f} MB"),
        f"no remat        {plan.no_remat_peak_bytes / MB:10.2f} MB   full remat {plan.full_remat_peak_bytes / MB:.2f} MB"
        f"   lowest {plan.min_peak_bytes / MB:.2f} MB (the model's; the compiler decides fit)",
        f"recompute       {plan.recompute_flops / 1e9:10.3f} GFLOP ({overhead:.1f}% of the forward)",
        f"planned in      {plan.planning_seconds:10.2f} s on {plan.backend}, {plan.compiles} whole-step compiles   "
        "(* = chosen; MB kept for the backward" + (_LENDS if _lends(plan) else "") + ")",
    ]
    return lines + _timed_rows(plan) + [f"note: {n}" for n in plan.notes]


def _timed_rows(plan: Plan) -> list[str]:
    """With `tune=True`: each fitting candidate timed, the plan chosen without tuning first, the
    one applied marked (the lowest median is not always it: a switch needs a significant test)."""
    if not plan.timed:
        return []
    applied = (plan.compiled_peak_bytes, plan.compiled_flops)
    chosen = next((i for i, (t, f, _) in enumerate(plan.timed) if (t, f) == applied), None)
    rows = [f"  {'untuned' if i == 0 else 'candidate':12s} {t / MB:10.2f} MB {f / 1e9:10.3f} GFLOP "
            f"{s * 1e3:10.2f} ms" + ("  <- chosen" if i == chosen else "")
            for i, (t, f, s) in enumerate(plan.timed)]
    return [f"tuned           {len(plan.timed)} fitting candidates timed (compiled temp, compiled FLOPs, median step):",
            *rows]


def plot(plan: Plan, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            f"`Plan.plot({path!r})` needs matplotlib, which is not installed. Install it with "
            "`pip install matplotlib` (or `pip install 'smartremat[bench]'`), or read the figures "
            "from `plan.frontier()` instead."
        ) from e
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    pts = plan.frontier()
    ax.step([p for p, _ in pts], [c / 1e9 for _, c in pts], "k.-", where="post", label="frontier (optimal plans)")
    for name, (peak, cost) in plan.uniform().items():
        ax.scatter(peak, cost / 1e9, marker="s", zorder=3)
        ax.annotate(short_name(name), (peak, cost / 1e9), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.scatter(plan.predicted_peak_bytes / MB, plan.recompute_flops / 1e9, s=80, c="red", zorder=4, label="this plan")
    ax.axvline(plan.budget_bytes / MB, color="red", ls="--", lw=1, label="budget")
    ax.set_xlabel("predicted peak (MB)")
    ax.set_ylabel("recompute (GFLOP)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
