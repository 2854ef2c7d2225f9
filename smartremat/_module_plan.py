"""A decorated module as the planning pipeline's `Target`: "the step" is the gradient of a loss
on the module's output w.r.t. its parameters (the losses of `smartremat(loss=...)`, or the three
default ones), compiled with each candidate plan; the head after a stack's last block refines the
model (`_head`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from ._env import MB, barrier_hint
from ._head import in_place
from ._key import PlanKey, module_key
from ._model import Config, MemoryModel, as_notes, assignment_of, build_model, unplanned
from ._plan import Plan
from ._planner import Runs, planned
from ._policies import no_policy_error
from ._profile import n_module_leaves
from ._search import FLOOR_SCOPE
from ._spec import CallSpec, shardings_hidden
from ._tune import Timed
from ._verify import compiled_step, timed_step

logger = logging.getLogger("smartremat")


@dataclass(frozen=True)
class ModuleTarget:
    """`call(module, *args, **kwargs)` with the abstract signature `spec`."""

    call: Callable
    spec: CallSpec
    module: Any

    @property
    def name(self) -> str:
        return type(self.module).__name__

    def key(self) -> PlanKey:
        return module_key(self.call, self.spec)

    def model(self, config: Config, progress: Callable[[str], None], scans: bool = True) -> MemoryModel:
        return build_model(self.call, self.spec, self.module, config, progress, scans)

    def refined(self, model: MemoryModel, config: Config) -> tuple[MemoryModel, Config]:
        """The head after the stack's last block (`_head.in_place`), with calibration; `model` as it
        is where that measure fails: it only refines the model."""
        if not config.calibrate:
            return model, config
        try:
            return in_place(model, self.call, self.spec, config.losses[0]), config
        except Exception as e:
            logger.debug("smartremat: the head after the last block was not measured (%s: %s)", type(e).__name__, e)
            return model, config

    def runs(self, model: MemoryModel, choice: tuple[int, ...]) -> Runs:
        return (assignment_of(model, choice),)

    def measure(self, runs: Runs, config: Config, every_loss: bool) -> tuple[int, float]:
        return compiled_step(self.call, self.spec, runs[0], config.losses if every_loss else config.losses[:1])

    def losses(self, config: Config) -> int:
        return len(config.losses)

    def timed(self, runs: Runs, config: Config) -> Timed:
        return timed_step(self.call, self.spec, runs[0], config.losses[0])

    def too_low(self, config: Config, model: MemoryModel, floor: int, compiled: bool) -> Exception:
        return infeasible(config, self.spec, floor, compiled, unplanned(model))

    def notes(self, model: MemoryModel) -> tuple[str, ...]:
        return ()

    #: Its programs (the module's gradient under its losses) stand in for the step that calls it.
    stands_in = True
    #: `_head.in_place` leaves a scanned model as it is: its scans' bodies are calibrated at once.
    refines_scans = False


def get_plan(call: Callable, spec: CallSpec, module: Any, config: Config) -> Plan:
    """The plan of the module's call for this signature and config, made once (`_planner.planned`);
    what runs is its `assignment`."""
    return planned(ModuleTarget(call, spec, module), config).plan


def infeasible(config: Config, spec: CallSpec, floor: int, compiled: bool, reasons: tuple[str, ...] = ()) -> ValueError:
    empty = no_policy_error(config.policies, config.budget_mb, floor)
    if empty is not None:
        return empty
    shapes = ", ".join(f"{d.dtype}{list(d.shape)}" for d in spec.dynamic[n_module_leaves(spec):])
    up = math.ceil(floor / MB * 100) / 100
    lowest, kind = (("the lowest peak of the remat plans smartremat compiled for this module", f"compiled temp bytes of the training "
                     f"step; {FLOOR_SCOPE}") if compiled else
                    ("the lowest peak smartremat's model predicts for a remat plan of this module", "predicted by smartremat's model"))
    return ValueError(
        f"`smartremat(budget_mb={config.budget_mb:g})` is below {lowest} on inputs "
        f"({shapes}): {floor / MB:.3f} MB ({kind}). Raise "
        f"`budget_mb` to at least {up:.2f}, lower the batch size, or name finer blocks with "
        "`blocks=` so that smaller pieces can be recomputed." + as_notes(reasons) + _unseen_sharding(spec)
        + barrier_hint()
    )


def _unseen_sharding(spec: CallSpec) -> str:
    """Several devices, no sharding seen: say why the figures are for one device, and what to do."""
    if not shardings_hidden(spec):
        return ""
    return (
        f" These figures are for one device running the whole call: smartremat sees no sharding on "
        f"it although {jax.device_count()} devices are present. If the step runs over a "
        "`jax.sharding.Mesh` whose axes are Auto (e.g. `Mesh(jax.devices(), ('data',))` with "
        "`NamedSharding` inputs), JAX hides each device's share inside `jit`: plan the whole step "
        "with `smartremat.filter_jit(step, budget_mb=...)`, which compiles it with your arguments' "
        "shardings and holds the budget per device, or make the mesh with Explicit axes "
        "(`jax.make_mesh(shape, names)`), whose shardings smartremat reads."
    )
