"""Run a scanned block with different policies on consecutive pieces of its scan.

One `jax.lax.scan` stacks the same residuals for every iteration, so a scan whose iterations
should use different policies must become several scans. The user's forward is traced once per
policy (the block's calls, inside the scan body that `eqx.combine(params, static)` rebuilds,
checkpointed and tagged with a `jax.named_scope`), then evaluated equation by equation, the marked
scan replaced by one `jax.lax.scan` per piece, its body traced under that piece's policy.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from . import _jax_private
from ._discover import subjaxprs
from ._search import Unbuildable
from ._spec import abstract, scatter


_TAG = "smartremat_scan_"


def run_pieces(module: Any, call: Callable, assignment: tuple, args: tuple, kwargs: dict,
               plain_run: Callable) -> Any:
    """`plain_run(module, call, assignment, args, kwargs)` with the scan of each entry that runs
    several options (a `Segments`) split into its pieces."""
    segs = [(i, path, pol) for i, (path, pol) in enumerate(assignment) if len(pol.variants) > 1]
    rounds = max(len(pol.variants) for _, _, pol in segs)
    leaves, treedef = jax.tree.flatten((module, args, kwargs))
    dyn_at = [i for i, x in enumerate(leaves) if eqx.is_array(x)]

    def forward(r: int) -> Callable:
        chosen = list(assignment)
        for i, path, pol in segs:
            chosen[i] = (path, pol.variants[min(r, len(pol.variants) - 1)])

        def f(*dyn: Any) -> Any:
            m, a, k = jax.tree.unflatten(treedef, scatter(leaves, dyn_at, dyn))
            tags = {path: f"{_TAG}{t}" for t, (_, path, _) in enumerate(segs)}
            return plain_run(m, call, tuple(chosen), a, k, tags)

        return f

    avals = [abstract(leaves[i]) for i in dyn_at]
    traced = [jax.make_jaxpr(forward(r), return_shape=True)(*avals) for r in range(rounds)]
    closed, out_shape = traced[0]
    targets = {}
    for t, (_, _, pol) in enumerate(segs):
        k = _find_scan(closed.jaxpr, t)
        bodies = [traced[pol.variants.index(p)][0].jaxpr for _, _, p in pol.pieces]
        targets[k] = [(a, b, _body_at(body, t, closed.jaxpr.eqns[k], closed.jaxpr))
                      for (a, b, _), body in zip(pol.pieces, bodies)]
    outs = _evaluate(closed, targets, [leaves[i] for i in dyn_at])
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _tagged(jaxpr: jcore.Jaxpr, tag: int) -> bool:
    pattern = re.compile(rf"{_TAG}{tag}(?!\d)")
    return any(pattern.search(str(getattr(eqn.source_info, "name_stack", "")))
               or any(_tagged(sub, tag) for sub in subjaxprs(eqn)) for eqn in jaxpr.eqns)


def _find_scan(jaxpr: jcore.Jaxpr, tag: int) -> int:
    for k, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name == "scan" and _tagged(eqn.params["jaxpr"].jaxpr, tag):
            return k
    raise RuntimeError(
        "smartremat planned a block as the body of a top-level `jax.lax.scan`, but the forward it "
        "now traces runs it elsewhere. The module's forward must trace the same way each time; "
        "plan again (call it with the same arguments), or report this with the module's code.")


def _addresses(jaxpr: jcore.Jaxpr) -> dict:
    """Where each variable of `jaxpr` comes from, in terms that agree between two traces of the
    same forward: an input or constant by position, an equation's output by `(equation, output)`."""
    where: dict = {v: ("in", i) for i, v in enumerate(jaxpr.invars)}
    where.update({v: ("const", i) for i, v in enumerate(jaxpr.constvars)})
    for k, eqn in enumerate(jaxpr.eqns):
        where.update({v: ("eqn", k, j) for j, v in enumerate(eqn.outvars)})
    return where


def _operand(where: dict, v: Any) -> Any:
    return ("literal", repr(v.val)) if isinstance(v, jcore.Literal) else where.get(v)


def _body_at(jaxpr: jcore.Jaxpr, tag: int, base: Any, base_jaxpr: jcore.Jaxpr) -> tuple[Any, list[int]]:
    """The marked scan of another policy's trace, and for each of its constants the index of the
    same value among `base`'s (a checkpointed body may close over the same values in another
    order); carried and scanned operands must be `base`'s, in order."""
    eqn: Any = jaxpr.eqns[_find_scan(jaxpr, tag)]
    nc = eqn.params["num_consts"]
    where, base_where = _addresses(jaxpr), _addresses(base_jaxpr)
    mine = [_operand(where, v) for v in eqn.invars]
    theirs = [_operand(base_where, v) for v in base.invars]
    nb = base.params["num_consts"]
    if mine[nc:] != theirs[nb:] or any(a is None or a not in theirs[:nb] for a in mine[:nc]):
        raise Unbuildable(
            "smartremat: the scan's operands differ between the policies of its pieces, so this "
            "candidate, which splits it, cannot be built")
    return eqn, [theirs[:nb].index(a) for a in mine[:nc]]


def _evaluate(closed: jcore.ClosedJaxpr, targets: dict, args: list) -> list:
    """Evaluate `closed` equation by equation, splitting the scans in `targets`."""
    env: dict = {**dict(zip(closed.jaxpr.constvars, closed.consts)), **dict(zip(closed.jaxpr.invars, args))}
    read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
    for k, eqn in enumerate(closed.jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        outs = _split_scan(eqn, targets[k], invals) if k in targets else _jax_private.bind_equation(eqn, invals)
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = o
    return [read(v) for v in closed.jaxpr.outvars]


def _split_scan(eqn: jcore.JaxprEqn, pieces: list, invals: list) -> list:
    """The scan `eqn` as one scan per `(start, stop, (body_eqn, const order))` piece, in the scan's
    order, each over its slice `xs[a:b]` of every scanned operand; their outputs concatenated."""
    p = eqn.params
    nc, ncar = p["num_consts"], p["num_carry"]
    consts, carry, xs = invals[:nc], list(invals[nc:nc + ncar]), invals[nc + ncar:]
    ys_of = {}
    for a, b, (body_eqn, order) in (reversed(pieces) if p["reverse"] else pieces):
        fn = jcore.jaxpr_as_fun(body_eqn.params["jaxpr"])
        mine = [consts[i] for i in order]

        def step(c: list, x: list, fn: Callable = fn, mine: list = mine) -> tuple[list, list]:
            out = fn(*mine, *c, *x)
            return list(out[:ncar]), list(out[ncar:])

        carry, ys_of[a] = jax.lax.scan(step, carry, [v[a:b] for v in xs], length=b - a,
                                       reverse=p["reverse"], unroll=p["unroll"])
    n_ys = len(eqn.outvars) - ncar
    ys = [jnp.concatenate([ys_of[a][j] for a, _, _ in pieces]) for j in range(n_ys)]
    return [*carry, *ys]
