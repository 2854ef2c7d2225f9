"""The menu of `jax.checkpoint` policies that smartremat chooses from."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

cp = jax.checkpoint_policies

#: The name smartremat gives to "no `jax.checkpoint` at all" for a block.
NO_REMAT = "none"

DEFAULT_POLICIES: tuple[Any, ...] = (
    None,
    cp.dots_saveable,
    cp.dots_with_no_batch_dims_saveable,
    cp.nothing_saveable,
)

_KNOWN_NAMES = {
    id(cp.dots_saveable): "dots_saveable",
    id(cp.dots_with_no_batch_dims_saveable): "dots_with_no_batch_dims_saveable",
    id(cp.nothing_saveable): "nothing_saveable",
    id(cp.everything_saveable): "everything_saveable",
}


def policy_name(policy: Callable[..., bool] | None) -> str:
    """A stable, readable name for a policy (`"none"` for no remat)."""
    if policy is None:
        return NO_REMAT
    if hasattr(policy, "smartremat_name"):  # a nested option (smartremat._nested.Nested)
        return policy.smartremat_name
    if id(policy) in _KNOWN_NAMES:
        return _KNOWN_NAMES[id(policy)]
    for name in ("dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable"):
        try:
            if policy == getattr(cp, name):
                return name
        except Exception:  # a policy whose __eq__ raises is simply not one of ours
            pass
    return getattr(policy, "__name__", None) or repr(policy)


def normalise_policies(policies: Sequence[Any] | None) -> tuple[Any, ...]:
    """Validate `smartremat(policies=...)` and return the menu, with no remat first.

    No remat (`None`) is always on the menu: leaving a block alone is always possible.
    """
    if policies is None:
        return DEFAULT_POLICIES
    if callable(policies) or isinstance(policies, (str, bytes)) or not isinstance(policies, Sequence):
        raise TypeError(
            f"`smartremat(policies=...)` should be a sequence of `jax.checkpoint` policies "
            f"(such as `[jax.checkpoint_policies.dots_saveable]`), not {policies!r}. "
            "To offer a single policy, wrap it in a list."
        )
    menu: list[Any] = [None]
    for p in policies:
        if p is not None and not callable(p):
            raise TypeError(
                f"`smartremat(policies=...)` holds {p!r}, which is not a `jax.checkpoint` policy. "
                "Each entry should be a callable from `jax.checkpoint_policies` (e.g. "
                "`jax.checkpoint_policies.nothing_saveable`) or `None` for no remat."
            )
        if p is cp.save_anything_except_these_names:
            raise ValueError(
                "`smartremat(policies=...)` holds `save_anything_except_these_names` itself; "
                "call it with the names to exclude first, e.g. "
                "`save_anything_except_these_names('attn')`."
            )
        if all(p is not q for q in menu):
            menu.append(p)
    return tuple(menu)
