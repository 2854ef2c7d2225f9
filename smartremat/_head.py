"""The last block of a stack in place: with what follows it in the module, and the loss.

A block's own peak is profiled alone, under a stand-in loss. The backward of a stack's last block,
though, runs right after that of what follows it (a language model's head and loss), while every
earlier block's kept bytes are alive: on the quick GPT the compiled step without remat peaks 18 MB
above the profiles' prediction for every plan that leaves the last block without remat
(docs/facts.md, fact 15).

So one program is compiled in place: the module's call under the plan's first loss, with the last
block whose output has its first argument's type (the stack's last) without remat, each such block
before it skipped (its call returns that argument), and the other blocks (a stem, a head) under
their option of fewest kept bytes. What it takes beyond the glue's residuals
(`MemoryModel.fixed_bytes`), the stem's kept bytes and the block's own is what follows the block;
the block's own peak under each option is then at least its kept bytes plus that. The compile is a
measure, not counted in `Plan.compiles`; where it fails, the model stays as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from ._env import profiling_options
from ._discover import call_module
from ._model import MemoryModel, after_stage
from ._options import NO_REMAT, Option
from ._profile import mesh_context
from ._spec import CallSpec, sharding_key
from ._verify import compiled_one


@dataclass(frozen=True)
class Skipped(Option):
    """A block's call that returns its first argument: only for measuring, never in a plan."""

    @property
    def name(self) -> str:
        return "skipped"

    def apply(self, call: Callable) -> Callable:
        return lambda module, *args, **kwargs: args[0]

    def to_json(self) -> Any:
        raise TypeError("a skipped block is only measured, never planned")


def _skippable(spec: CallSpec) -> bool:
    """Whether the block's first argument is one array and its output has exactly that array's
    type (shape, dtype and, over a mesh, sharding), so that a skipped call may return it."""
    try:
        _, args, _ = spec.rebuild(spec.dynamic)
        if not args or not isinstance(args[0], jax.ShapeDtypeStruct):
            return False
        with mesh_context(spec.dynamic):
            out = jax.eval_shape(spec.function(call_module), *spec.dynamic)
    except Exception:  # not traceable alone: not skipped
        return False
    return (isinstance(out, jax.ShapeDtypeStruct) and (out.shape, out.dtype) == (args[0].shape, args[0].dtype)
            and sharding_key(out) == sharding_key(args[0]))


def in_place(model: MemoryModel, call: Callable, spec: CallSpec, loss: Any) -> MemoryModel:
    """`model` with the own peak of the stack's last block (the last stage whose block returns its
    input's type) under each option raised by what follows it; `model` itself where that does not
    apply: no such block after another, a scanned block, a block whose outputs the loss is taken
    on (its profile has a real loss), or one also called elsewhere."""
    calls = model.calls
    known = {c.spec.key(): c.spec for c in calls if c.path != ()}  # one abstract trace per distinct block
    known = {key: _skippable(s) for key, s in known.items()}
    chain = [c.path != () and known[c.spec.key()] for c in calls]
    k = max((i for i, ci in enumerate(model.owner) if chain[ci]), default=0)
    last = model.owner[k]
    shared = any(calls[ci].path == calls[last].path for ci in model.owner if ci != last)
    if k == 0 or any(st.run is not None for st in model.stages) or calls[last].ends or shared:
        return model
    others, kept = [], 0
    for i, ci in enumerate(model.owner):
        if i < k and chain[ci]:
            others.append((calls[ci].path, Skipped()))
        elif i != k:  # a stem before, a head after: under its option of fewest kept bytes
            least = min(model.profiles[ci].options, key=lambda o: o.saved_bytes)
            others.append((calls[ci].path, least.option))
            kept += least.saved_bytes if i < k else 0
    none = _in_place(call, spec, tuple(others) + ((calls[last].path, NO_REMAT),), loss)
    return after_stage(model, k, none, kept)


def _in_place(call: Callable, spec: CallSpec, assignment: tuple, loss: Any) -> int:
    """Compiled temp bytes of the module's call under `assignment` and `loss`, with the options
    block profiles are compiled with (`_env.profiling_options`): a measure, not a step that runs."""
    return compiled_one(call, spec, assignment, loss, profiling_options())[0]
