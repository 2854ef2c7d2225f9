"""What a plan is valid for (`PlanKey`): one value per planned call, in the three forms its uses
need, so the memory cache, the disk cache and a saved plan's check cannot disagree on it."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import logging
import os
import pathlib
import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import equinox as eqx
import jax

from ._env import VERSION, environment_key
from ._policies import DEFAULT_MENU
from ._profile import mesh_context
from ._spec import CallSpec

logger = logging.getLogger("smartremat")

FORMAT = 2  #: bumped when the disk cache's stored layout changes


@dataclass(frozen=True)
class PlanKey:
    """What a plan is valid for: the planned call (a decorated module's, or a whole step), its
    abstract signature, the backend and the XLA flags.

    - `memory`: hashable, for this process's cache (beside the configuration);
    - `signature`: the short fingerprint a saved plan carries, which `smartremat(plan=...)` checks;
    - `text(config)`: the disk cache's key, a text that is the same in every process (`None`
      where some part has none: an own policy, a `blocks=` function without readable source).
      It traces the program, so it is made only when the memory cache misses.
    """

    memory: Hashable
    signature: str
    _text: Callable[[Any], str | None] = field(compare=False, repr=False)

    def text(self, config: Any) -> str | None:
        return self._text(config)


def module_key(call: Callable, spec: CallSpec) -> PlanKey:
    """The key of `call(module, *args, **kwargs)` on the abstract signature `spec`."""
    dyn = [(tuple(d.shape), str(d.dtype)) for d in spec.dynamic]
    text = repr((getattr(call, "__qualname__", repr(call)), str(spec.treedef), dyn, spec.in_axes,
                 spec.axis_size, jax.default_backend()))
    return PlanKey(("module", call, spec.key(), *environment_key()), _fingerprint(text),
                   functools.partial(_module_text, call, spec))


def step_key(name: str, sig: Any, jaxpr: Any, memory: Hashable, extra: tuple) -> PlanKey:
    """The key of `smartremat.filter_jit`'s step `name` on arguments `sig` (a `_step.Signature`),
    traced to `jaxpr` without remat; `memory` identifies the step in this process, and `extra` is
    what else the plan depends on (filter_jit's options)."""
    avals = [(a.shape, str(a.dtype)) for a in sig.avals]
    text = repr((name, without_addresses(str(sig.treedef)), avals, jax.default_backend()))
    return PlanKey(("step", memory, sig.key(), extra, *environment_key()), _fingerprint(text),
                   functools.partial(_step_text, sig, jaxpr, extra))


def _fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _module_text(call: Callable, spec: CallSpec, config: Any) -> str | None:
    """The disk text of a decorated module's key: the traced forward and each loss on its output,
    the call's abstract signature, the configuration (`None`: no key, no disk cache)."""
    f = spec.function(call)
    try:
        with mesh_context(spec.dynamic):
            forward, out = jax.make_jaxpr(f, return_shape=True)(*spec.dynamic)
            losses = [_program(jax.make_jaxpr(loss)(out, *loss.targets(out))) for loss in config.losses]
    except Exception as e:  # noqa: BLE001  (no key, no disk cache: planning goes on as usual)
        logger.debug("smartremat: no disk key for this call (%s)", e)
        return None
    signature = (str(spec.treedef), _avals_text(spec.dynamic), spec.in_axes, spec.axis_size,
                 without_addresses(repr(spec.axis_name)), _program(forward))
    return _disk_text(signature, config, tuple(losses))


def _step_text(sig: Any, jaxpr: Any, extra: tuple, config: Any) -> str | None:
    """The disk text of a step's key: the traced step (hashing its text takes a while at real
    size, so only when the disk cache asks), its arguments, the configuration and `extra`."""
    signature = (without_addresses(str(sig.treedef)), _avals_text(sig.avals), _program(jaxpr))
    return _disk_text(signature, config, tuple(without_addresses(repr(e)) for e in extra))


def _disk_text(signature: Any, config: Any, extra: tuple = ()) -> str | None:
    """The text of a disk key, or `None` when some part of it has no stable text."""
    if any(o not in DEFAULT_MENU for o in config.policies) or config.plan is not None:
        return None
    blocks = None if config.blocks is None else _source(config.blocks)
    if config.blocks is not None and blocks is None:
        return None
    devices = [(d.platform, d.device_kind) for d in jax.devices()]
    return repr((FORMAT, VERSION, _own_source(), jax.__version__, _jaxlib_version(), eqx.__version__,
                 os.environ.get("XLA_FLAGS", ""), devices, signature, config.budget_bytes,
                 [o.name for o in config.policies], blocks, config.calibrate, config.verify,
                 config.scan_segments, config.nested, config.tune, extra))


@functools.cache
def _own_source() -> str:
    """A hash of smartremat's own source: a changed planner never reads an old plan."""
    h = hashlib.sha256()
    for p in sorted(pathlib.Path(__file__).parent.glob("*.py")):
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _source(obj: Any) -> str | None:
    """The source text of a plain function, or `None` (a lambda typed into a REPL, a partial,
    a callable object, a file that no longer parses: nothing stable to key on)."""
    try:
        return inspect.getsource(obj) if inspect.isfunction(obj) else None
    except Exception:  # noqa: BLE001  (OSError, TypeError, tokenize.TokenError, SyntaxError: no key)
        return None


def without_addresses(text: str) -> str:
    """`text` with the memory addresses of reprs (` at 0x...`) removed: the same in every process."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def _program(jaxpr: Any) -> str:
    """A hash of a traced program's text (memory addresses removed): what the step computes,
    static arguments, helper functions and fields of the modules included."""
    return hashlib.sha256(without_addresses(str(jaxpr)).encode()).hexdigest()


def _avals_text(avals: Sequence[Any]) -> list:
    return [(tuple(a.shape), str(a.dtype), bool(getattr(a, "weak_type", False)),
             without_addresses(str(getattr(a, "sharding", None)))) for a in avals]
