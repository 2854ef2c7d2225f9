"""The gradient standard: how a planned step's answers may differ from the plain step's
(`tree_mismatches`), for the tests (`tests/helpers.py`) and the benchmarks that check answers on an
accelerator (`benchmarks/accelerator_check.py`)."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")


#: `tree_mismatches`' relative tolerance for float32 leaves (about 8 ulps); other float dtypes scale it
#: by their machine epsilon relative to float32's (bfloat16: x65536, about 6.5e-2; float16: x8192).
MISMATCH_RTOL = 1e-6


def _tolerance(dtype: Any, rtol: float, compute: Any = None) -> float:
    """`rtol` in ulps of float32, as the same number of ulps of `dtype` (or of `compute`, the
    least precise dtype the values went through, where it is less precise)."""
    eps = max(float(jnp.finfo(d).eps) for d in (dtype, compute) if d is not None)
    return rtol * eps / float(jnp.finfo(jnp.float32).eps)


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def tree_mismatches(actual: Any, expected: Any, *, grads: tuple[Any, Any] | None = None,
                    rtol: float = MISMATCH_RTOL, compute_dtype: Any = None,
                    step_size: float | None = None) -> list[str]:
    """How `actual` differs from `expected` (e.g. a planned step's outputs from the plain step's),
    as human-readable lines; an empty list means equal.

    **The rule.** Remat recomputes the same operations, but XLA may fuse and order the recomputed
    ones differently, so float results may differ at rounding level, never more:

    1. *Exact where the answer is exact*: the same tree structure, and per leaf the same shape and
       dtype; integer, bool and non-array leaves (step counts, static fields) equal exactly.
    2. *Float leaves*: every entry within `rtol_d * max(max|actual|, max|expected|)` of the
       expected one, the scale taken per leaf; `rtol_d` is `rtol` (1e-6, about 8 float32 ulps) times
       the dtype's machine epsilon over float32's, so a bfloat16 or float16 leaf gets the same
       number of its own ulps. With `compute_dtype` (the least precise dtype the values were
       computed in, e.g. a float32 gradient of a model whose blocks compute in bfloat16: XLA may
       round such values at other points when it fuses a recomputed block differently), the
       ulps are that dtype's wherever it is less precise than the leaf's.
    3. *Zero up to rounding* (with `grads`): a gradient entry that is mathematically zero (a bias
       behind a normalisation, a softmax's shift) comes out as rounding noise of the terms summed
       for it, at the scale of the whole gradient, not of its leaf: a leaf made only of such
       entries has a largest entry near zero and a relative difference of order one. So in every
       subtree of the outputs that has the structure of the gradient (the gradient itself,
       optimizer moments, updates, new parameters: compared as `eqx.filter(..., is_inexact_array)`
       of the parameters is), an entry where both values are within `rtol_d` times that
       subtree's largest entry of zero is equal.
    4. *Derived from a zero* (with `grads`): Adam's first update is `lr * m / (sqrt(v) + eps)`,
       about `lr * sign(g)` for any `|g| >> eps`, so rounding noise on a gradient entry that is
       zero (rule 3) becomes an update anywhere in `[-lr, lr]`. At the positions where *both*
       gradients are zero up to rounding (rule 3 on `grads`), entries of the subtrees of rule 3 are
       only required to be finite (with `step_size`, to be within rule 5's two steps). A real
       difference is not hidden by this: it would make one of the two gradients non-zero there,
       which rule 3 then reports.
    5. *Parameters after a normalised step* (with `grads` and `step_size`, for trees of new
       parameters or updates only): Adam moves an entry by `lr * g / (|g| + eps)`, whose change
       for a change `dg` of the gradient entry is at most `lr * |dg| / |g|`. Rule 2 accepts on a
       gradient entry `dg` up to `rtol_d` times its leaf's scale, which is a large relative change
       for an entry much smaller than its leaf (a cancellation); so an entry here may differ by
       `step_size * min(2, 2 * rtol_d * scale(g leaf) / |g|)` (the 2: both moments carry it).
       Where both gradients are zero up to rounding (rule 4: judged on the gradient, at the whole
       gradient's scale), `|g|` is taken as 0: the entry may differ by `2 * step_size`, as two
       first Adam steps of at most `lr` each may. The leaf's own scale cannot judge there: a leaf
       made only of such entries (a bias right before a BatchNorm) is rounding noise throughout,
       and the step turns it into moves of `lr * g / (|g| + eps)` of any sign (issue 39: 1e-4 in
       float32, 3e-13 in float64). Compare moments and gradients without `step_size`: rules 2-4
       hold them tightly, so a real gradient difference is still reported there, and it makes
       the entry non-zero, so rule 5 holds the parameter to its own bound again.

    **Arguments:** `grads` is `(actual, expected)`: the two runs' gradients, or any trees
    proportional to them entry by entry (Adam's first moment after one step, SGD's momentum trace),
    in the structure of `eqx.filter(params, eqx.is_inexact_array)`; without it only rules 1-2 apply.
    `step_size` is the optimizer's learning rate, for rule 5.
    """
    if jax.tree.structure(actual) != jax.tree.structure(expected):
        return [f"tree structure differs:\n  actual   {jax.tree.structure(actual)}\n  expected {jax.tree.structure(expected)}"]
    shape = zero = None
    tol = lambda dtype: _tolerance(dtype, rtol, compute_dtype)  # noqa: E731
    if grads is not None:
        ga, ge = (eqx.filter(g, eqx.is_inexact_array) for g in grads)
        shape = jax.tree.structure(ge)
        scale = _tree_scale(ge)
        zero = _leafwise(lambda a, e: _zero_entries(a, e, scale, tol), ga, ge)
        if step_size is not None:  # rule 5: the step an entry may differ by, per position
            zero = _leafwise(lambda a, e, z: _step_tolerance(a, e, z, tol, step_size), ga, ge, zero)
    out: list[str] = []
    _compare(actual, expected, "", shape, zero, tol, out)
    return out


#: Bytes of the host's memory one leaf's comparison may take per entry: a few float64 copies.
_BYTES_PER_ENTRY = 64


def _free_memory() -> int:
    """Bytes of the host's memory available now (Linux's `MemAvailable`), or all of it where the
    system does not say: the runs a benchmark keeps for comparison hold much of it already."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _parallel(fn: Callable[..., T], items: Iterable[tuple]) -> list[T]:
    """`[fn(*item) for item in items]`, leaves in threads (NumPy releases the GIL): a model of
    hundreds of millions of parameters is compared in seconds, not minutes. As many threads as
    half the host's free memory holds comparisons of the largest leaf (on a TPU host, 13 threads
    on a scanned model's stacked leaves ran its 40 GiB out): the free memory, not all of it, as
    the runs a check keeps for comparison hold gigabytes already."""
    items = list(items)
    largest = max((x.size for item in items for x in item if hasattr(x, "size")), default=1)
    workers = int(min(os.cpu_count() or 1, max(1, _free_memory() // 2 // (_BYTES_PER_ENTRY * max(largest, 1)))))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda item: fn(*item), items))


def _leafwise(fn: Callable, tree: Any, *rest: Any) -> Any:
    """`jax.tree.map(fn, tree, *rest)`, the leaves in threads."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, _parallel(fn, zip(leaves, *(treedef.flatten_up_to(r) for r in rest))))


def _tree_scale(tree: Any) -> float:
    scales = _parallel(lambda x: float(np.max(np.abs(np.asarray(x, np.float64)))),
                       [(x,) for x in jax.tree.leaves(tree) if _is_float(x) and x.size])
    return max(scales, default=0.0)


def _step_tolerance(a: Any, e: Any, zero: np.ndarray, tol: Any, step: float) -> np.ndarray:
    """Rule 5: `step * min(2, 2 * rtol_d * scale / |g|)` per entry of a gradient leaf, and `2 * step`
    where both gradients are `zero` up to rounding (rule 4: `|g|` taken as 0)."""
    g = np.minimum(np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(e, np.float64)))
    scale = float(np.max(np.abs(np.asarray(e, np.float64)), initial=0.0))
    with np.errstate(divide="ignore", invalid="ignore"):  # 0 / 0 (a leaf of zeros): NaN, within no step
        return np.where(zero, 2 * step, step * np.minimum(2.0, 2 * tol(e.dtype) * scale / g))


def _zero_entries(a: Any, e: Any, scale: float, tol: Any) -> np.ndarray:
    """Where both values are zero up to rounding, relative to `scale` (rule 3); `tol(dtype)` is
    the relative tolerance."""
    tol = tol(e.dtype) * scale
    return (np.abs(np.asarray(a, np.float64)) <= tol) & (np.abs(np.asarray(e, np.float64)) <= tol)


def _compare(a: Any, e: Any, where: str, shape: Any, zero: Any, tol: Any, out: list[str]) -> None:
    """Walk `a` and `e` (same structure); subtrees shaped like the gradient go to `_compare_group`."""
    if shape is not None and shape.num_leaves > 0:
        fa, fe = eqx.filter(a, eqx.is_inexact_array), eqx.filter(e, eqx.is_inexact_array)
        if jax.tree.structure(fe) == shape and jax.tree.structure(fa) == shape:
            _compare_group(fa, fe, where, zero, tol, out)
            rest_a = jax.tree.leaves(eqx.filter(a, eqx.is_inexact_array, inverse=True))
            rest_e = jax.tree.leaves(eqx.filter(e, eqx.is_inexact_array, inverse=True))
            for x, y in zip(rest_a, rest_e):  # the same structure: the same non-float leaves
                _compare_leaf(x, y, where, tol, None, out)
            return
    children_a = _children(a)
    if children_a is None:
        _compare_leaf(a, e, where, tol, None, out)
        return
    for (path, ca), (_, ce) in zip(children_a, _children(e)):
        _compare(ca, ce, where + path, shape, zero, tol, out)


def _children(tree: Any) -> list[tuple[str, Any]] | None:
    """`(path suffix, child)` one level down, or None for a leaf."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)
    if len(flat) == 1 and flat[0][0] == ():
        return None
    return [(jax.tree_util.keystr(p), c) for p, c in flat]


def _compare_group(a: Any, e: Any, where: str, zero: Any, tol: Any, out: list[str]) -> None:
    """Rules 2-4 on a subtree shaped like the gradient."""
    scale = _tree_scale(e)
    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]

    def one(path: Any, x: Any, y: Any, z: np.ndarray) -> list[str]:
        ok = _zero_entries(x, y, scale, tol)
        finite = np.isfinite(np.asarray(x, np.float64))
        if z.dtype == bool:  # rule 4
            derived = z & finite
        else:  # rule 5: z is the difference allowed per entry
            with np.errstate(invalid="ignore"):  # inf - inf: not within any step
                derived = finite & (np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)) <= z)
        lines: list[str] = []
        _compare_leaf(x, y, where + jax.tree_util.keystr(path), tol, ok | derived, lines)
        return lines

    items = [(path, x, y, z) for (path, x), y, z in zip(flat_a, jax.tree.leaves(e), jax.tree.leaves(zero))]
    for lines in _parallel(one, items):
        out.extend(lines)


def _compare_leaf(a: Any, e: Any, where: str, tol: Any, exempt: np.ndarray | None, out: list[str]) -> None:
    """Rules 1-2 on one leaf; `exempt` entries (rules 3-4) pass."""
    where = where or "(root)"
    if not (hasattr(a, "dtype") and hasattr(e, "dtype")):
        if not (a is e or a == e):
            out.append(f"{where}: {a!r} != {e!r}")
        return
    x, y = np.asarray(a), np.asarray(e)
    if x.shape != y.shape or x.dtype != y.dtype:
        out.append(f"{where}: {x.dtype}{list(x.shape)} != {y.dtype}{list(y.shape)}")
        return
    if not _is_float(y):
        if not np.array_equal(x, y):
            out.append(f"{where}: {int(np.sum(x != y))} of {x.size} entries differ (exact dtype {y.dtype})")
        return
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    finite = lambda v: np.abs(v[np.isfinite(v)])  # noqa: E731  # a NaN entry is reported, not a scale
    scale = max(float(np.max(finite(x64), initial=0.0)), float(np.max(finite(y64), initial=0.0)))
    with np.errstate(invalid="ignore"):  # inf - inf
        diff = np.abs(x64 - y64)
    bad = ~((diff <= tol(y.dtype) * scale) | (x64 == y64) | (np.isnan(x64) & np.isnan(y64)))
    if exempt is not None:
        bad &= ~exempt
    if np.any(bad):
        i = np.unravel_index(int(np.argmax(np.where(bad, diff, -1))), x.shape) if x.shape else ()
        out.append(f"{where}: {int(np.sum(bad))} of {x.size} entries differ beyond {tol(y.dtype):.1e} "
                   f"x {scale:.3g} ({y.dtype}); worst at {tuple(int(k) for k in i)}: {float(x64[i]):.9g} vs "
                   f"{float(y64[i]):.9g}")
