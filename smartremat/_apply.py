"""Apply a plan: run the forward with the planned sub-modules' calls checkpointed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from . import _intercept
from ._discover import Path
from ._options import NO_REMAT, Entry, Option, expand


Assignment = tuple[Entry, ...]


def run(module: Any, call: Callable, assignment: Assignment, args: tuple, kwargs: dict,
        tags: dict[Path, str] | None = None) -> Any:
    """Call `call(module, *args, **kwargs)` with each `(path, option)` of `assignment` applied.

    No remat leaves that block alone; the empty path means the module's own call. A `Segments`
    option (a scanned block with different options on pieces of its scan) splits that scan; a
    nested option stands for its sub-blocks' entries (`Option.expand`). The module tree is never
    rewritten: the planned sub-modules' calls are routed through their options as they happen
    (`_intercept.routing`), so the forward sees its own sub-modules. `tags` names the calls of
    some paths (`jax.named_scope`) so that their equations can be found in the traced program.
    """
    from ._scan import run_pieces

    if any(len(option.variants) > 1 for _, option in assignment):
        return run_pieces(module, call, assignment, args, kwargs, run)
    assignment = expand(tuple((p, option.variants[0]) for p, option in assignment))
    own = [option for path, option in assignment if path == ()]
    tags = tags or {}
    entries: dict[Path, Option] = {p: option for p, option in assignment if p != () and option != NO_REMAT}
    entries.update({p: entries.get(p, NO_REMAT) for p in tags})
    if own:
        call = own[0].apply(call)
    if not entries:
        return call(module, *args, **kwargs)
    paths = list(entries)

    def checkpointed(index: int, sub: Any, original: Callable, a: tuple, k: dict) -> Any:
        fn, tag = entries[paths[index]].apply(original), tags.get(paths[index])
        if tag is None:
            return fn(sub, *a, **k)
        with jax.named_scope(tag):
            return fn(sub, *a, **k)

    with _intercept.routing(module, paths, checkpointed):
        return call(module, *args, **kwargs)
