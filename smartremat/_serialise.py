"""Save a plan as JSON and load it back, so a training job can skip re-planning."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

import jax

from ._plan import MB, Plan, PlanBlock, PolicyFigures
from ._policies import DEFAULT_POLICIES, policy_name
from ._nested import Nested
from ._scan import Segments
from ._spec import CallSpec

_BY_NAME = {policy_name(p): p for p in DEFAULT_POLICIES}


def signature(call: Callable, spec: CallSpec) -> str:
    """A stable fingerprint of the call and its abstract signature (what a plan is valid for)."""
    dyn = [(tuple(d.shape), str(d.dtype)) for d in spec.dynamic]
    text = repr((getattr(call, "__qualname__", repr(call)), str(spec.treedef), dyn, spec.in_axes,
                 spec.axis_size, jax.default_backend()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def plan_to_json(plan: Plan) -> str:
    data = plan.to_dict()
    data["signature"] = plan.signature
    data["assignment"] = [[[list(step) for step in path], _policy_json(pol)] for path, pol in plan.assignment]
    return json.dumps(data, indent=1)


def load_plan(source: str | os.PathLike | dict) -> Plan:
    """A `Plan` from `plan.save(path)`'s file (or its dict), ready for `smartremat(plan=...)`.

    **Arguments:**

    - `source`: a path to the JSON file, or the dict it holds.

    **Returns:**

    The plan, with its per-block figures and assignment; its frontier is not saved.
    """
    if isinstance(source, dict):
        data = source
    else:
        with open(source) as f:
            data = json.load(f)
    if "assignment" not in data or "signature" not in data:
        raise ValueError(
            f"`load_plan(source=...)` needs the JSON that `Plan.save` writes (with 'assignment' and "
            f"'signature'); got keys {sorted(data)[:8]}. Save the plan with `plan.save(path)`."
        )
    return Plan(
        budget_bytes=round(data["budget_mb"] * MB), predicted_peak_bytes=round(data["predicted_peak_mb"] * MB),
        no_remat_peak_bytes=round(data["no_remat_peak_mb"] * MB),
        full_remat_peak_bytes=round(data["full_remat_peak_mb"] * MB), min_peak_bytes=round(data["min_peak_mb"] * MB),
        recompute_flops=data["recompute_flops"], forward_flops=data["forward_flops"],
        blocks=tuple(_block(b) for b in data["blocks"]),
        compiled_peak_bytes=None if data["compiled_peak_mb"] is None else round(data["compiled_peak_mb"] * MB),
        compiled_flops=data["compiled_flops"], fixed_bytes=round(data["fixed_mb"] * MB),
        planning_seconds=data["planning_s"], backend=data["backend"], notes=tuple(data["notes"]),
        assignment=tuple((tuple(tuple(step) for step in path), _policy_of_json(pol)) for path, pol in data["assignment"]),
        signature=data["signature"],
    )


def _block(b: dict) -> PlanBlock:
    options = tuple(PolicyFigures(name, round(o["saved_mb"] * MB), round(o["peak_mb"] * MB), o["recompute_flops"],
                                  tuple(o["merged"])) for name, o in b["policies"].items())
    return PlanBlock(b["path"], b["type"], b["calls"], b["policy"], options)


def _policy(name: str) -> Any:
    if name not in _BY_NAME:
        raise ValueError(
            f"`load_plan` found the policy {name!r}, which it cannot rebuild from its name (only "
            f"{sorted(_BY_NAME)} can be). Plan again with `smartremat(policies=[...])` instead of loading."
        )
    return _BY_NAME[name]


def _policy_json(pol: Any) -> Any:
    """A policy, a `Segments` or a nested option as JSON (names, paths as lists)."""
    if isinstance(pol, Segments):
        return {"segments": [[a, b, _policy_json(p)] for a, b, p in pol.pieces]}
    if isinstance(pol, Nested):
        return {"nested": [[[list(step) for step in path], policy_name(p)] for path, p in pol.children]}
    return policy_name(pol)


def _policy_of_json(pol: Any) -> Any:
    if isinstance(pol, dict) and "segments" in pol:
        return Segments(tuple((int(a), int(b), _policy_of_json(p)) for a, b, p in pol["segments"]))
    if isinstance(pol, dict) and "nested" in pol:
        return Nested(tuple((tuple(tuple(step) for step in path), _policy(name)) for path, name in pol["nested"]))
    return _policy(pol)
