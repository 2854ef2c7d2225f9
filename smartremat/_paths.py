"""Where a sub-module sits in a module tree: a `Path` of `("attr", name)` / `("idx", key)` steps,
its text, and the value it reaches. A leaf: it imports nothing from the package."""

from __future__ import annotations

from typing import Any

Path = tuple[tuple[str, Any], ...]


def path_str(path: Path) -> str:
    """`(("attr", "blocks"), ("idx", 0))` -> `"blocks[0]"`; the empty path is `"<self>"`."""
    return "".join(f".{key}" if kind == "attr" else f"[{key!r}]" for kind, key in path).lstrip(".") or "<self>"


def get_at(tree: Any, path: Path) -> Any:
    for kind, key in path:
        tree = getattr(tree, key) if kind == "attr" else tree[key]
    return tree
