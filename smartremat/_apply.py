"""Apply a plan: run the forward with the planned sub-modules' calls checkpointed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from . import _intercept
from ._discover import Path


Assignment = tuple[tuple[Path, Any], ...]


def run(module: Any, call: Callable, assignment: Assignment, args: tuple, kwargs: dict,
        tags: dict[Path, str] | None = None) -> Any:
    """Call `call(module, *args, **kwargs)` with each `(path, policy)` of `assignment` applied.

    A policy of `None` leaves that block alone; the empty path means the module's own call.
    A `Segments` policy (a scanned block with different policies on pieces of its scan)
    splits that scan; a nested option (`_nested.Nested`) stands for its sub-blocks' entries.
    The module tree is never rewritten: the planned sub-modules' calls are routed through
    `jax.checkpoint` as they happen (`_intercept.routing`), so the forward sees its own
    sub-modules. `tags` names the calls of some paths (`jax.named_scope`) so that their
    equations can be found in the traced program.
    """
    from ._scan import Segments, run_pieces

    assignment = tuple((p, _single(pol) if isinstance(pol, Segments) else pol) for p, pol in assignment)
    if any(isinstance(pol, Segments) for _, pol in assignment):
        return run_pieces(module, call, assignment, args, kwargs, run)
    assignment = _expand_nested(assignment)
    own = [pol for path, pol in assignment if path == ()]
    tags = tags or {}
    entries = {p: pol for p, pol in assignment if p != () and pol is not None}
    entries.update({p: entries.get(p) for p in tags})
    if own and own[0] is not None:
        call = eqx.filter_checkpoint(call, policy=own[0])
    if not entries:
        return call(module, *args, **kwargs)
    paths = list(entries)

    def checkpointed(index: int, sub: Any, original: Callable, a: tuple, k: dict) -> Any:
        policy, tag = entries[paths[index]], tags.get(paths[index])
        fn = original if policy is None else eqx.filter_checkpoint(original, policy=policy)
        if tag is None:
            return fn(sub, *a, **k)
        with jax.named_scope(tag):
            return fn(sub, *a, **k)

    with _intercept.routing(module, paths, checkpointed):
        return call(module, *args, **kwargs)


def _single(segments: Any) -> Any:
    """A `Segments` whose pieces share one policy is just that policy."""
    pols = segments.policies()
    return pols[0] if len(pols) == 1 else segments


def _expand_nested(assignment: Assignment) -> Assignment:
    """`(path, Nested)` -> one `(path + child, policy)` per sub-block; the block itself left alone."""
    out = []
    for path, pol in assignment:
        children = getattr(pol, "children", None) if hasattr(pol, "smartremat_name") else None
        out += [(path + child, p) for child, p in children] if children is not None else [(path, pol)]
    return tuple(out)
