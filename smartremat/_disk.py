"""Plans cached on disk, so that a restarted training job does not plan again (docs/how-it-works.md,
step 8). A plan is stored as `Plan.save` writes it, in a file named by the hash of its key's text
(`_key.PlanKey.text`: everything the plan depends on); that text is stored beside it and compared on load, so a
hash collision is never used. Only keys with a stable text are cached (built-in policies, a
`blocks=` function whose source can be read).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import tempfile

from ._options import assignment_to_json
from ._plan import Plan, plan_data
from ._serialise import assignment_from_json, load_plan

logger = logging.getLogger("smartremat")


def folder() -> pathlib.Path | None:
    """Where plans are stored, or `None` when the disk cache is off."""
    if os.environ.get("SMARTREMAT_DISK_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if given := os.environ.get("SMARTREMAT_CACHE_DIR"):
        return pathlib.Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "smartremat"


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
