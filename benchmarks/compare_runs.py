"""Compare a quick benchmark run with the committed one: per model and objective, the budgets whose
temp MB, GFLOPs, policies, fit or predicted MB differ, and whether the fixed strategies' temp MB agree.

    python benchmarks/compare_runs.py /tmp/q3 [docs/benchmarks]

(`/tmp/q3` is the `--out` of `python benchmarks/run.py --quick --out /tmp/q3`.)
"""

from __future__ import annotations

import json
import pathlib
import sys

MODELS = ("tutorial_block", "tutorial", "gpt", "resnet")
FIELDS = (("temp_mb", 2), ("gflops", 3), ("predicted_mb", 2))


def same(a: dict, b: dict) -> bool:
    return (a["policies"] == b["policies"] and a["fits"] == b["fits"]
            and all(round(a[k], n) == round(b[k], n) for k, n in FIELDS))


def compare(new_dir: pathlib.Path, old_dir: pathlib.Path) -> list[str]:
    lines = []
    for name in MODELS:
        old = json.loads((old_dir / f"{name}.json").read_text())
        new = json.loads((new_dir / f"{name}.json").read_text())
        for key, label in (("smartremat", "default"), ("tuned", "tune=True")):
            diff = [round(a["budget_mb"], 2) for a, b in zip(old[key], new[key]) if not same(a, b)]
            fit = sum(r["fits"] for r in new[key]) / len(new[key])
            lines.append(f"{name} {label}: {len(new[key])} budgets, differing: {diff or 'none'}; fit {fit:.0%}")
        fixed = all(round(o["temp_mb"], 2) == round(new["fixed"][k]["temp_mb"], 2) for k, o in old["fixed"].items())
        lines.append(f"{name} fixed strategies' temp MB identical: {fixed}")
    return lines


if __name__ == "__main__":
    old = pathlib.Path(sys.argv[2] if len(sys.argv) > 2 else "docs/benchmarks")
    print("\n".join(compare(pathlib.Path(sys.argv[1]), old)))
