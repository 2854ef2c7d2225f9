"""Discover the candidate blocks: the sub-modules a module's forward calls, in call order."""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
from jax.extend import core as jcore

from . import _intercept
from ._cost import aval_bytes, floating_leaves
from ._paths import Path, get_at, path_str
from ._spec import CallSpec, make_spec


def _walk(value: Any, path: Path) -> Iterator[tuple[Path, Any]]:
    if isinstance(value, eqx.nn.Sequential):
        for i, layer in enumerate(value.layers):
            yield from _walk(layer, path + (("attr", "layers"), ("idx", i)))
    elif isinstance(value, eqx.Module):
        if callable(value):
            yield path, value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _walk(v, path + (("idx", i),))
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, path + (("key", k),))


def child_modules(module: eqx.Module) -> list[tuple[Path, Any]]:
    """Callable sub-modules one level down, looking into lists, tuples, dicts and Sequential."""
    return [found for f in dataclasses.fields(module) if hasattr(module, f.name)
            for found in _walk(getattr(module, f.name), (("attr", f.name),))]


def _find_path(module: Any, target: Any, path: Path = ()) -> Path | None:
    if module is target:
        return path
    if isinstance(module, eqx.Module):
        items = [(("attr", f.name), getattr(module, f.name, None)) for f in dataclasses.fields(module)]
    elif isinstance(module, (list, tuple)):
        items = [(("idx", i), v) for i, v in enumerate(module)]
    elif isinstance(module, dict):
        items = [(("key", k), v) for k, v in module.items()]
    else:
        return None
    found = (_find_path(v, target, path + (step,)) for step, v in items
             if v is not None and not isinstance(v, jax.Array))
    return next((f for f in found if f is not None), None)


def named_blocks(module: eqx.Module, blocks: Callable) -> list[tuple[Path, Any]]:
    """The sub-modules `blocks(module)` names, as `eqx.tree_at`'s `where` does."""
    try:
        chosen = blocks(module)
    except Exception as e:
        raise ValueError(
            f"`smartremat(blocks=...)` raised {type(e).__name__}: {e} when called on the module. "
            "`blocks` should be a function from the module to a sub-module or a sequence of "
            "them, e.g. `blocks=lambda m: m.layers`.") from e
    if isinstance(chosen, eqx.nn.Sequential):
        chosen = chosen.layers
    out = []
    for item in chosen if isinstance(chosen, (list, tuple)) else [chosen]:
        path = _find_path(module, item)
        if not callable(item) or not isinstance(item, eqx.Module) or path is None:
            raise ValueError(
                f"`smartremat(blocks=...)` returned {_describe(item)}, which is "
                "not a callable `eqx.Module` inside the decorated module. Return sub-modules "
                "of the module it is given, e.g. `blocks=lambda m: m.layers`.")
        out.append((path, item))
    if not out:
        raise ValueError(
            "`smartremat(blocks=...)` returned no sub-modules. Return at least one callable "
            "sub-module, e.g. `blocks=lambda m: m.layers`, or leave `blocks=None` to find them.")
    return out


def _describe(x: Any) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"an array ({x.dtype}{list(x.shape)})"
    r = repr(x)
    return f"{type(x).__name__} {r if len(r) < 60 else r[:57] + '...'}"


@dataclass(frozen=True)
class ScanSite:
    """Where a block runs under `jax.lax.scan`: the scan's index among the forward's top-level
    equations, its trip count, direction and per-iteration bytes of scanned slices (per device)."""

    eqn: int
    length: int
    reverse: bool
    xs_bytes: int = 0


@dataclass(frozen=True)
class BlockCall:
    """One call of a candidate block during the forward, with its abstract signature. `scan` is set
    when the call is the body of a top-level `jax.lax.scan` (it runs `scan.length` times, `spec` is
    per iteration); `ends` when the module returns its floating outputs as they are (the loss's input)."""

    path: Path
    type_name: str
    spec: CallSpec
    scan: ScanSite | None = None
    ends: bool = False
    unplanned: tuple[str, ...] = ()  # on the first call: why other blocks of the module are not planned


_PROBE_SCOPE = "smartremat_probe_"
_LOOPS = ("scan", "while")


def _contexts(jaxpr: jcore.Jaxpr, ctx: tuple = ()) -> Iterator[tuple[int, tuple]]:
    """`(serial, enclosing)` for every probed call's equations; `enclosing` lists the
    `(top-level index, equation)` of each equation holding a sub-jaxpr around it."""
    for k, eqn in enumerate(jaxpr.eqns):
        for s in re.findall(_PROBE_SCOPE + r"(\d+)", str(getattr(eqn.source_info, "name_stack", ""))):
            yield int(s), ctx
        for sub in subjaxprs(eqn):
            yield from _contexts(sub, ctx + ((k, eqn),))


def _inner_jit(jaxpr: jcore.Jaxpr) -> bool:
    """Whether the forward calls a `jax.jit`-ed function (whose trace JAX may have cached)."""
    return any(e.primitive.name in ("jit", "pjit", "closed_call") or any(_inner_jit(j) for j in subjaxprs(e))
               for e in jaxpr.eqns)


def subjaxprs(eqn: jcore.JaxprEqn) -> Iterator[jcore.Jaxpr]:
    for v in eqn.params.values():
        for item in (v if isinstance(v, (list, tuple)) else [v]):
            j = getattr(item, "jaxpr", item)
            if hasattr(j, "eqns"):
                yield j


def _sites(jaxpr: jcore.Jaxpr) -> dict[int, ScanSite | None | str]:
    """Per probed call: `None` (runs once), a `ScanSite`, or a string saying why it cannot be planned."""
    out: dict[int, ScanSite | None | str] = {}
    for serial, ctx in _contexts(jaxpr):
        loops = [(k, e) for k, e in ctx if e.primitive.name in _LOOPS]
        if not loops:
            site: ScanSite | None | str = None
        elif len(loops) == 1 and ctx[0][1] is loops[0][1] and loops[0][1].primitive.name == "scan":
            k, e = loops[0]
            n = int(e.params["length"])
            xs = e.invars[e.params["num_consts"] + e.params["num_carry"]:]
            site = ScanSite(k, n, bool(e.params["reverse"]), sum(aval_bytes(v.aval) for v in xs) // max(n, 1))
        else:
            site = _loop_kind([e for _, e in loops], [e for _, e in ctx])
        out[serial] = site if out.get(serial, site) == site else "more than one place"
    return out


def discover(module: eqx.Module, call: Callable, spec: CallSpec, blocks: Callable | None) -> list[BlockCall]:
    """Run the forward abstractly, watching the candidates' calls; return calls in order. A block
    that is the body of a top-level `jax.lax.scan` is one call with its `ScanSite`. If no candidate
    is called (e.g. a Module holding only arrays), the module's own call is the one block."""
    candidates = named_blocks(module, blocks) if blocks is not None else child_modules(module)
    recorded: list[tuple[int, CallSpec | None]] = []
    paths = [p for p, _ in candidates]
    outputs: dict[int, list] = {}  # each call's floating outputs (held, so that their ids stay theirs)
    ending: set[int] = set()  # the calls whose floating outputs the module returns

    def record(index: int, sub: Any, own: Callable, args: tuple, kwargs: dict) -> Any:
        try:
            spec = make_spec(sub, args, kwargs)
        except NotImplementedError:  # under nested vmaps inside the forward: not a candidate
            spec = None
        serial = len(recorded)
        recorded.append((index, spec))
        with jax.named_scope(f"{_PROBE_SCOPE}{serial}"):
            out = own(sub, *args, **kwargs)
        outputs[serial] = floating_leaves(out)
        return out

    def probed(m: Any, *args: Any, **kwargs: Any) -> Any:  # the traced copies of the sub-modules are watched, not replaced
        with _intercept.routing(m, paths, record):
            out = call(m, *args, **kwargs)
        ending.update(_returning(outputs, floating_leaves(out)))
        return out

    closed = jax.make_jaxpr(spec.function(probed))(*spec.dynamic)
    if not recorded and candidates and _inner_jit(closed.jaxpr):  # it may reuse a trace JAX cached before
        jax.clear_caches()  # (diffrax's solver loop did): trace afresh
        outputs.clear()
        closed = jax.make_jaxpr(spec.function(probed))(*spec.dynamic)
    sites = _sites(closed.jaxpr)
    calls, unplanned = [], {}
    for serial, (i, s) in enumerate(recorded):
        site = sites.get(serial)
        if isinstance(site, str):  # left as it runs: the loop keeps what it keeps
            unplanned.setdefault(candidates[i][0], _loop_reason(candidates[i], site))
            continue
        if s is not None and site is not None and spec.axis_size is not None and s.axis_size is None:
            s = batched_body(s, spec)
        if s is not None:
            calls.append(BlockCall(candidates[i][0], type(candidates[i][1]).__name__, s, site,
                                   ends=site is None and serial in ending))
    calls = [c for c in calls if c.path not in unplanned]  # a block run in a loop is left alone everywhere
    for path, reason in _shared_scans(calls).items():
        unplanned.setdefault(path, reason)
    calls = [c for c in calls if c.path not in unplanned]
    if blocks is not None:
        _warn_uncalled(candidates, {i for i, _ in recorded})
    else:  # a parameter-free layer (dropout, an activation) is part of its neighbours' cost
        calls = [c for c in calls if _module_leaves(c.spec) > 0] or calls
    calls = _last_ends(calls)
    if not calls and blocks is not None:  # never fall back to the whole module past the user's choice
        if unplanned:
            raise ValueError(
                "`smartremat(blocks=...)` named only sub-modules that smartremat leaves as they run: "
                + "; ".join(unplanned.values()) + ". Name sub-modules called outside such loops, or pass "
                "`blocks=None` to plan the module around them.")
        raise ValueError("`smartremat(blocks=...)` named sub-modules that the module's forward never "
                         "calls. Name the sub-modules its `__call__` uses.")
    calls = calls or [BlockCall((), type(module).__name__, spec, ends=True)]  # the module is its own block
    return _with_reasons(calls, tuple(unplanned.values()))


def _with_reasons(calls: list[BlockCall], reasons: tuple[str, ...]) -> list[BlockCall]:
    """`calls` with `reasons` (why other blocks are not planned) on the first call."""
    return [dataclasses.replace(calls[0], unplanned=reasons), *calls[1:]] if reasons else calls


def _returning(outputs: dict[int, list], final: list) -> list[int]:
    """The calls among whose floating outputs are all the module's floating outputs (by identity:
    returned as they are). A layer passing its input through (dropout at inference) matches too."""
    ids = {id(x) for x in final}
    return [k for k, xs in outputs.items() if ids and ids <= {id(x) for x in xs}]


def _last_ends(calls: list[BlockCall]) -> list[BlockCall]:
    """`calls` with `ends` kept on the last call that has it only (the loss is taken after it)."""
    last = max((k for k, c in enumerate(calls) if c.ends), default=None)
    return [c if k == last or not c.ends else dataclasses.replace(c, ends=False) for k, c in enumerate(calls)]


def _warn_uncalled(candidates: list[tuple[Path, Any]], called: set[int]) -> None:
    missed = [path_str(p) for i, (p, _) in enumerate(candidates) if i not in called]
    if missed and len(missed) < len(candidates):
        warnings.warn(
            f"`smartremat(blocks=...)` named {', '.join(missed)}, which the module's forward never "
            "calls on these inputs, so it is not planned. Name only the sub-modules its `__call__` "
            "uses (or leave `blocks=None`).", stacklevel=4)


def _module_leaves(spec: CallSpec) -> int:
    """How many traced (array) leaves the called module (the spec's first pytree) has."""
    n = jax.tree_util.treedef_children(spec.treedef)[0].num_leaves
    return n - sum(1 for i, _ in spec.static if i < n)


_MAX_DEPTH = 3


def expand_stacks(calls: list[BlockCall], depth: int = 0) -> list[BlockCall]:
    """Each block that runs a stack of layers (two or more sub-blocks of one class that have
    sub-modules of their own, e.g. BERT's `encoder` with its `layers`) replaced by its sub-blocks,
    in call order, to `_MAX_DEPTH` levels. A block smartremat cannot look into stays whole."""
    if depth >= _MAX_DEPTH:
        return calls
    out: list[BlockCall] = []
    for c in calls:  # the reasons why blocks are not planned stay on the first call
        inner = [dataclasses.replace(s, path=c.path + s.path, ends=c.ends and s.ends,
                                     unplanned=(c.unplanned if k == 0 else ()) + s.unplanned)
                 for k, s in enumerate(_stack_of(c))]
        out += expand_stacks(inner, depth + 1) if inner else [c]
    return out


def expanded(module: eqx.Module, call: Callable, spec: CallSpec, found: list[BlockCall]) -> list[BlockCall]:
    """`found` with its stacks expanded (`expand_stacks`). A block that wraps a scanned stack
    (a classifier's backbone, a diffusion object's `net`) is replaced by its layers: they are
    discovered again from `module` itself, so that each scan is located in `module`'s own forward
    (where the plan splits it); where that fails, the wrapper stays one block."""
    calls = expand_stacks(found)
    if all(c.scan is None or any(f.path == c.path for f in found) for c in calls):
        return calls
    paths = list(dict.fromkeys(c.path for c in calls))
    try:
        again = discover(module, call, spec, lambda m: [get_at(m, p) for p in paths])
    except (NotImplementedError, ValueError):
        return found
    if any(c.unplanned for c in again):
        return found
    return _with_reasons(again, tuple(dict.fromkeys(r for c in found for r in c.unplanned)))  # the outer module's


def sub_calls(call: BlockCall) -> list[BlockCall]:
    """The calls of the block's own sub-blocks, or `[]` where smartremat cannot plan them all."""
    try:
        inner = discover(call.spec.rebuild(call.spec.dynamic)[0], call_module, call.spec, None)
    except (NotImplementedError, ValueError):
        return []
    return [] if any(s.path == () or s.unplanned for s in inner) else inner


def _stack_of(c: BlockCall) -> list[BlockCall]:
    """The block's sub-block calls if it runs a stack (see `expand_stacks`), else `[]`: it stays whole."""
    inner = [] if c.path == () or c.scan is not None else sub_calls(c)
    if any(s.scan is not None for s in inner):  # a wrapper around a scanned stack: its layers are the blocks
        return inner
    distinct = list(dict((s.path, s) for s in inner).values())
    types = Counter(s.type_name for s in distinct)
    return inner if any(types[s.type_name] > 1 and _composite(s) for s in distinct) else []


def _composite(c: BlockCall) -> bool:
    """Whether the block's module holds sub-modules with arrays of their own (a transformer layer),
    not a single layer (an MLP's `Linear`, better checkpointed with its neighbours than alone)."""
    module = c.spec.rebuild(c.spec.dynamic)[0]
    return isinstance(module, eqx.Module) and any(
        jax.tree.leaves(sub, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
        for _, sub in child_modules(module))


def call_module(module: Any, *args: Any, **kwargs: Any) -> Any:
    """`module(*args, **kwargs)`: a named function, so checkpoints of it compare equal."""
    return module(*args, **kwargs)


def batched_body(body: CallSpec, outer: CallSpec) -> CallSpec:
    """The spec of a scanned block's call under the `jax.vmap` the module runs in. JAX traces a
    scan body once per example, before batching it, so the body's call shows no batch: the layer's
    slice (the module) is the same for every example, what it is called with carries the batch."""
    n_module = _module_leaves(body)
    size = outer.axis_size
    dynamic = tuple(d if k < n_module else jax.ShapeDtypeStruct((size, *d.shape), d.dtype)
                    for k, d in enumerate(body.dynamic))
    in_axes = tuple(None if k < n_module else 0 for k in range(len(body.dynamic)))
    return dataclasses.replace(body, dynamic=dynamic, in_axes=in_axes, axis_size=size, axis_name=outer.axis_name)


def _loop_kind(loops: list, around: list) -> str:
    """Which kind of loop a block runs in, as the user wrote it."""
    if any(e.primitive.name == "while" for e in loops):
        return ("a `jax.lax.while_loop` (a `fori_loop` with traced bounds, an ODE solver's stepping loop "
                "such as diffrax's)")
    if len(loops) > 1:
        return "a `jax.lax.scan` nested in another loop"
    outer = next(e.primitive.name for e in around if e.primitive.name not in _LOOPS)
    return f"a `jax.lax.scan` inside another transformation (`{outer}`)"


def _loop_reason(candidate: tuple[Path, Any], where: str) -> str:
    """Why a block is left unplanned, in the user's terms, and what to do instead."""
    return (f"the block {path_str(candidate[0])} ({type(candidate[1]).__name__}) is called inside {where}, "
            "where one traced call runs an unknown or nested number of times, so smartremat leaves it "
            "as it runs (it plans blocks that run once or as the body of a top-level `jax.lax.scan`). "
            "Memory inside such a loop is the loop's own: for a diffrax solve, bound it with "
            "`diffeqsolve(..., adjoint=diffrax.RecursiveCheckpointAdjoint(checkpoints=n))`; for your own "
            "loop, checkpoint its body with `eqx.filter_checkpoint`; or call the model outside the loop")


def _shared_scans(calls: list[BlockCall]) -> dict[Path, str]:
    """Blocks that a scan cannot be split around, with why: several blocks in the body of one
    scan (a `fori_loop` over a body that calls two layers), or a scanned block that also runs
    elsewhere. They are left as they run, as blocks inside other loops are."""
    by_scan: dict[int, dict[Path, str]] = {}
    for c in calls:
        if c.scan is not None:
            by_scan.setdefault(c.scan.eqn, {})[c.path] = c.type_name
    out: dict[Path, str] = {}
    for found in by_scan.values():
        if len(found) > 1:
            names = ", ".join(f"{path_str(p)} ({t})" for p, t in sorted(found.items()))
            for p in found:
                out[p] = (f"the blocks {names} are called in the body of one `jax.lax.scan` (or `fori_loop`), "
                          "and smartremat plans one block per scan body, so it leaves them as they run (a module "
                          "whose only blocks they are is planned whole). To plan them, put them in one module "
                          "that the loop's body calls (with the decorator, `smartremat(blocks=...)` may name one "
                          "of them)")
    counts = Counter(c.path for c in calls)
    for c in calls:
        if c.scan is not None and counts[c.path] > 1:
            out.setdefault(c.path, f"the scanned block {path_str(c.path)} ({c.type_name}) runs in more than one "
                           "scan, or in a scan and outside it, and smartremat splits a scanned block that runs "
                           "in one scan only, so it leaves it as it runs. Give each scan its own stacked module")
    return out
