"""Plans cached on disk, so that a restarted training job does not plan again (docs/how-it-works.md,
step 8). A plan is stored as `Plan.save` writes it, in a file named by the hash of its key (`_key_text`:
everything the plan depends on); the key's text is stored beside it and compared on load, so a
hash collision is never used. Only keys with a stable text are cached (built-in policies, a
`blocks=` function whose source can be read).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import pathlib
import re
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax

from ._env import VERSION
from ._profile import mesh_context
from ._options import assignment_to_json
from ._plan import Plan, plan_data
from ._serialise import assignment_from_json, load_plan
from ._policies import DEFAULT_MENU

logger = logging.getLogger("smartremat")

FORMAT = 2  #: bumped when the stored layout changes


def folder() -> pathlib.Path | None:
    """Where plans are stored, or `None` when the disk cache is off."""
    if os.environ.get("SMARTREMAT_DISK_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if given := os.environ.get("SMARTREMAT_CACHE_DIR"):
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


def _key_text(signature: Any, config: Any, extra: tuple = ()) -> str | None:
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


def plan_key(call: Callable, spec: Any, config: Any) -> str | None:
    """The disk key of a decorated module's plan (`None`: not cached): the traced forward and
    each loss on its output, the call's abstract signature, the configuration."""
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
    return _key_text(signature, config, tuple(losses))


def step_key(sig: Any, jaxpr: Any, config: Any, extra: tuple) -> str | None:
    """The disk key of `smartremat.filter_jit`'s plan of a step: the traced step (no remat), its
    arguments' structure, shapes, dtypes and shardings, the configuration and `extra`."""
    signature = (without_addresses(str(sig.treedef)), _avals_text(sig.avals), _program(jaxpr))
    return _key_text(signature, config, tuple(without_addresses(repr(e)) for e in extra))


def _path(text: str) -> pathlib.Path | None:
    where = folder()
    return None if where is None else where / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


def load(text: str | None) -> tuple[Plan, tuple] | None:
    """`(plan, assignments)` stored under this key, or `None` (absent, off, unreadable, another key's)."""
    path = None if text is None else _path(text)
    if path is None or not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("key") != text:
            return None
        return load_plan(data["plan"]), tuple(assignment_from_json(a) for a in data["assignments"])
    except Exception as e:  # noqa: BLE001  (a bad file is never fatal: plan again, and overwrite it)
        logger.warning("smartremat: ignoring the unreadable cached plan %s (%s); planning again", path, e)
        return None


def store(text: str | None, plan: Plan, assignments: tuple = ()) -> None:
    """Write `plan` (and `assignments`, one per module call of a step) under this key,
    atomically. Nothing is written when the plan's paths do not survive JSON (dict keys that
    are not strings or ints); a failure to write is logged, never raised."""
    path = None if text is None else _path(text)
    if path is None:
        return
    tmp = None
    try:
        saved = [json.loads(json.dumps(assignment_to_json(a))) for a in (plan.assignment, *assignments)]
        if [assignment_from_json(a) for a in saved] != [plan.assignment, *assignments]:
            logger.debug("smartremat: this plan's paths do not survive JSON; not cached on disk")
            return
        body = json.dumps({"key": text, "plan": plan_data(plan), "assignments": saved[1:]})
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            tmp = f.name
            f.write(body)
        os.replace(tmp, path)
        tmp = None
    except Exception as e:  # noqa: BLE001  (the cache is an optimisation: planning has succeeded)
        logger.warning("smartremat: could not write the plan cache %s (%s)", path, e)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def loaded(plan: Plan, seconds: float) -> Plan:
    """A plan read from the disk: this load's time, no compiles, and a note saying where it came from."""
    note = (f"loaded from smartremat's disk cache ({folder()}), planned there in "
            f"{plan.planning_seconds:.2f} s with {plan.compiles} whole-step compiles")
    return dataclasses.replace(plan, planning_seconds=seconds, compiles=0, notes=plan.notes + (note,))
