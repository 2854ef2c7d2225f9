"""A stand-in for `einops.rearrange`, used only when `einops` is not installed.

The Equinox examples copied here (`unet.py`, `vit.py`) import `einops`, which is not a dependency
of this project. This implements just `rearrange` for patterns made of named axes and
parenthesised groups (no `...`, no anonymous or unit axes), which covers every pattern those
examples use; it is a plain reshape/transpose/reshape, as einops itself lowers to.
"""

from __future__ import annotations

import math

import jax.numpy as jnp


def _groups(side: str) -> list[list[str]]:
    groups, current = [], None
    for token in side.replace("(", " ( ").replace(")", " ) ").split():
        if token == "(":
            current = []
        elif token == ")":
            groups.append(current)
            current = None
        elif current is not None:
            current.append(token)
        else:
            groups.append([token])
    return groups


def rearrange(x, pattern: str, **sizes: int):
    lhs, rhs = (_groups(s) for s in pattern.split("->"))
    if len(lhs) != x.ndim:
        raise ValueError(f"rearrange: pattern {pattern!r} expects {len(lhs)} axes, got shape {x.shape}")
    known = dict(sizes)
    for group, dim in zip(lhs, x.shape):
        unknown = [n for n in group if n not in known]
        product = math.prod(known[n] for n in group if n in known)
        if len(unknown) > 1:
            raise ValueError(f"rearrange: cannot infer the sizes of {unknown} in {pattern!r}")
        if unknown:
            known[unknown[0]] = dim // product
        elif product != dim:
            raise ValueError(f"rearrange: axis sizes of {group} do not give {dim} in {pattern!r}")
    names = [n for group in lhs for n in group]
    x = jnp.reshape(x, [known[n] for n in names])
    x = jnp.transpose(x, [names.index(n) for group in rhs for n in group])
    return jnp.reshape(x, [math.prod(known[n] for n in group) for group in rhs])
