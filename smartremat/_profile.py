"""Profile a block under each policy: bytes kept for the backward, its own peak, recompute cost.

Everything here runs on abstract values (`jax.make_jaxpr`, `jax.eval_shape`, and, when
calibrating, `jit(...).lower(ShapeDtypeStruct...).compile()`): no device memory is used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from ._cache import KeyedCache
from ._env import environment_key, measuring_options, profiling_options
from ._jax_private import carrying_config
from ._memory import raised_peaks
from ._cost import Cost, aval_bytes, floating_leaves, function_cost
from ._options import NO_REMAT, Option, PolicyError
from ._refused import Refused, compile_or_refuse
from ._spec import CallSpec, scatter


@dataclass(frozen=True)
class PolicyProfile:
    """One block under one option. Bytes are for the whole call (the whole batch under vmap).
    `saved_bytes` are kept from the block's forward until its backward: below zero where its
    gradients' output buffers, written last, hold the activations of later blocks."""

    option: Option  # `NO_REMAT`, a policy, a nested option
    saved_bytes: int
    peak_bytes: int  # the block's own peak during its forward and backward, its kept bytes included
    residual_bytes: int  # the jaxpr-level residual count (before any calibration)
    recompute: Cost  # FLOPs and bytes that the backward recomputes (zero for no remat)
    merged: tuple[Option, ...] = ()  # options of the menu that save the same residuals, merged into this

    @property
    def name(self) -> str:
        return self.option.name

    def stands_for(self, option: Option) -> bool:
        """Whether `option` is this one or was merged into it."""
        return option == self.option or option in self.merged


@dataclass(frozen=True)
class BlockProfile:
    """A distinct block (structure and input signature): its forward cost and its options."""

    forward: Cost
    options: tuple[PolicyProfile, ...]
    skipped: tuple[tuple[str, str], ...] = ()  # (option, why) of options that failed for this block


class _Measured(NamedTuple):
    """One option's figures while profiling: residuals, recompute, the function measured, and the
    options merged into it (they save the same residuals)."""

    option: Option
    internal: int
    args: int
    recompute: Cost
    f: Callable
    merged: list[Option]


def _is_float(d: jax.ShapeDtypeStruct) -> bool:
    return jnp.issubdtype(d.dtype, jnp.inexact)


def _loss(out: Any, each: Callable[[jax.Array], jax.Array] = jnp.sum) -> jax.Array:
    """The sum over the floating outputs, in float32, of `each` (by default their sum)."""
    floats = [x.astype(jnp.float32) for x in floating_leaves(out)]
    return sum((each(x) for x in floats), jnp.float32(0))


def _square_loss(out: Any) -> jax.Array:
    return _loss(out, lambda x: jnp.mean(jnp.square(x)))


def split_diff(f: Callable, spec: CallSpec, first_n: int | None = None) -> tuple[list[int], Callable]:
    """`(diff_idx, g)` with `g(diff_leaves, all_leaves)` calling `f` with `diff` substituted."""
    n = len(spec.dynamic) if first_n is None else first_n
    diff_idx = [i for i, d in enumerate(spec.dynamic[:n]) if _is_float(d)]

    def g(diff: Sequence[Any], dyn: Sequence[Any]) -> Any:
        return f(*scatter(dyn, diff_idx, diff))

    return diff_idx, g


def grad_step(f: Callable, avals: Sequence[Any], loss: Callable = _loss) -> Callable:
    """`step(*avals)`: gradient of `loss` of the floating outputs of `f` (their sum by default)
    w.r.t. its floating inputs. It profiles a block (or a chain of its copies) on its own: a
    constant cotangent is enough to compare options; plans are verified on real losses
    (`_verify.loss_step`)."""
    diff_idx = [i for i, d in enumerate(avals) if _is_float(d)]

    def step(*leaves: Any) -> Any:
        return jax.grad(lambda d: loss(f(*scatter(leaves, diff_idx, d))))([leaves[i] for i in diff_idx])

    return step


def residuals(f: Callable, spec: CallSpec, n_module: int) -> tuple[int, int, tuple]:
    """(internal residual bytes, saved-argument bytes, signature) of `f`'s VJP."""
    diff_idx, g = split_diff(f, spec)

    def res(*dyn: Any) -> Callable:
        return jax.vjp(lambda *d: g(d, dyn), *[dyn[i] for i in diff_idx])[1]

    closed = jax.make_jaxpr(res)(*spec.dynamic)
    invars = {v: i for i, v in enumerate(closed.jaxpr.invars)}
    consts = set(closed.jaxpr.constvars)
    internal, args, sig, seen = 0, 0, [], set()
    for v in closed.jaxpr.outvars:
        if isinstance(v, jcore.Literal) or v in seen or v in consts:
            continue
        seen.add(v)
        if v in invars:
            if invars[v] >= n_module:
                args += aval_bytes(v.aval)
            sig.append(("input", invars[v]))
        else:
            internal += aval_bytes(v.aval)
            sig.append((tuple(v.aval.shape), str(v.aval.dtype)))
    return internal, args, tuple(sorted(sig, key=repr))


def mesh_context(avals: Sequence[Any]) -> contextlib.AbstractContextManager:
    """`jax.set_mesh` of the mesh the avals are sharded over, so code naming `PartitionSpec`s
    (e.g. `out_sharding=P(...)`) traces in compile threads too, which do not inherit the
    caller's mesh context. A no-op for single-device avals or where a mesh cannot be set."""
    meshes = {getattr(getattr(a, "sharding", None), "mesh", None) for a in avals} - {None}
    if len(meshes) != 1:
        return contextlib.nullcontext()
    try:
        return jax.set_mesh(meshes.pop())
    except Exception:
        return contextlib.nullcontext()


def compiled_temp(fn: Callable, avals: Sequence[Any], options: dict | None = None) -> tuple[int, float]:
    """Compiler's temp bytes and FLOPs of `fn(*avals)` (abstract: no device memory), compiled with
    `options` (`measuring_options()` by default; those where the jaxlib does not know one of `options`).
    Raises `_refused.Refused` where the device refuses the program for memory."""
    with mesh_context(avals):
        lowered = jax.jit(fn).lower(*avals)
        try:
            compiled = compile_or_refuse(lambda: lowered.compile(measuring_options() if options is None else options))
        except Exception as e:
            if options is None or "No such compile option" not in str(e):
                raise
            compiled = compile_or_refuse(lambda: lowered.compile(measuring_options()))
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    memory = compiled.memory_analysis()
    if memory is None:
        raise RuntimeError(f"smartremat: the {jax.default_backend()} backend gives no `memory_analysis()` "
                           "of a compiled program, which smartremat measures blocks with.")
    return int(memory.temp_size_in_bytes), float((cost or {}).get("flops", 0.0))


def compiled_temps(jobs: Sequence[tuple[Callable, tuple]]) -> list[int | None]:
    """`compiled_temp` of each `(function, avals)` job, compiled in parallel threads with the
    options for block profiles (`_env.profiling_options`); `None` for a job the device refuses
    for memory (its figures are left to the jaxpr's counts, option by option)."""
    options = profiling_options()

    def temp(job: tuple[Callable, tuple]) -> int | None:
        try:
            return compiled_temp(job[0], job[1], options)[0]
        except Refused:
            return None

    with ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        return list(pool.map(carrying_config(temp), jobs))


def chainable(f: Callable, spec: CallSpec, n_module: int) -> int | None:
    """`n_module`, the dynamic index of `args[0]`, if it is an array and the output has exactly its
    type, else None."""
    module_def, args_def, _ = jax.tree_util.treedef_children(spec.treedef)
    first = module_def.num_leaves  # the leaf index of args[0]
    if len(spec.dynamic) <= n_module or args_def.num_leaves == 0 or first in dict(spec.static):
        return None
    out, d = jax.eval_shape(f, *spec.dynamic), spec.dynamic[n_module]
    if isinstance(out, jax.ShapeDtypeStruct) and (out.shape, out.dtype) == (d.shape, d.dtype):
        return n_module
    return None


def n_module_leaves(spec: CallSpec) -> int:
    n = jax.tree_util.treedef_children(spec.treedef)[0].num_leaves
    return n - sum(1 for i, _ in spec.static if i < n)


_CACHE: KeyedCache[BlockProfile] = KeyedCache()


def profile_block(spec: CallSpec, call: Callable, menu: tuple, calibrate: bool, ends: bool = False,
                  scanned: bool = False) -> BlockProfile:
    """Profile `call(module, *args)` under every policy of `menu`, once per key: signature,
    code, policy menu, calibration, whether the loss is taken on its outputs (`ends`), whether
    it is the body of a scan (`scanned`: no chains calibrated, see `calibration`), backend and
    XLA flags."""
    key = (spec.key(), call, tuple(menu), calibrate, scanned, *environment_key())
    if ends and calibrate:
        return _CACHE.get((*key, "ends"), lambda: _at_the_end(profile_block(spec, call, menu, calibrate, scanned=scanned),
                                                              spec, call))
    return _CACHE.get(key, lambda: _profile_uncached(spec, call, menu, calibrate, scanned))


def _at_the_end(profile: BlockProfile, spec: CallSpec, call: Callable) -> BlockProfile:
    """`profile` with each option's own peak compiled under a loss whose cotangent depends on the
    block's outputs, as a real loss taken on them does. The summed outputs' constant cotangent
    lets XLA drop the forward's last operations and fold the first of the backward: under the
    squared error the tutorial block's own peak is 6.125 MB, under the sum 4.125 MB
    (docs/facts.md, fact 10). Kept bytes are measured in chains of copies, whose inner copies
    get real cotangents, and stay as they are."""
    if not any(o.peak_bytes for o in profile.options):  # left alone: nothing measured
        return profile
    steps = [grad_step(o.option.profiled(spec, call), spec.dynamic, _square_loss) for o in profile.options]
    temps = compiled_temps([(step, spec.dynamic) for step in steps])  # None: refused, the profiled peak stands
    peaks = raised_peaks([o.saved_bytes for o in profile.options], [max(o.peak_bytes, o.saved_bytes) for o in profile.options],
                         [0 if t is None else t - o.saved_bytes for o, t in zip(profile.options, temps)])
    options = tuple(dataclasses.replace(o, peak_bytes=pk) for o, pk in zip(profile.options, peaks))
    return dataclasses.replace(profile, options=options)


def _profile_uncached(spec: CallSpec, call: Callable, menu: tuple, calibrate: bool, scanned: bool) -> BlockProfile:
    f_none = spec.function(call)
    forward = function_cost(f_none, *spec.dynamic)
    try:
        base = function_cost(grad_step(f_none, spec.dynamic), *spec.dynamic)
    except Exception as e:  # e.g. a `lax.while_loop` on floats: left alone, as it runs in the user's step
        # with no remat, counted as keeping nothing (the compiled step, not the model, tells what it takes)
        why = ("every policy", f"it cannot be reverse-differentiated on its own ({_reason(e)})")
        return BlockProfile(forward, (PolicyProfile(NO_REMAT, 0, 0, 0, Cost(0, 0)),), (why,))
    raw, skipped = _measure(spec, call, menu, base)
    # where the device refuses a calibrating compile, that option's jaxpr counts stand
    peaks, calibrated = calibration(raw, spec, n_module_leaves(spec), calibrate, scanned)
    options = []
    for j, m in enumerate(raw):
        counted = m.internal + m.args
        measured = None if calibrated is None else calibrated[j]
        saved = counted if measured is None else measured
        # uncalibrated, the backward's working set is the no-remat residuals, rebuilt during it
        compiled = None if peaks is None else peaks[j]
        peak = counted + raw[0].internal if compiled is None else compiled
        recompute = Cost(max(m.recompute.flops, 0), max(m.recompute.bytes, 0))
        options.append(PolicyProfile(m.option, int(saved), int(max(peak, saved)), int(counted), recompute,
                                     tuple(m.merged)))
    return BlockProfile(forward, tuple(options), tuple(skipped))


def _measure(spec: CallSpec, call: Callable, menu: tuple, base: Cost,
             ) -> tuple[list[_Measured], list[tuple[str, str]]]:
    """`(measured, skipped)`: each option's `_Measured` (no remat first; an option of the same residuals
    as an earlier one is in that one's `merged`), and `(option name, why)` of options that failed."""
    n_module = n_module_leaves(spec)
    raw: list[_Measured] = []
    seen: dict[tuple, _Measured] = {}
    skipped = []
    for option in menu:
        f = option.profiled(spec, call)
        try:
            internal, args, sig = residuals(f, spec, n_module)
            if sig in seen and option != NO_REMAT:  # same residuals as an earlier option: merge
                seen[sig].merged.append(option)
                continue
            total = function_cost(grad_step(f, spec.dynamic), *spec.dynamic)
        except Exception as e:
            if option == NO_REMAT or isinstance(e, PolicyError):  # the user's policy is wrong: say so
                raise
            skipped.append((option.name, _reason(e)))
            continue
        raw.append(_Measured(option, internal, args, total - base, f, []))
        seen.setdefault(sig, raw[-1])
    return raw, skipped


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


def calibration(raw: list[_Measured], spec: CallSpec, n_module: int, calibrate: bool,
                scanned: bool = False) -> tuple[Sequence[int | None] | None, Sequence[int | None] | None]:
    """`(peaks, saved)` from the compiler, or `(None, None)` when not calibrating: `peaks[j]`, the
    temp bytes of the block's gradient alone under option `j`; `saved[j]` (None where the output
    cannot feed the first argument), from copies of the block in a row, each with its own
    parameters: `temp(j, j, none) - temp(j, none)`, what one more copy under `j` adds with its input
    a temporary as in a stack (for no remat, `temp(none x 3) - temp(none x 2)`). A figure whose
    compile the device refuses for memory is None.

    Where the copy under `j` hides below its own peak in `(j, none)`, that overstates (a 24-layer
    transformer at d=768 keeps 12 MB a block under full remat, the difference said 47.77:
    docs/facts.md, fact 14), and `_between` measures it between copies without remat.

    The body of a scan (`scanned`) gets its peaks only: its iterations keep what the jaxpr counts
    (`_model.stage_figures`), so no chain is compiled for it (a third of the compiles: on XLA:TPU
    the 24 calibrating compiles of a 24-layer scan's body took 97 s of wall time, the whole step 11 s).
    """
    if not calibrate:
        return None, None
    jobs = [(grad_step(m.f, spec.dynamic), spec.dynamic) for m in raw]
    chain_at = None if scanned else chainable(raw[0].f, spec, n_module)
    if chain_at is not None:
        jobs += [chain_job([m.f] * k + [raw[0].f], spec, n_module, chain_at) for m in raw for k in (1, 2)]
    temps = compiled_temps(jobs)
    peaks, chains = temps[: len(raw)], temps[len(raw):]
    if chain_at is None:
        return peaks, [None] * len(raw)
    saved = [_less(chains[2 * j + 1], chains[2 * j]) for j in range(len(raw))]
    hidden = [j for j in range(1, len(raw)) if saved[j] is not None and _at_most(chains[2 * j], peaks[j])]
    two_none, peak_none = chains[0], peaks[0]
    if hidden and two_none is not None and peak_none is not None:  # the none option's chains: 2 and 3 copies
        saved = _between(saved, hidden, peaks, two_none, peak_none, raw, spec, n_module, chain_at)
    return peaks, saved


def _at_most(a: int | None, b: int | None) -> bool:
    """`a <= b`, False where either compile was refused."""
    return a is not None and b is not None and a <= b


def _less(a: int | None, b: int | None) -> int | None:
    """`a - b`, or None where either compile was refused."""
    return None if a is None or b is None else a - b


def _between(saved: list[int | None], hidden: Sequence[int], peaks: Sequence[int | None], two_none: int,
             peak_none: int, raw: list[_Measured], spec: CallSpec, n_module: int, chain_at: int) -> list[int | None]:
    """`saved` with, for each option `j` in `hidden`, `temp(none, j, none) - temp(none, none)`; where
    the copy hides below its own peak there too, the smaller of that and `temp(none, j, none x 3) -
    temp(none x 4)`: below zero where the copy lends its weight gradients' output buffers, written
    last, to the activations of the copies after it (fact 12: the tutorial block under full remat
    takes 3.875 MB off them). Where that chain too is hidden, it is an upper bound."""
    none = raw[0].f
    chains = [[none] * 4] + [c for j in hidden for c in ([none, raw[j].f, none], [none, raw[j].f] + [none] * 3)]
    four, *temps = compiled_temps([chain_job(c, spec, n_module, chain_at) for c in chains])
    first = two_none - peak_none  # what a copy without remat keeps while the next one peaks
    out = list(saved)
    for k, j in enumerate(hidden):
        between, after, peak = temps[2 * k], temps[2 * k + 1], peaks[j]
        if between is None or peak is None:  # refused: the first measure stands
            continue
        middle, lending = between - two_none, _less(after, four)
        out[j] = min(middle, lending) if lending is not None and between <= first + peak else middle
    return out


def chain_job(fs: Sequence[Callable], spec: CallSpec, n_module: int, chain_at: int) -> tuple[Callable, tuple]:
    """Gradient step of the block's copies `fs` in a row, each with its own parameters, and its avals."""
    n = len(spec.dynamic)
    avals = tuple(spec.dynamic) + tuple(spec.dynamic[:n_module]) * (len(fs) - 1)

    def chain(*leaves: Any) -> Any:
        rest = list(leaves[n_module:n])
        x = fs[0](*leaves[:n])
        for k, f in enumerate(fs[1:]):
            args = list(leaves[n + k * n_module: n + (k + 1) * n_module]) + rest
            args[chain_at] = x
            x = f(*args)
        return x

    return grad_step(chain, avals), avals
