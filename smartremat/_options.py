"""A block's option: what smartremat may do with the block's call.

`Option` has four kinds: `NoRemat` (the block left alone), `Policy` (its call under `jax.checkpoint`
with one policy), `Nested` (the block left alone, its sub-blocks under their own options) and
`Segments` (consecutive pieces of a scanned block under different options). Options are values:
equal options compare and hash equal (so caches keyed on them hit), told apart by what they do,
never by their display `name`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import equinox as eqx
import jax

from . import _intercept
from ._paths import Path, path_str
from ._scan import run_pieces
from ._spec import CallSpec

Entry = tuple[Path, "Option"]


class PolicyError(ValueError):
    """A policy of `smartremat(policies=...)` raised when JAX called it."""


class Option(abc.ABC):
    """What smartremat may do with one block's call; a value (frozen, compared and hashed by
    what it does), whose `name` is what plans show (`"none"` for no remat)."""

    @property
    @abc.abstractmethod
    def name(self) -> str: ...

    def to_json(self) -> Any:
        """This option as JSON (names, paths as lists); `from_json` reads it back."""
        return self.name

    def apply(self, call: Callable) -> Callable:
        """`call(module, *args, **kwargs)` run under this option (same signature)."""
        return call

    def profiled(self, spec: CallSpec, call: Callable) -> Callable:
        """`f(*spec.dynamic)`: the block's call under this option, vmapped as `spec` records."""
        return spec.function(self.apply(call))

    def expand(self, path: Path) -> tuple[Entry, ...]:
        """The `(path, option)` entries this option at `path` stands for in an assignment."""
        return ((path, self),)

    @property
    def variants(self) -> tuple[Option, ...]:
        """The distinct options this one runs (more than one: the pieces of a split scan)."""
        return (self,)

    def rows(self, label: str) -> tuple[tuple[str, int | None, Option], ...]:
        """`(row label, calls or None for all of the block's, option)` per row a plan shows."""
        return ((label, None, self),)


@dataclass(frozen=True)
class NoRemat(Option):
    """The block left alone: no `jax.checkpoint`."""

    @property
    def name(self) -> str:
        return "none"


#: The one no-remat option (all `NoRemat()` are equal).
NO_REMAT = NoRemat()


@dataclass(frozen=True)
class Policy(Option):
    """The block's call under `jax.checkpoint(policy=fn)`, shown as `label` (unique in its menu). A
    user's policy is `checked`: JAX calls this option, and an exception the policy raises becomes a
    `PolicyError` naming it and `argument`. JAX's own policies go to JAX as they are (it may
    recognise them by type)."""

    fn: Callable[..., Any]
    label: str
    checked: bool = False
    argument: str = field(default="smartremat", compare=False)

    @property
    def name(self) -> str:
        return self.label

    @property
    def jax_policy(self) -> Callable[..., Any]:
        """What `jax.checkpoint(policy=...)` receives: `fn`, or this option when checked."""
        return self if self.checked else self.fn

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> Any:
        try:
            return self.fn(prim, *avals, **params)
        except Exception as e:
            shapes = ", ".join(str(getattr(a, "str_short", lambda: a)()) for a in avals)
            raise PolicyError(
                f"`{self.argument}(policies=...)` holds the policy {self.name!r} ({self.fn!r:.80}), which "
                f"raised {type(e).__name__}: {e} when JAX called it as `policy({prim}, {shapes}, **params)`. "
                "A `jax.checkpoint` policy is called with each primitive of the block, its input avals "
                "and its parameters, and returns whether to save that primitive's output (True) or "
                "recompute it (False), e.g. `lambda prim, *avals, **params: prim is jax.lax.dot_general_p`. "
                "Fix the policy, or remove it from `policies=`.") from e

    def apply(self, call: Callable) -> Callable:
        return eqx.filter_checkpoint(call, policy=self.jax_policy)

    def profiled(self, spec: CallSpec, call: Callable) -> Callable:
        return spec.function(call, lambda f: jax.checkpoint(f, policy=self.jax_policy))


@dataclass(frozen=True)
class Nested(Option):
    """The block itself not checkpointed, its sub-blocks at `children` (paths relative to the
    block) under their options."""

    children: tuple[Entry, ...]

    @property
    def name(self) -> str:
        inner = ",".join(f"{path_str(p)}={short_name(o.name)}" for p, o in self.children)
        return f"nested({inner})"

    def apply(self, call: Callable) -> Callable:
        children = self.children
        return lambda module, *args, **kwargs: run(module, call, children, args, kwargs)

    def expand(self, path: Path) -> tuple[Entry, ...]:
        return tuple(e for child, o in self.children for e in o.expand(path + child))

    def to_json(self) -> Any:
        return {"nested": assignment_to_json(self.children)}


@dataclass(frozen=True)
class Segments(Option):
    """Options for consecutive pieces of a scan: `((start, stop, option), ...)` over the scanned
    axis (indices of the stacked layers), covering it in order. Run by splitting the scan of the
    whole forward (`_scan.run_pieces`), not by `apply`."""

    pieces: tuple[tuple[int, int, Option], ...]

    @property
    def name(self) -> str:
        return ",".join(f"[{a}:{b}]={o.name}" for a, b, o in self.pieces)

    @property
    def variants(self) -> tuple[Option, ...]:
        return tuple(dict.fromkeys(o for _, _, o in self.pieces))

    def apply(self, call: Callable) -> Callable:
        raise TypeError("a scan's pieces run by splitting the scan of the whole forward (`_scan.run_pieces`)")

    def rows(self, label: str) -> tuple[tuple[str, int | None, Option], ...]:
        return tuple((f"{label}[{a}:{b}]", b - a, o) for a, b, o in self.pieces)

    def to_json(self) -> Any:
        return {"segments": [[a, b, o.to_json()] for a, b, o in self.pieces]}


def from_json(data: Any, named: Callable[[Any], Option]) -> Option:
    """The option `Option.to_json` wrote; `named` gives the option of a plain name."""
    if isinstance(data, dict) and "segments" in data:
        return Segments(tuple((int(a), int(b), from_json(o, named)) for a, b, o in data["segments"]))
    if isinstance(data, dict) and "nested" in data:
        return Nested(tuple((tuple(tuple(step) for step in path), from_json(o, named)) for path, o in data["nested"]))
    return named(data)


def assignment_to_json(assignment: Sequence[Entry]) -> list:
    """`((path, option), ...)` as JSON: each path a list of its steps, each option its `to_json`."""
    return [[[list(step) for step in path], option.to_json()] for path, option in assignment]


def expand(assignment: Sequence[Entry]) -> tuple[Entry, ...]:
    """Every entry of `assignment` as the entries it stands for (nested options expanded)."""
    return tuple(e for path, option in assignment for e in option.expand(path))


def short_name(name: str) -> str:
    """A policy's name as plan tables and plots abbreviate it."""
    return {"dots_saveable": "dots", "dots_with_no_batch_dims_saveable": "dots_nb",
            "nothing_saveable": "full"}.get(name, name)


Assignment = tuple[Entry, ...]


def run(module: Any, call: Callable, assignment: Assignment, args: tuple, kwargs: dict,
        tags: dict[Path, str] | None = None) -> Any:
    """Call `call(module, *args, **kwargs)` with each `(path, option)` of `assignment` applied.

    The empty path is the module's own call. A `Segments` option splits that scan; a nested option
    stands for its sub-blocks' entries (`Option.expand`). The module tree is never rewritten: the
    planned sub-modules' calls are routed through their options as they happen
    (`_intercept.routing`). `tags` names the calls of some paths (`jax.named_scope`) so that their
    equations can be found in the traced program.
    """
    if any(len(option.variants) > 1 for _, option in assignment):
        return run_pieces(module, call, assignment, args, kwargs, run)
    assignment = expand(tuple((p, option.variants[0]) for p, option in assignment))
    tags = tags or {}
    entries: dict[Path, Option] = {p: option for p, option in assignment if p != () and option != NO_REMAT}
    entries.update({p: entries.get(p, NO_REMAT) for p in tags})
    call = next((option.apply(call) for path, option in assignment if path == ()), call)
    if not entries:
        return call(module, *args, **kwargs)
    paths = list(entries)

    def checkpointed(index: int, sub: Any, original: Callable, a: tuple, k: dict) -> Any:
        fn, tag = entries[paths[index]].apply(original), tags.get(paths[index])
        if tag is None:
            return fn(sub, *a, **k)
        with jax.named_scope(tag):
            return fn(sub, *a, **k)

    with _intercept.routing(module, paths, checkpointed):
        return call(module, *args, **kwargs)
