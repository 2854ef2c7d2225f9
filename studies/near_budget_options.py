"""Which options a plan needs calibrated: the calibrated plan's against the uncalibrated plan's.

    python studies/near_budget_options.py [--models tutorial_stack transformer transformer_large]

Issue 39's first lever is to calibrate (compile copies of a block under) only the options the plan
near the budget uses, instead of every option of the menu. The simplest rule: plan without
calibration (`calibrate=False`: every option's figures from the jaxpr), then calibrate no remat,
full remat and the options that plan uses. For each model and budget of `benchmarks/fit_report.py`
(its five budgets between full and no remat but no remat's own, the decorator on the model,
verified on its loss) this
prints the options of both plans, whether the calibrated plan's options are among the rule's, and
the share of the menu the rule would calibrate. Where they are not, the rule would change the plan
(its figures for the missing option would stay the jaxpr's).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (sets the CPU flag before JAX starts)

import argparse
from typing import Any

import numpy as np

import smartremat
from benchmarks.fit_report import models
from benchmarks.strategies import UNIFORM, exact, figures, strategy

MB = smartremat.MB
FULL, NONE = "nothing_saveable", "none"


def options_of(model: Any, x: Any, budget: float, calibrate: bool) -> tuple[set[str], set[str]]:
    """`(the plan's options, every option planning weighed)` at `budget` bytes."""
    smartremat.clear_caches()
    wrapped = smartremat.smartremat(budget_mb=budget / MB, calibrate=calibrate, **exact(model, x))(model)
    plan = smartremat.explain(wrapped, x)
    return {b.policy for b in plan.blocks}, {o.name for b in plan.blocks for o in b.options}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--models", nargs="+", default=["tutorial_stack", "transformer", "transformer_large"])
    args = ap.parse_args()
    found = models()
    held = total = 0
    for name in args.models:
        model, x, where = found[name]
        unif = {n: figures(strategy(model, n, where), x)[0] for n in UNIFORM}
        lo, hi = sorted((unif["none"], unif["full"]))
        for budget in np.linspace(hi, lo, 5)[1:]:  # the first is no remat's own bytes
            try:
                calibrated, menu = options_of(model, x, budget, True)
                raw, _ = options_of(model, x, budget, False)
            except ValueError as e:  # an infeasible budget: both say so
                print(f"{name:>18} {budget / MB:9.2f} MB: {str(e).splitlines()[0][:100]}", flush=True)
                continue
            rule = raw | {NONE, FULL}
            ok = calibrated <= rule
            held, total = held + ok, total + 1
            print(f"{name:>18} {budget / MB:9.2f} MB: calibrated plan {sorted(calibrated)}; uncalibrated "
                  f"{sorted(raw)}; within the rule's: {ok}; the rule calibrates {len(rule & menu)} of "
                  f"{len(menu)} options", flush=True)
    print(f"the calibrated plan's options within the rule's at {held} of {total} budgets")


if __name__ == "__main__":
    main()
