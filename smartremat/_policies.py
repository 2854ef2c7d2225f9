"""The menu of `jax.checkpoint` policies that smartremat chooses from."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from ._plan import MB

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


class PolicyError(ValueError):
    """A policy of `smartremat(policies=...)` raised when JAX called it."""


@dataclass(frozen=True)
class CheckedPolicy:
    """A user's policy on the menu: called like it, under the `name` shown in plans (unique in
    its menu), and any exception it raises becomes a `PolicyError` naming it. Equal policies
    and names give equal (and equally hashed) `CheckedPolicy`s, so caches keyed on the menu hit."""

    fn: Callable[..., Any]
    name: str
    option: str = field(default="smartremat", compare=False)

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> Any:
        try:
            return self.fn(prim, *avals, **params)
        except Exception as e:
            shapes = ", ".join(str(getattr(a, "str_short", lambda: a)()) for a in avals)
            raise PolicyError(
                f"`{self.option}(policies=...)` holds the policy {self.name!r} ({self.fn!r:.80}), which "
                f"raised {type(e).__name__}: {e} when JAX called it as `policy({prim}, {shapes}, **params)`. "
                "A `jax.checkpoint` policy is called with each primitive of the block, its input avals "
                "and its parameters, and returns whether to save that primitive's output (True) or "
                "recompute it (False), e.g. `lambda prim, *avals, **params: prim is jax.lax.dot_general_p`. "
                "Fix the policy, or remove it from `policies=`."
            ) from e


def policy_name(policy: Callable[..., bool] | None) -> str:
    """A stable, readable name for a policy (`"none"` for no remat)."""
    if policy is None:
        return NO_REMAT
    if isinstance(policy, CheckedPolicy):
        return policy.name
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


def normalise_policies(policies: Sequence[Any] | None, option: str = "smartremat") -> tuple[Any, ...]:
    """Validate `smartremat(policies=...)` and return the menu, with no remat first.

    No remat (`None`) is always on the menu: leaving a block alone is always possible. A policy
    other than JAX's own (`jax.checkpoint_policies`) is wrapped in a `CheckedPolicy`, under a name unique
    in the menu (plans tell options apart by name: a second `<lambda>` is shown as `<lambda>#2`).
    """
    if policies is None:
        return DEFAULT_POLICIES
    if callable(policies) or isinstance(policies, (str, bytes)) or not isinstance(policies, Sequence):
        raise TypeError(
            f"`{option}(policies=...)` should be a sequence of `jax.checkpoint` policies "
            f"(such as `[jax.checkpoint_policies.dots_saveable]`), not {policies!r}. "
            "To offer a single policy, wrap it in a list."
        )
    raw: list[Any] = [None]
    for p in policies:
        if p is not None and not callable(p):
            raise TypeError(
                f"`{option}(policies=...)` holds {p!r}, which is not a `jax.checkpoint` policy. "
                "Each entry should be a callable from `jax.checkpoint_policies` (e.g. "
                "`jax.checkpoint_policies.nothing_saveable`) or `None` for no remat."
            )
        if p is cp.save_anything_except_these_names:
            raise ValueError(
                f"`{option}(policies=...)` holds `save_anything_except_these_names` itself; "
                "call it with the names to exclude first, e.g. "
                "`save_anything_except_these_names('attn')`."
            )
        p = p.fn if isinstance(p, CheckedPolicy) else p
        if all(p is not q for q in raw):
            raw.append(p)
    builtin = lambda p: p is None or id(p) in _KNOWN_NAMES or _from_jax(p)
    names = {policy_name(p) for p in raw if builtin(p)}
    menu: list[Any] = []
    for p in raw:
        if builtin(p):
            menu.append(p)
            continue
        name = unique = policy_name(p)
        k = 1
        while unique in names:
            k += 1
            unique = f"{name}#{k}"
        names.add(unique)
        menu.append(CheckedPolicy(p, unique, option))
    return tuple(menu)


def _from_jax(policy: Any) -> bool:
    """One of JAX's own policies (e.g. from `jax.checkpoint_policies.save_only_these_names(...)`),
    which JAX may recognise by type: kept as it is."""
    return str(getattr(policy, "__module__", None) or "").split(".")[0] in ("jax", "jaxlib")


def no_policy_error(menu: tuple, budget_mb: float, floor: int, option: str = "smartremat") -> ValueError | None:
    """The error for a binding budget when `policies=` left no checkpoint policy on the menu (only
    no remat), which the budget is not to blame for; None when the menu has one."""
    if any(p is not None for p in menu):
        return None
    return ValueError(
        f"`{option}(policies=...)` offers no checkpoint policy: it received no policy but `None` (e.g. "
        f"`policies=[]`), so the menu is only no remat, whose peak, {floor / MB:.3f} MB, is above "
        f"`budget_mb={budget_mb:g}`. Add a policy to the menu, e.g. "
        "`policies=[jax.checkpoint_policies.nothing_saveable]` (or leave `policies=None` for the default "
        f"menu), or raise `budget_mb` to at least {math.ceil(floor / MB * 100) / 100:.2f}."
    )
