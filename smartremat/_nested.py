"""Nested options: leave a block's own call alone and checkpoint its sub-blocks instead.

A transformer layer's coarse choices (all of it, or nothing) can all be too costly at a budget
where checkpointing only its attention, or only its MLP, fits. So each block that calls sub-blocks
gets, as further options, every combination of menu policies on its `MAX_CHILDREN` sub-blocks that
keep the most bytes without remat, profiled like policies (the block's call, sub-blocks wrapped).
"""

from __future__ import annotations

import itertools

from ._options import NO_REMAT, Nested, Option
from ._profile import residuals, n_module_leaves
from ._discover import BlockCall, call_module, sub_calls
from ._paths import Path

MAX_CHILDREN = 2


def nested_options(call: BlockCall, menu: tuple[Option, ...]) -> tuple[Nested, ...]:
    """Every combination of `menu` policies on the block's sub-blocks that keep the most for the
    backward (not all none)."""
    children = [c for c in sub_calls(call) if c.scan is None]  # none where smartremat cannot plan them
    kept: dict[Path, int] = {}
    for c in children:
        internal, args, _ = residuals(c.spec.function(call_module), c.spec, n_module_leaves(c.spec))
        kept[c.path] = kept.get(c.path, 0) + internal + args
    top = [p for p in sorted(kept, key=lambda p: -kept[p])[:MAX_CHILDREN] if kept[p] > 0]
    combos = itertools.product(menu, repeat=len(top))
    return tuple(Nested(tuple(zip(top, combo))) for combo in combos if any(p != NO_REMAT for p in combo))
