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
from dataclasses import dataclass
from typing import Any


from ._apply import run
from ._profile import _residuals, n_module_leaves
from ._discover import BlockCall, Path, call_module, discover, path_str
from ._policies import policy_name
from ._render import short_name

MAX_CHILDREN = 2


@dataclass(frozen=True)
class Nested:
    """An option for a block: its sub-blocks at `children` (paths relative to the block) under
    their policies, the block itself not checkpointed. Called like the block's call."""

    children: tuple[tuple[Path, Any], ...]

    def __call__(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        return run(module, call_module, self.children, args, kwargs)

    @property
    def smartremat_name(self) -> str:
        inner = ",".join(f"{path_str(p)}={short_name(policy_name(pol))}" for p, pol in self.children)
        return f"nested({inner})"


def nested_options(call: BlockCall, menu: tuple) -> tuple[Nested, ...]:
    """Every combination of `menu` policies on the block's sub-blocks that keep the most for the
    backward (not all none)."""
    module = call.spec.rebuild(call.spec.dynamic)[0]
    try:
        inner = discover(module, call_module, call.spec, None)
    except (NotImplementedError, ValueError):  # sub-blocks smartremat cannot plan: no nested options
        return ()
    children = [c for c in inner if c.path != () and c.scan is None]
    if not children:
        return ()
    kept: dict[Path, int] = {}
    for c in children:
        internal, args, _ = _residuals(c.spec.function(call_module), c.spec, n_module_leaves(c.spec))
        kept[c.path] = kept.get(c.path, 0) + internal + args
    top = sorted(kept, key=lambda p: -kept[p])[:MAX_CHILDREN]
    top = [p for p in top if kept[p] > 0]
    combos = itertools.product(menu, repeat=len(top))
    return tuple(Nested(tuple(zip(top, combo))) for combo in combos if any(p is not None for p in combo))
