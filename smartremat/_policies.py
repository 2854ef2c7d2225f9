"""The menu of `jax.checkpoint` policies that smartremat chooses from."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from ._options import NO_REMAT, NoRemat, Option, Policy
from ._env import MB

cp = jax.checkpoint_policies


def _raw_name(policy: Callable[..., bool]) -> str:
    """A stable, readable name for a policy callable (JAX's own, or an equal copy, by their name)."""
    if policy is cp.everything_saveable:
        return "everything_saveable"
    for name in ("dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable"):
        with contextlib.suppress(Exception):  # a policy whose __eq__ raises is simply not one of ours
            if policy is getattr(cp, name) or policy == getattr(cp, name):
                return name
    return getattr(policy, "__name__", None) or repr(policy)


def normalise_policies(policies: Sequence[Any] | None, option: str = "smartremat") -> tuple[Option, ...]:
    """Validate `smartremat(policies=...)` and return the menu of options (`_menu`), no remat first:
    leaving a block alone is always possible."""
    if policies is None:
        return DEFAULT_MENU
    if callable(policies) or isinstance(policies, (str, bytes)) or not isinstance(policies, Sequence):
        raise TypeError(f"`{option}(policies=...)` should be a sequence of `jax.checkpoint` policies (such "
                        f"as `[jax.checkpoint_policies.dots_saveable]`), not {policies!r}. To offer a single "
                        "policy, wrap it in a list.")
    raw: list[Any] = []
    for p in policies:
        p = p.fn if isinstance(p, Policy) else None if isinstance(p, NoRemat) else p
        _check_policy(p, option)
        if p is not None and all(p is not q for q in raw):
            raw.append(p)
    return _menu(raw, option)


def _check_policy(p: Any, option: str) -> None:
    if p is not None and not callable(p):
        raise TypeError(f"`{option}(policies=...)` holds {p!r}, which is not a `jax.checkpoint` policy. Each "
                        "entry should be a callable from `jax.checkpoint_policies` (e.g. "
                        "`jax.checkpoint_policies.nothing_saveable`) or `None` for no remat.")
    itself = p is cp.save_anything_except_these_names
    made_by = getattr(p, "__qualname__", "").startswith("save_anything_except_these_names.")
    if itself and not _ignores_names():
        raise ValueError(f"`{option}(policies=...)` holds `save_anything_except_these_names` itself; call it "
                         "with the names to exclude first, e.g. `save_anything_except_these_names('attn')`.")
    if (itself or made_by) and _ignores_names():
        raise ValueError(f"`{option}(policies=...)` holds `save_anything_except_these_names`, which in jax "
                         f"{jax.__version__} ignores the names it is given and saves everything: the same as "
                         "no remat, which is always on the menu. To save every named value but some, use "
                         "`jax.checkpoint_policies.save_any_names_but_these('attn', ...)`; to save only "
                         "some, `save_only_these_names(...)`.")


def _ignores_names() -> bool:
    """Whether this JAX's `save_anything_except_these_names(name)` saves a value named `name`."""
    eqn = jax.make_jaxpr(lambda x: checkpoint_name(x, "excluded"))(1.0).eqns[0]
    policy = cp.save_anything_except_these_names("excluded")
    return bool(policy(eqn.primitive, *(v.aval for v in eqn.invars), **eqn.params))


def _menu(raw: Sequence[Callable[..., Any]], option: str = "smartremat") -> tuple[Option, ...]:
    """No remat, then an option per distinct policy: JAX's own (e.g. from
    `jax.checkpoint_policies.save_only_these_names(...)`, which JAX may recognise by type) handed to
    JAX as they are, a user's checked (its errors name it); each under a name unique in the menu, so
    that a plan's rows tell them apart (JAX's own named first)."""
    builtin = [str(getattr(p, "__module__", None) or "").split(".")[0] in ("jax", "jaxlib") for p in raw]
    names: dict[int, str] = {}
    taken = {NO_REMAT.name}
    for i in sorted(range(len(raw)), key=lambda i: not builtin[i]):
        name, k = _raw_name(raw[i]), 1
        names[i] = name
        while names[i] in taken:  # a second `<lambda>` is `<lambda>#2`
            k += 1
            names[i] = f"{name}#{k}"
        taken.add(names[i])
    return (NO_REMAT,) + tuple(Policy(p, names[i], checked=not builtin[i], argument=option)
                               for i, p in enumerate(raw))


def no_policy_error(menu: tuple, budget_mb: float, floor: int, option: str = "smartremat") -> ValueError | None:
    """The error for a binding budget when `policies=` left no checkpoint policy on the menu (only
    no remat), which the budget is not to blame for; None when the menu has one."""
    if any(p != NO_REMAT for p in menu):
        return None
    return ValueError(
        f"`{option}(policies=...)` offers no checkpoint policy: it received no policy but `None` (e.g. "
        f"`policies=[]`), so the menu is only no remat, whose peak, {floor / MB:.3f} MB, is above "
        f"`budget_mb={budget_mb:g}`. Add a policy to the menu, e.g. "
        "`policies=[jax.checkpoint_policies.nothing_saveable]` (or leave `policies=None` for the default "
        f"menu), or raise `budget_mb` to at least {math.ceil(floor / MB * 100) / 100:.2f}."
    )


#: The menu of `policies=None`: no remat, then JAX's `dots_saveable`,
#: `dots_with_no_batch_dims_saveable` and `nothing_saveable`.
DEFAULT_MENU: tuple[Option, ...] = _menu([cp.dots_saveable, cp.dots_with_no_batch_dims_saveable,
                                          cp.nothing_saveable])

#: Full remat: JAX's `nothing_saveable` on a block.
FULL_REMAT: Option = DEFAULT_MENU[-1]
