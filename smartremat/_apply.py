"""Apply a plan: rewrite the module tree with checkpoint wrappers, then call it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx

from ._discover import Path, Wrapper, get_at, replace_at


def call_module(module: Any, *args: Any, **kwargs: Any) -> Any:
    """`module(*args, **kwargs)`: a named function, so checkpoints of it compare equal."""
    return module(*args, **kwargs)


class Checkpointed(Wrapper):
    """A sub-module whose call runs under `eqx.filter_checkpoint(policy=...)`.

    Only ever built inside the forward, so the user's model and its gradient pytree keep
    their structure (design.md fact 10).
    """

    module: Any
    policy: Any = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return eqx.filter_checkpoint(call_module, policy=self.policy)(self.module, *args, **kwargs)


Assignment = tuple[tuple[Path, Any], ...]


def run(module: Any, call: Callable, assignment: Assignment, args: tuple, kwargs: dict) -> Any:
    """Call `call(module, *args, **kwargs)` with each `(path, policy)` of `assignment` applied.

    A policy of `None` leaves that block alone; the empty path means the module's own call.
    A `Segments` policy (a scanned block with different policies on pieces of its scan)
    splits that scan; a nested option (`_nested.Nested`) stands for its sub-blocks' entries.
    """
    from ._scan import Segments, run_pieces

    assignment = tuple((p, _single(pol) if isinstance(pol, Segments) else pol) for p, pol in assignment)
    if any(isinstance(pol, Segments) for _, pol in assignment):
        return run_pieces(module, call, assignment, args, kwargs, run)
    assignment = _expand_nested(assignment)
    own = [pol for path, pol in assignment if path == ()]
    paths = [p for p, pol in assignment if p != () and pol is not None]
    pols = [pol for p, pol in assignment if p != () and pol is not None]
    rewritten = replace_at(module, paths, [Checkpointed(get_at(module, p), pol) for p, pol in zip(paths, pols)])
    if own and own[0] is not None:
        return eqx.filter_checkpoint(call, policy=own[0])(rewritten, *args, **kwargs)
    return call(rewritten, *args, **kwargs)


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
