"""Mixed plans against the compiler: the quick tutorial stack (`benchmarks/run.py --quick`) with
its first k, or its last k, blocks under one policy and the others without remat, k = 0 to all;
the compiled training step's temp bytes beside smartremat's prediction of the same plan.

    python studies/mixed_plans.py [--model tutorial] [--policies dots full] [--random 12]

and `--random` plans with a random policy (or none) on each block, then the model error over all.

A block under remat early in the stack gives the compiler output buffers (its weight gradients,
written last) to keep later blocks' activations in (docs/facts.md, fact 12); the profile counts
that as kept bytes below zero.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (sets the CPU flag before JAX starts)
from benchmarks.strategies import UNIFORM, Ckpt, exact, figures

import equinox as eqx
import jax

import smartremat
from benchmarks.run import build
from smartremat.internal import peak_of

MB = smartremat.MB
MENU_NAME = {"dots": "dots_saveable", "dots_nb": "dots_with_no_batch_dims_saveable", "full": "nothing_saveable"}


def mixed(model: Any, where: Callable, layers: list[str | None]) -> Any:
    """`model` with block `i` under the policy `layers[i]` (a key of `MENU_NAME`), or without remat
    where it is `None`."""
    blocks = list(where(model))
    return eqx.tree_at(where, model, [Ckpt(b, UNIFORM[p]) if p else b for b, p in zip(blocks, layers)])


def _node(model: Any, path: str) -> Any:
    """The sub-module at a plan row's path, such as `layers[3]` or `blocks[0].conv`."""
    for attr, index in re.findall(r"(\w+)|\[(\d+)\]", path):
        model = getattr(model, attr) if attr else model[int(index)]
    return model


def _stage_blocks(plan: smartremat.Plan, model: Any, blocks: list) -> list[int | None]:
    """Per stage of the plan (one per block call, in call order, with `nested=False`), the index
    of its block among `blocks` (`None` for a block outside them: a stem, a head)."""
    assert len(plan.blocks) == len(plan.stages) and all(b.calls == 1 for b in plan.blocks), "one call per block"
    assert all(len(st.saved) == len(plan.menu) for st in plan.stages), "every policy of the menu on every block"
    out = []
    for row in plan.blocks:
        node = _node(model, row.path)
        out.append(next((i for i, b in enumerate(blocks) if b is node), None))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tutorial")
    ap.add_argument("--policies", nargs="*", default=["dots", "full"], choices=list(MENU_NAME))
    ap.add_argument("--random", type=int, default=12, help="plans with a random policy (or none) per block")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    case = build(args.model, "quick")
    n = len(list(case.where(case.model)))
    plan = smartremat.explain(smartremat.smartremat(budget_mb=1e6, verify=False, nested=False,
                                                    **exact(case.model, case.x))(case.model), case.x)
    menu = list(plan.menu)
    stage_of = _stage_blocks(plan, case.model, list(case.where(case.model)))
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; quick {args.model}, {n} blocks; "
          "compiled / predicted temp MB")
    row = plan.blocks[next(i for i, b in enumerate(stage_of) if b is not None)]
    print(f"the profile's kept bytes of {row.path}, MB: "
          + ", ".join(f"{o.name} {o.saved_bytes / MB:.3f}" for o in row.options))
    errors = []

    def compare(layers: list[str | None]) -> str:
        compiled = figures(mixed(case.model, case.where, layers), case.x)[0]
        choice = [menu.index(MENU_NAME[layers[b]]) if b is not None and layers[b] else 0 for b in stage_of]
        predicted = peak_of(plan.stages, choice) + plan.fixed_bytes
        errors.append(abs(predicted - compiled) / compiled)
        return f"{compiled / MB:7.3f} / {predicted / MB:7.3f}"

    for policy in args.policies:
        for k in range(n + 1):
            first = compare([policy if i < k else None for i in range(n)])
            last = compare([policy if i >= n - k else None for i in range(n)])
            print(f"{policy:>7} k={k}: first k {first}   last k {last}", flush=True)
    rng = random.Random(args.seed)
    for _ in range(args.random):
        layers = [rng.choice([None, *MENU_NAME]) for _ in range(n)]
        print(f"  random {' '.join(p or '-' for p in layers)}: {compare(layers)}", flush=True)
    print(f"model error |predicted - compiled| / compiled over these {len(errors)} plans: "
          f"median {statistics.median(errors):.3f}, max {max(errors):.3f}")


if __name__ == "__main__":
    main()
