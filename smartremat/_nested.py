"""Nested options: leave a block's own call alone and checkpoint its sub-blocks instead.

A transformer layer's coarse choices (all of it, or nothing) can all be too costly at a budget
where checkpointing only its attention, or only its MLP, fits. smartremat therefore offers, for
each block that calls sub-blocks of its own, every combination of menu policies on its (at most
`MAX_CHILDREN`, by the bytes they keep for the backward without remat) sub-blocks as further options of that block. They are profiled
exactly like policies (the block's call with the sub-blocks wrapped), so the solver, the model
and the compiler treat them alike.
"""

from __future__ import annotations

import itertools

from ._options import NO_REMAT, Nested, Option
from ._profile import residuals, n_module_leaves
from ._discover import BlockCall, call_module, discover
from ._paths import Path

MAX_CHILDREN = 2


def nested_options(call: BlockCall, menu: tuple[Option, ...]) -> tuple[Nested, ...]:
    """Every combination of `menu` policies on the block's sub-blocks that keep the most for the
    backward (not all none)."""
    module = call.spec.rebuild(call.spec.dynamic)[0]
    try:
        inner = discover(module, call_module, call.spec, None)
    except (NotImplementedError, ValueError):  # sub-blocks smartremat cannot plan: no nested options
        return ()
    children = [c for c in inner if c.path != () and c.scan is None]
    if not children or any(c.unplanned for c in inner):
        return ()
    kept: dict[Path, int] = {}
    for c in children:
        internal, args, _ = residuals(c.spec.function(call_module), c.spec, n_module_leaves(c.spec))
        kept[c.path] = kept.get(c.path, 0) + internal + args
    top = sorted(kept, key=lambda p: -kept[p])[:MAX_CHILDREN]
    top = [p for p in top if kept[p] > 0]
    combos = itertools.product(menu, repeat=len(top))
    return tuple(Nested(tuple(zip(top, combo))) for combo in combos if any(p != NO_REMAT for p in combo))
