"""`explain(model, *args)`: the plan the decorator makes, for reading."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import equinox as eqx

from ._module_plan import get_plan
from ._decorator import checked_budget_mb, config_of, loaded_plan, make_config, smartremat
from ._plan import Plan
from ._env import MB
from ._spec import make_spec, vmapped_spec
from ._filter_jit import PlannedStep


def explain(model: Any, *args: Any, budget_mb: float | None = None, vmap: bool | str = False,
            **kwargs: Any) -> Plan:
    """The `Plan` smartremat makes for `model(*args, **kwargs)`: what it chose, and why.

    **Arguments:**

    - `model`: an instance of a `@smartremat`-decorated class, a module wrapped by
      `smartremat(...)(module)`, a plain `eqx.Module` (then `budget_mb` is required), or a
      training step made by `smartremat.filter_jit` (then `*args`, `**kwargs` are the step's
      arguments, and the plan is the one the step runs with).
    - `*args`, `**kwargs`: the inputs, as arrays or `jax.ShapeDtypeStruct`s (only their
      shapes and dtypes matter; nothing is computed).
    - `budget_mb`: overrides the decorator's budget; required for a plain module. For a model
      decorated with a saved plan (`smartremat(plan=...)`), the plan is explained as it runs,
      unless `budget_mb` is given: then the plan smartremat would make for that budget.
    - `vmap`: explain the plan for `jax.vmap(model)(*args)` instead, where axis 0 of every
      array argument is the batch (the budget then counts the whole batch, as it does when
      the decorated module runs under `jax.vmap`). A string is the vmap's `axis_name`, as in
      `jax.vmap(model, axis_name="batch")` (needed by collectives such as BatchNorm's).

    **Returns:**

    The same `Plan` value the decorator uses for this signature: `print(plan)` shows a table,
    `plan.to_dict()` is JSON-serialisable.
    """
    if isinstance(model, PlannedStep):
        if budget_mb is not None or vmap:
            raise ValueError(
                "`explain(model=...)` got a step made by `smartremat.filter_jit`, whose plan is for its "
                "own budget and arguments: pass the step's arguments only (no `budget_mb`, no `vmap`); "
                "for another budget, make the step again with `smartremat.filter_jit(fun, budget_mb=...)`.")
        return model.plan(*args, **kwargs)
    found = config_of(model)
    if found is None:
        if not isinstance(model, eqx.Module):
            raise TypeError(
                f"`explain(model=...)` should be an `eqx.Module`, not {type(model).__name__}. "
                "Pass the module instance you would call.")
        if budget_mb is None:
            raise ValueError(
                f"`explain(model=...)` got a plain {type(model).__name__}, which carries no budget: "
                "pass `budget_mb=...`, or decorate the class with `@smartremat(budget_mb=...)`.")
        config = make_config(budget_mb, name="explain")
        call, module = type(model).__call__, model
    else:
        config, call, module = found
        if budget_mb is not None:  # what would be planned for this budget, a saved plan set aside
            mb = checked_budget_mb(budget_mb, "explain(budget_mb=...)")
            config = dataclasses.replace(config, budget_bytes=int(mb * MB), budget_mb=mb, plan=None)
    spec = (make_spec(module, args, kwargs) if vmap is False or vmap is None
            else vmapped_spec(module, args, kwargs, None if vmap is True else vmap))
    if config.plan is not None:  # the model runs the saved plan it was given: that is what to explain
        return loaded_plan(config.plan, call, spec)
    return get_plan(call, spec, module, config)


def _old_spelling(model: Any, *args: Any, **kwargs: Any) -> Plan:
    """`smartremat.explain` where `smartremat` is the decorator (`from smartremat import smartremat`),
    as earlier versions allowed: `explain`, with a warning naming the package's function."""
    warnings.warn("`explain` is a function of the package, not an attribute of the decorator: use "
                  "`smartremat.explain(...)` after `import smartremat`, or `from smartremat import explain`. "
                  "The decorator's `explain` will be removed.", DeprecationWarning, stacklevel=2)
    return explain(model, *args, **kwargs)


smartremat.explain = _old_spelling  # type: ignore[attr-defined]
