"""`smartremat(budget_mb=...)`: as a class decorator or applied to a module instance."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import _intercept, _jax_private, _options
from ._model import Config
from ._module_plan import get_plan
from ._plan import Plan
from ._env import MB
from ._key import module_key
from ._policies import normalise_policies
from ._spec import make_spec
from ._verify import DEFAULT_LOSSES, UserLoss, abstract_args


def _real(value: Any) -> float | None:
    """`value` as a float if it is a real number (a Python or NumPy scalar, a 0-d integer or floating
    array), else None (bools included)."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    dtype = getattr(value, "dtype", None)
    if getattr(value, "shape", None) != () or dtype is None:
        return None
    try:
        numeric = jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
        return float(value) if numeric else None
    except Exception:  # a traced value (inside `jit`), or a dtype NumPy does not know: not a number here
        return None


def checked_budget_mb(budget_mb: Any, name: str = "smartremat(budget_mb=...)") -> float:
    """The budget in MB as a float, checked: a positive, finite real number (not a bool)."""
    value = _real(budget_mb)
    if value is None or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"`{name}` should be a positive, finite number of megabytes (2**20 bytes), not "
            f"{budget_mb!r}. It caps the peak activation memory of one forward+backward through "
            "the module; e.g. `budget_mb=512`.")
    return value


def make_config(budget_mb: Any, *, policies: Sequence[Any] | None = None, blocks: Callable | None = None,
                calibrate: bool = True, verify: bool = True, plan: Plan | None = None,
                scan_segments: int = 2, nested: bool = True, loss: Callable | None = None,
                loss_args: Any = (), tune: bool = False, name: str = "smartremat") -> Config:
    """Check every option (errors name the argument) and return the hashable `Config`."""
    if blocks is not None and not callable(blocks):
        raise TypeError(
            f"`{name}(blocks=...)` should be a function from the module to a sub-module or a "
            f"sequence of them (as in `eqx.tree_at`), not {blocks!r}; e.g. `blocks=lambda m: m.layers`.")
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(
            f"`{name}(plan=...)` should be a `smartremat.Plan` (e.g. from `smartremat.load_plan(path)`), "
            f"not {type(plan).__name__}. Load a saved plan with `load_plan` first.")
    if isinstance(scan_segments, (bool, np.bool_)) or not isinstance(scan_segments, numbers.Integral) \
            or scan_segments < 1:
        raise ValueError(
            f"`{name}(scan_segments=...)` should be a positive int (how many pieces, each with "
            f"its own policy, a scanned block's scan may be split into), not {scan_segments!r}; "
            "e.g. `scan_segments=1` keeps every scan whole.")
    if tune and plan is not None:
        raise ValueError(
            f"`{name}(tune=True, plan=...)`: a saved plan runs as saved, so there is nothing to tune. "
            "Drop `tune=True`, or leave `plan=None` to plan (and tune) again.")
    if tune and not verify:
        raise ValueError(
            f"`{name}(tune=True, verify=False)`: tuning times the candidate plans that the compiler "
            "verified to fit, so it needs `verify=True`. Drop `tune=True`, or leave `verify` on.")
    mb = checked_budget_mb(budget_mb, f"{name}(budget_mb=...)")
    if plan is not None:
        _check_plan_budget(plan, mb, name)
    return Config(budget_bytes=int(mb * MB), policies=normalise_policies(policies, name), budget_mb=mb,
                  blocks=blocks, calibrate=bool(calibrate), verify=bool(verify), plan=plan,
                  scan_segments=int(scan_segments), nested=bool(nested),
                  losses=_losses(loss, loss_args, name), tune=bool(tune))


def _check_plan_budget(plan: Plan, budget_mb: float, name: str) -> None:
    """A saved plan runs as saved: refuse a budget below what it takes (a higher one is fine)."""
    peak, kind = ((plan.compiled_peak_bytes, "compiled temp bytes") if plan.compiled_peak_bytes is not None
                  else (plan.predicted_peak_bytes, "predicted by smartremat's model"))
    if budget_mb * MB + 1 >= peak:  # a byte of slack: `at least` below is rounded up to 0.01 MB
        return
    up = math.ceil(peak / MB * 100) / 100
    raise ValueError(
        f"`{name}(budget_mb={budget_mb:g}, plan=...)`: the saved plan runs as it was saved, and its peak "
        f"is {peak / MB:.3f} MB ({kind}; it was made for budget_mb={plan.budget_bytes / MB:g}), above "
        f"the budget. Raise `budget_mb` to at least {up:.2f} to run this plan, or plan again for "
        f"{budget_mb:g} MB (leave `plan=None`) and save that plan.")


def _losses(loss: Callable | None, loss_args: Any, name: str) -> tuple:
    """The losses plans are verified on: the user's own, or the default real losses."""
    if loss is None:
        if not (loss_args is None or isinstance(loss_args, (tuple, list)) and not loss_args):
            raise ValueError(
                f"`{name}(loss_args=...)` was given without `loss=`: they are the extra arguments of "
                "your loss, `loss(output, *loss_args)`. Pass `loss=` too, or drop `loss_args`.")
        return DEFAULT_LOSSES
    if not callable(loss):
        raise TypeError(
            f"`{name}(loss=...)` should be your loss as a function `loss(output, *loss_args)` "
            f"returning a scalar, not {type(loss).__name__} {loss!r:.60}; e.g. "
            "`loss=lambda out, y: jnp.mean((out - y) ** 2), loss_args=(jax.ShapeDtypeStruct((64, 512), jnp.float32),)`."
        )
    if not callable(loss_args):
        try:
            loss_args = abstract_args(loss_args)
        except Exception as e:
            raise TypeError(
                f"`{name}(loss_args=...)` should be arrays or `jax.ShapeDtypeStruct`s (the extra "
                f"arguments of `loss(output, *loss_args)`, e.g. the targets), or a function from the "
                f"output's shapes to them; got {loss_args!r:.80} ({e}).") from e
    return (UserLoss(loss, loss_args),)


def planned_call(module: Any, call: Callable, config: Config, args: tuple, kwargs: dict) -> Any:
    """Plan (once per signature) and run `call(module, *args, **kwargs)` under the plan. Inside a
    module `smartremat.filter_jit` plans (its plan covers this one), or with no backward pass
    (nothing to keep for it), the plain forward runs."""
    if _intercept.in_root_call() or not _jax_private.differentiated(jax.tree.leaves((module, args, kwargs))):
        return call(module, *args, **kwargs)
    spec = make_spec(module, args, kwargs)
    plan = loaded_plan(config.plan, call, spec) if config.plan else get_plan(call, spec, module, config)
    return _options.run(module, call, plan.assignment, args, kwargs)


def loaded_plan(plan: Plan, call: Callable, spec: Any) -> Plan:
    """The saved plan given as `smartremat(plan=...)`, checked against this call's signature."""
    if plan.signature != module_key(call, spec).signature:
        raise ValueError(
            "`smartremat(plan=...)` was made for a different module or input signature (shapes, "
            "dtypes, batch, backend) than this call. Plan again (leave `plan=None`), or load the "
            "plan saved for these inputs.")
    return plan


class SmartRemat(eqx.Module):
    """A module wrapped by `smartremat(budget_mb=...)(module)`: called like `module`, with the same
    array leaves, so parameters and gradients are the same."""

    module: eqx.Module
    config: Config = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return planned_call(self.module, type(self.module).__call__, self.config, args, kwargs)


def _decorate_class(cls: type, config: Config) -> type:
    """Give `cls` a planning `__call__` in place (as `dataclasses.dataclass` acts on the class), so
    instances keep the same pytree; the original call, kept as `__smartremat__`, runs inside the plan."""
    if "__smartremat__" in cls.__dict__:
        raise TypeError(
            f"`smartremat(...)` was applied twice to the class {cls.__name__!r}. Decorate it "
            "once, with the budget you want.")
    original = cls.__call__

    @functools.wraps(original)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return planned_call(self, original, config, args, kwargs)

    cls.__call__ = __call__
    cls.__smartremat__ = (config, original)
    return cls


def smartremat(budget_mb: float, *, policies: Sequence[Callable[..., bool] | None] | None = None,
               blocks: Callable[[Any], Any] | None = None, calibrate: bool = True, verify: bool = True,
               plan: Plan | None = None, scan_segments: int = 2, nested: bool = True,
               loss: Callable[..., Any] | None = None, loss_args: Any = (),
               tune: bool = False) -> Callable[[Any], Any]:
    """Choose and apply gradient checkpointing so one forward+backward fits `budget_mb`.

    **Arguments:**

    - `budget_mb`: cap on the peak activation memory (MB = 2**20 bytes) of one forward and
      backward pass through the module: residuals kept for the backward plus the backward's
      working set, excluding parameters, inputs, outputs and gradient buffers.
    - `policies`: the `jax.checkpoint` policies to choose from per block. Defaults to
      `dots_saveable`, `dots_with_no_batch_dims_saveable` and `nothing_saveable`; no remat is
      always an option. Policies that save the same residuals for a block are merged. Your own
      are shown under their `__name__`, made unique (a second `<lambda>` is `<lambda>#2`); one
      that raises is reported by name.
    - `blocks`: a function from the module to the sub-module(s) to plan over (as in
      `eqx.tree_at`). Defaults to the sub-modules its forward calls, found automatically.
    - `calibrate`: ask the compiler for each distinct block's own peak and for what it keeps in
      a stack of its copies (up to three small compiles per block and policy, no device memory;
      one for a scan's body, and under `smartremat.filter_jit` none where the rest of the step
      outweighs its working set). Without it the model uses jaxpr counts only.
    - `verify`: compile the real step for candidate plans (a few of the model's frontier and the
      uniform plans) and keep the cheapest whose compiled temp bytes fit: the compiler, not the
      model, guarantees the fit. Plans are cached on disk (docs/how-it-works.md:
      `SMARTREMAT_CACHE_DIR`, `SMARTREMAT_DISK_CACHE=0`).
    - `plan`: a saved `Plan` (`smartremat.load_plan(path)`) to apply instead of planning, made for
      the same module and input signature; it runs as saved, and its peak must fit `budget_mb`.
    - `scan_segments`: a block that is the body of a `jax.lax.scan` (stacked layers) runs every
      iteration under one policy, so its scan may be split into up to this many consecutive
      scans, each with its own policy (closer to the best per-layer plan, more to compile). `1`
      keeps each scan whole.
    - `nested`: also offer, for a block that calls sub-blocks (e.g. a transformer layer's
      attention and MLP), checkpointing its two costliest sub-blocks (every combination of
      policies) instead of the whole block. `False` plans one level only.
    - `loss`: your loss, `loss(output, *loss_args) -> scalar`; plans are then verified on its
      gradient. Without it, they must fit the squared error and the softmax cross-entropy of
      every floating output against targets (a loss that needs more working memory, or a step
      that does more than the gradient, is held to the budget by `smartremat.filter_jit`).
    - `loss_args`: the extra arguments of `loss` (e.g. targets), as arrays or
      `jax.ShapeDtypeStruct`s, or a function from the output's `ShapeDtypeStruct`s to them when
      their shapes follow the batch (e.g. `lambda out: jax.ShapeDtypeStruct(out.shape[:-1], jnp.int32)`).
    - `tune`: also time candidates and keep the fastest (FLOPs do not order step times: on a CPU,
      memory traffic can cost more than recompute). The fitting plan of the default objective
      (fewest compiled FLOPs; on an accelerator, plus a charge for bytes kept in a scan), every uniform plan and up to three frontier plans of lower peak are compiled as the
      verified step (under the first loss); those that fit run on synthetic inputs (interleaved
      rounds: 25, or about 2 s per candidate for short steps) and the lowest median time wins
      (docs/facts.md, facts 18 and 19). It costs a few seconds per plan, once per signature
      (plans are cached on disk), and device memory for a second copy of the step's inputs.
      `Plan.timed` and `smartremat.explain` show the times.

    **Returns:**

    A decorator. On an `eqx.Module` subclass it returns that class, whose instances (same
    fields, same pytree) plan on their first differentiated call per input signature (inside
    `jax.grad`, `eqx.filter_grad`, `jax.vjp`; a forward-only call runs the plain forward, and a
    function traced before it is differentiated, as in `jax.grad(jax.jit(f))`, shows no sign of
    it: plan such steps with `smartremat.filter_jit`). On a module instance it returns a
    `SmartRemat` wrapper, called like the module, holding the same arrays.
    """
    config = make_config(budget_mb, policies=policies, blocks=blocks, calibrate=calibrate, verify=verify,
                         plan=plan, scan_segments=scan_segments, nested=nested, loss=loss, loss_args=loss_args,
                         tune=tune)

    def decorate(target: Any) -> Any:
        if isinstance(target, type):
            if not issubclass(target, eqx.Module):
                raise TypeError(
                    f"`smartremat(...)` decorates `eqx.Module` subclasses or instances, not the "
                    f"class {target.__name__!r}. Make it inherit from `equinox.Module`, or wrap a "
                    "module instance: `smartremat(budget_mb=...)(model)`.")
            return _decorate_class(target, config)
        if isinstance(target, eqx.Module) and callable(target):
            _refuse_planned(target)
            return SmartRemat(target, config)
        raise TypeError(
            f"`smartremat(...)` should be applied to an `eqx.Module` subclass or a callable "
            f"module instance, not {type(target).__name__} {target!r:.60}. For a plain function, "
            "put it in a Module's `__call__`.")

    return decorate


def _refuse_planned(target: Any) -> None:
    """Wrapping a module that already plans its own calls would plan (and checkpoint) twice."""
    if isinstance(target, SmartRemat):
        raise TypeError(
            f"`smartremat(...)` was applied to a `SmartRemat`, a module already wrapped by "
            f"`smartremat(budget_mb={target.config.budget_mb:g})` (around a {type(target.module).__name__}); "
            "wrapping it again would plan twice. Wrap the inner module once with the budget you want: "
            "`smartremat(budget_mb=...)(wrapped.module)`.")
    found = getattr(type(target), "__smartremat__", None)
    if found is not None:
        raise TypeError(
            f"`smartremat(...)` was applied to an instance of {type(target).__name__!r}, whose class is "
            f"already decorated with `@smartremat(budget_mb={found[0].budget_mb:g})`, so it plans its own "
            "calls; wrapping it would plan twice. Call the instance as it is (or pass "
            "`budget_mb=` to `smartremat.explain`), or change the budget on the class decorator.")


def config_of(model: Any) -> tuple[Config, Callable, Any] | None:
    """`(config, original call, inner module)` of a decorated instance or wrapper, else None."""
    if isinstance(model, SmartRemat):
        return model.config, type(model.module).__call__, model.module
    found = type(model).__dict__.get("__smartremat__")
    if found is not None:
        return found[0], found[1], model
    return None
