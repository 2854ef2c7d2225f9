"""Discover the candidate blocks: the sub-modules a module's forward calls, in call order."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax

from ._spec import CallSpec, make_spec

Path = tuple[tuple[str, Any], ...]


def path_str(path: Path) -> str:
    """`(("attr", "blocks"), ("idx", 0))` -> `"blocks[0]"`; the empty path is `"<self>"`."""
    if not path:
        return "<self>"
    out = ""
    for kind, key in path:
        out += f".{key}" if kind == "attr" else f"[{key!r}]"
    return out.lstrip(".")


def get_at(tree: Any, path: Path) -> Any:
    for kind, key in path:
        tree = getattr(tree, key) if kind == "attr" else tree[key]
    return tree


def replace_at(tree: Any, paths: list[Path], values: list[Any]) -> Any:
    """`eqx.tree_at` replacing the sub-modules at `paths` (never mutates `tree`)."""
    if not paths:
        return tree
    return eqx.tree_at(lambda t: [get_at(t, p) for p in paths], tree, values)


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
    found = []
    for f in dataclasses.fields(module):
        if hasattr(module, f.name):
            found.extend(_walk(getattr(module, f.name), (("attr", f.name),)))
    return found


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
    for step, v in items:
        if v is None or isinstance(v, jax.Array):
            continue
        found = _find_path(v, target, path + (step,))
        if found is not None:
            return found
    return None


def named_blocks(module: eqx.Module, blocks: Callable) -> list[tuple[Path, Any]]:
    """The sub-modules `blocks(module)` names, as `eqx.tree_at`'s `where` does."""
    try:
        chosen = blocks(module)
    except Exception as e:
        raise ValueError(
            f"`smartremat(blocks=...)` raised {type(e).__name__}: {e} when called on the module. "
            "`blocks` should be a function from the module to a sub-module or a sequence of "
            "them, e.g. `blocks=lambda m: m.layers`."
        ) from e
    if isinstance(chosen, eqx.nn.Sequential):
        chosen = list(chosen.layers)
    items = list(chosen) if isinstance(chosen, (list, tuple)) else [chosen]
    out = []
    for item in items:
        path = _find_path(module, item)
        if not callable(item) or not isinstance(item, eqx.Module) or path is None:
            raise ValueError(
                f"`smartremat(blocks=...)` returned {type(item).__name__} {_short(item)}, which is "
                "not a callable `eqx.Module` inside the decorated module. Return sub-modules "
                "of the module it is given, e.g. `blocks=lambda m: m.layers`."
            )
        out.append((path, item))
    if not out:
        raise ValueError(
            "`smartremat(blocks=...)` returned no sub-modules. Return at least one callable "
            "sub-module, e.g. `blocks=lambda m: m.layers`, or leave `blocks=None` to find them."
        )
    return out


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) < 60 else r[:57] + "..."


@dataclass(frozen=True)
class BlockCall:
    """One call of a candidate block during the forward, with its abstract signature."""

    path: Path
    type_name: str
    spec: CallSpec


_PROBE_SCOPE = "smartremat_probe_"
_LOOPS = ("scan", "while")


def _called_in_loop(jaxpr, in_loop: bool = False) -> int | None:
    """Index of a probed block whose equations sit inside a `scan`/`while` body, if any."""
    for eqn in jaxpr.eqns:
        found = re.search(_PROBE_SCOPE + r"(\d+)", str(getattr(eqn.source_info, "name_stack", "")))
        if in_loop and found:
            return int(found.group(1))
        for sub in _subjaxprs(eqn):
            found = _called_in_loop(sub, in_loop or eqn.primitive.name in _LOOPS)
            if found is not None:
                return found
    return None


def _subjaxprs(eqn):
    for v in eqn.params.values():
        for item in (v if isinstance(v, (list, tuple)) else [v]):
            j = getattr(item, "jaxpr", item)
            if hasattr(j, "eqns"):
                yield j


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, CallSpec]] = []


class _Probe(eqx.Module):
    module: Any
    index: int = eqx.field(static=True)
    recorder: _Recorder = eqx.field(static=True)

    def __call__(self, *args, **kwargs):
        try:
            spec = make_spec(self.module, args, kwargs)
        except NotImplementedError:  # under nested vmaps inside the forward: not a candidate
            spec = None
        self.recorder.calls.append((self.index, spec))
        with jax.named_scope(f"{_PROBE_SCOPE}{self.index}"):
            return self.module(*args, **kwargs)


def discover(
    module: eqx.Module, call: Callable, spec: CallSpec, blocks: Callable | None
) -> list[BlockCall]:
    """Run the forward abstractly with probes on the candidates; return calls in order.

    If no candidate is called (e.g. a Module holding only arrays), the module's own call is
    the one block.
    """
    candidates = named_blocks(module, blocks) if blocks is not None else child_modules(module)
    recorder = _Recorder()
    paths = [p for p, _ in candidates]

    def probed(m, *args, **kwargs):  # probes wrap the traced sub-modules, not the originals
        probes = [_Probe(get_at(m, p), i, recorder) for i, p in enumerate(paths)]
        return call(replace_at(m, paths, probes), *args, **kwargs)

    closed = jax.make_jaxpr(spec.function(probed))(*spec.dynamic)
    looped = _called_in_loop(closed.jaxpr)
    if looped is not None:
        raise NotImplementedError(
            f"smartremat found the block {path_str(candidates[looped][0])} "
            f"({type(candidates[looped][1]).__name__}) called inside `jax.lax.scan` or a while loop, "
            "where one traced call runs many times; planning such blocks is not supported yet, and "
            "counting it once would understate the peak. Checkpoint the loop body by hand with "
            "`eqx.filter_checkpoint`, or name blocks outside the loop with `blocks=`."
        )
    unplannable = {i for i, s in recorder.calls if s is None}
    calls = [
        BlockCall(candidates[i][0], type(candidates[i][1]).__name__, s)
        for i, s in recorder.calls
        if i not in unplannable
    ]
    if not calls:
        if blocks is not None:
            raise ValueError(
                "`smartremat(blocks=...)` named sub-modules that the module's forward never "
                "calls. Name the sub-modules its `__call__` uses."
            )
        return [BlockCall((), type(module).__name__, spec)]
    return calls
