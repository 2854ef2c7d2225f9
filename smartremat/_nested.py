"""Nested options: leave a block's own call alone and checkpoint its sub-blocks instead.

A transformer layer's coarse choices (all of it, or nothing) can all be too costly at a budget
where checkpointing only its attention, or only its MLP, fits. smartremat therefore offers, for
each block that calls sub-blocks of its own, every combination of menu policies on its (at most
`MAX_CHILDREN`, by forward FLOPs) sub-blocks as further options of that block. They are profiled
exactly like policies (the block's call with the sub-blocks wrapped), so the solver, the model
and the compiler treat them alike.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import jax

from ._apply import call_module, run
from ._cost import jaxpr_cost
from ._discover import BlockCall, Path, discover, path_str
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
    """Every combination of `menu` policies on the block's costliest sub-blocks (not all none)."""
    module = call.spec.rebuild(call.spec.dynamic)[0]
    try:
        inner = discover(module, call_module, call.spec, None)
    except (NotImplementedError, ValueError):  # sub-blocks smartremat cannot plan: no nested options
        return ()
    children = [c for c in inner if c.path != () and c.scan is None]
    if not children:
        return ()
    flops: dict[Path, float] = {}
    for c in children:
        cost = jaxpr_cost(jax.make_jaxpr(c.spec.function(call_module))(*c.spec.dynamic)).flops
        flops[c.path] = flops.get(c.path, 0) + cost
    top = sorted(flops, key=lambda p: -flops[p])[:MAX_CHILDREN]
    top = [p for p in top if flops[p] > 0]
    combos = itertools.product(menu, repeat=len(top))
    return tuple(Nested(tuple(zip(top, combo))) for combo in combos if any(p is not None for p in combo))
