"""Save a plan as JSON and load it back, so a training job can skip re-planning."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from ._memory import Stage
from ._plan import Plan, PlanBlock, PolicyFigures
from ._env import MB
from ._options import Nested, Option, from_json
from ._policies import DEFAULT_MENU
from ._paths import path_str

_BY_NAME = {o.name: o for o in DEFAULT_MENU}


def assignment_from_json(data: list, named: Callable[[Any], Option] | None = None) -> tuple:
    """What `assignment_to_json` wrote; `named` gives the option of a name (by default, those of
    the default menu only)."""
    return tuple((tuple(tuple(step) for step in path), from_json(o, named or _policy)) for path, o in data)


def load_plan(source: str | os.PathLike | dict) -> Plan:
    """A `Plan` from `plan.save(path)`'s file (or its dict), ready for `smartremat(plan=...)`.

    **Arguments:**

    - `source`: a path to the JSON file, or the dict it holds.

    **Returns:**

    The plan, with its per-block figures, its assignment and the profile its `frontier()`, `uniform()`
    and `plot()` read (a file written before `Plan.save` kept the profile has none).
    """
    where, data = "the dict given", source
    if not isinstance(source, dict):
        where = repr(os.fspath(source))
        try:
            with open(source) as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanFileError(
                f"`load_plan({where})`: the file is not JSON ({e}); it may be truncated or not a plan at all. "
                "Save the plan again with `plan.save(path)` (or plan again: leave `plan=None`).") from None
    if not isinstance(data, dict) or "assignment" not in data or "signature" not in data:
        keys = sorted(data)[:8] if isinstance(data, dict) else type(data).__name__
        raise PlanFileError(
            f"`load_plan(source=...)` needs the JSON that `Plan.save` writes (with 'assignment' and "
            f"'signature'); {where} holds {keys}. Save the plan with `plan.save(path)`.")
    try:
        plan = plan_of(data)
    except PlanFileError as e:
        raise PlanFileError(f"`load_plan({where})`: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        what = f"the field {e.args[0]!r} is missing" if isinstance(e, KeyError) else f"a field is malformed ({e})"
        raise PlanFileError(
            f"`load_plan({where})`: {what}, so this is not a whole plan as `Plan.save` writes it. "
            "Save the plan again with `plan.save(path)`, or plan again (leave `plan=None`).") from None
    _check_rows(plan, where)
    return plan


class PlanFileError(ValueError):
    """A saved plan that `load_plan` cannot read back."""


def plan_of(data: dict, named: Callable[[Any], Option] | None = None) -> Plan:
    """The `Plan` of `plan_data`'s dict, its options by `named` (`assignment_from_json`)."""
    mb = lambda key: round(data[key] * MB)
    return Plan(
        budget_bytes=mb("budget_mb"), predicted_peak_bytes=mb("predicted_peak_mb"),
        no_remat_peak_bytes=mb("no_remat_peak_mb"), full_remat_peak_bytes=mb("full_remat_peak_mb"),
        min_peak_bytes=mb("min_peak_mb"), recompute_flops=data["recompute_flops"],
        forward_flops=data["forward_flops"], blocks=tuple(_block(b) for b in data["blocks"]),
        compiled_peak_bytes=None if data["compiled_peak_mb"] is None else mb("compiled_peak_mb"),
        compiled_flops=data["compiled_flops"], fixed_bytes=mb("fixed_mb"),
        planning_seconds=data["planning_s"], compiles=data.get("compiles", 0),
        checked=tuple((round(p * MB), round(c * MB)) for p, c in data.get("checked_mb", [])),
        timed=tuple((round(t * MB), float(f), float(s)) for t, f, s in data.get("timed", [])),
        backend=data["backend"], notes=tuple(data["notes"]),
        assignment=assignment_from_json(data["assignment"], named),
        signature=str(data["signature"]),
        stages=tuple(Stage(tuple(a), tuple(b), tuple(c), *rest) for a, b, c, *rest in data.get("stages", [])),
        menu=tuple(data.get("menu", [])),
    )


def _block(b: dict) -> PlanBlock:
    options = tuple(PolicyFigures(name, round(o["saved_mb"] * MB), round(o["peak_mb"] * MB), o["recompute_flops"],
                                  tuple(o["merged"])) for name, o in b["policies"].items())
    return PlanBlock(str(b["path"]), str(b["type"]), int(b["calls"]), str(b["policy"]), options)


def _check_rows(plan: Plan, where: str) -> None:
    """Refuse a file whose printed rows (`blocks`) disagree with its `assignment` (what runs),
    e.g. a `policy` edited by hand in one place only: what is shown must be what runs. `rows` are
    `{row label: option name}` as the planner labels them (one per block, one per scan piece)."""
    rows = {label: q.name for path, option in plan.assignment for label, _, q in option.rows(path_str(path))}
    claimed: set[str] = set()
    for b in plan.blocks:
        if not any(o.name == b.policy or b.policy in o.merged for o in b.options):
            raise PlanFileError(
                f"`load_plan({where})`: block {b.path!r} names the policy {b.policy!r}, which is not "
                f"among its options {[o.name for o in b.options]}. Edit it back to one of them, or plan "
                "again (leave `plan=None`) and save that plan.")
        runs, labels = rows.get(b.path), {b.path}
        if runs is None:  # a nested option: the block's sub-blocks are in the assignment
            children = _children(plan.assignment, b.path)
            runs, labels = (Nested(tuple(children.values())).name, set(children)) if children else (None, set())
        if runs is None:
            raise PlanFileError(
                f"`load_plan({where})`: block {b.path!r} (policy {b.policy!r}) has no entry in the "
                "plan's 'assignment', which is what runs. Re-plan, or edit both 'blocks' and 'assignment'.")
        if runs != b.policy:
            raise PlanFileError(
                f"`load_plan({where})`: block {b.path!r} is shown with the policy {b.policy!r} in "
                f"'blocks' but runs {runs!r} by the 'assignment'; a plan must show what runs. Re-plan "
                "(leave `plan=None`) and save that plan, or edit both 'blocks' and 'assignment'.")
        claimed |= labels
    unshown = [label for label in rows if label not in claimed]
    if unshown:
        raise PlanFileError(
            f"`load_plan({where})`: the 'assignment' (what runs) sets {unshown[0]!r} to "
            f"{rows[unshown[0]]!r}, which no row of 'blocks' shows. Re-plan (leave `plan=None`), "
            "or edit both 'blocks' and 'assignment'.")


def _children(assignment: tuple, label: str) -> dict[str, tuple]:
    """`{row label: (path below the block, option)}` of the entries below the block whose path
    reads `label` (the sub-blocks a nested option checkpoints; a split scan is never one)."""
    out = {}
    for path, option in assignment:
        k = next((k for k in range(len(path)) if path_str(path[:k]) == label), None)
        if k is not None and len(option.variants) == 1:
            out[path_str(path)] = (path[k:], option)
    return out


def _policy(name: str) -> Option:
    """The option of the default menu named `name` (only those can be rebuilt from a name)."""
    if not isinstance(name, str) or name not in _BY_NAME:
        raise PlanFileError(
            f"the plan names the policy {name!r}, which `load_plan` cannot rebuild from its name (only "
            f"{sorted(_BY_NAME)} can be). Plan again with `smartremat(policies=[...])` instead of loading.")
    return _BY_NAME[name]
