"""Plans cached on disk, so that a restarted training job does not plan again.

A plan is stored as the JSON `Plan.save` writes, with its model's stages (so that `frontier()`,
`uniform()` and `plot()` work on a plan read back), in a file named by the hash of everything the
plan depends on (the key below); the key's text is stored beside the plan and compared on load,
so a hash collision or a file from another key is never used. The folder is
`$SMARTREMAT_CACHE_DIR`, else `$XDG_CACHE_HOME/smartremat`, else `~/.cache/smartremat`;
`SMARTREMAT_DISK_CACHE=0` turns the disk cache off.

The key holds: the call's signature (module structure, shapes, dtypes, batching, backend), the
source code of the module's classes and of the call, the configuration (budget, menu, options,
losses), the devices, the JAX, jaxlib, Equinox and smartremat versions (smartremat's own source
hashed), and `XLA_FLAGS`. A plan is cached only when each of these has a stable text: a menu of the
built-in policies, and losses and `blocks=` functions whose source can be read. Otherwise the
plan is made as usual and not stored.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import pathlib
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax

from ._memory import Stage
from ._plan import Plan
from ._policies import DEFAULT_MENU

logger = logging.getLogger("smartremat")

FORMAT = 1  #: bumped when the stored layout changes


def folder() -> pathlib.Path | None:
    """Where plans are stored, or `None` when the disk cache is off."""
    if os.environ.get("SMARTREMAT_DISK_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    given = os.environ.get("SMARTREMAT_CACHE_DIR")
    if given:
        return pathlib.Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "smartremat"


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
    """The source text of a function or class, or `None` when it cannot be read."""
    target = getattr(obj, "__func__", obj)
    try:
        return inspect.getsource(target if inspect.isclass(target) or inspect.isfunction(target)
                                 else type(target))
    except (OSError, TypeError):
        return None


def _module_classes(modules: list[Any]) -> list[type]:
    """The classes of every Equinox module in the modules' trees, in a stable order."""
    seen: dict[str, type] = {}
    stack = list(modules)
    while stack:
        x = stack.pop()
        if isinstance(x, eqx.Module):
            cls = type(x)
            seen.setdefault(f"{cls.__module__}.{cls.__qualname__}", cls)
            stack.extend(getattr(x, f.name, None) for f in dataclasses.fields(x))
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return [seen[k] for k in sorted(seen)]


def _code(modules: Sequence[Any], call: Callable) -> str | None:
    """A hash of the source of the modules' classes (their MROs below `eqx.Module`; Equinox's own
    classes are covered by its version) and of the call; `None` if any of it cannot be read (a
    class typed into a REPL), so that a changed class never reads an old plan."""
    texts = []
    for cls in _module_classes(list(modules)):
        texts += [_source(base) for base in cls.__mro__
                  if issubclass(base, eqx.Module) and not base.__module__.startswith("equinox")]
    texts.append(_source(call))
    if None in texts:
        return None
    return hashlib.sha256("\0".join(t for t in texts if t is not None).encode()).hexdigest()


def _loss_text(loss: Any) -> str | None:
    fn = getattr(loss, "fn", None)
    if fn is None:
        return repr(loss)  # the built-in losses are frozen dataclasses with a stable repr
    text = _source(fn)
    return None if text is None else repr((text, repr(getattr(loss, "args", None))))


def _key_text(signature: str, code: str | None, config: Any, extra: tuple = ()) -> str | None:
    """The text of a disk key, or `None` when some part of it has no stable text."""
    if any(o not in DEFAULT_MENU for o in config.policies) or config.plan is not None:
        return None
    losses = [_loss_text(loss) for loss in config.losses]
    blocks = None if config.blocks is None else _source(config.blocks)
    if None in losses or code is None or (config.blocks is not None and blocks is None):
        return None
    from . import __version__

    devices = [(d.platform, d.device_kind) for d in jax.devices()]
    return repr((FORMAT, __version__, _own_source(), jax.__version__, _jaxlib_version(), eqx.__version__,
                 os.environ.get("XLA_FLAGS", ""), devices, signature, code, config.budget_bytes,
                 [o.name for o in config.policies], blocks, config.calibrate, config.verify,
                 config.scan_segments, config.nested, losses, extra))


def plan_key(call: Callable, signature: str, module: Any, config: Any) -> str | None:
    """The disk key of a decorated module's plan (`None`: not cached)."""
    return _key_text(signature, _code([module], call), config)


def step_key(fun: Callable, treedef: Any, avals: Sequence[Any], modules: Sequence[Any], config: Any,
             options: Any) -> str | None:
    """The disk key of `smartremat.filter_jit`'s plan of a step: its arguments' structure,
    shapes, dtypes and shardings, the step's code and its modules' classes."""
    args = [(tuple(a.shape), str(a.dtype), str(getattr(a, "sharding", None)), bool(getattr(a, "weak_type", False)))
            for a in avals]
    return _key_text(repr((str(treedef), args, jax.default_backend())), _code(modules, fun), config,
                     (repr(options),))


def _path(text: str) -> pathlib.Path | None:
    where = folder()
    return None if where is None else where / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


def load(text: str | None) -> tuple[Plan, Any] | None:
    """`(plan, extra)` stored under this key, or `None` (absent, off, unreadable, or another key's)."""
    from ._serialise import load_plan

    path = None if text is None else _path(text)
    if path is None or not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("key") != text:
            return None
        plan = load_plan(data["plan"])
        stages = tuple(Stage(tuple(a), tuple(b), tuple(c), *rest) for a, b, c, *rest in data["stages"])
        return dataclasses.replace(plan, stages=stages, menu=tuple(data["menu"])), data.get("extra")
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("smartremat: ignoring the unreadable cached plan %s (%s); planning again", path, e)
        return None


def store(text: str | None, plan: Plan, extra: Any = None) -> None:
    """Write `plan` (and the JSON value `extra`) under this key, atomically; a failure to write
    is logged, never raised."""
    from ._serialise import plan_to_json

    path = None if text is None else _path(text)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps({"key": text, "plan": json.loads(plan_to_json(plan)), "extra": extra,
                           "stages": [dataclasses.astuple(st) for st in plan.stages], "menu": list(plan.menu)})
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            f.write(body)
        os.replace(f.name, path)
    except OSError as e:
        logger.warning("smartremat: could not write the plan cache %s (%s)", path, e)


def loaded(plan: Plan, seconds: float) -> Plan:
    """A plan read from the disk: this load's time, no compiles, and a note saying where it came from."""
    note = (f"loaded from smartremat's disk cache ({folder()}), planned there in "
            f"{plan.planning_seconds:.2f} s with {plan.compiles} whole-step compiles")
    return dataclasses.replace(plan, planning_seconds=seconds, compiles=0, notes=plan.notes + (note,))
