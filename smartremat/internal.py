"""Planner internals for the repository's benchmarks (`benchmarks/`) and studies (`studies/`).

Like `equinox.internal`: for those scripts only, with **no stability promise**. Any name here may
change, move or go in any release; code that uses smartremat needs nothing from this module.
Some names are here to be replaced while a study plans (`benchmarks.common.replaced` swaps one in
every smartremat module that holds it), not to be called.

- timing as `tune=True` times: `round_orders`, `synthetic`, `TimedRun`, `timings`;
- the memory model and its solver: `Stage`, `peak_of`, `solve`, `frontier`, `frontier_by_solving`;
- the compiles that profile a block and measure a step: `measuring_options`, `profiling_options`,
  `compiled_temp`, `compiled_temps`, `calibration`, `chainable`, `chain_job`;
- the whole-step planner: `tail`, `StepTarget`, `verified`; a compile the device refuses, `Refused`; the
  search's `TIE_MARGIN`.
"""

# timing as `tune=True` times: run.py, studies/timing_order.py, timing_noise.py, tune_vs_bench.py
from ._tune import round_orders as round_orders
# tune=True's synthetic inputs, one timed call, the timing of candidates: studies/timing_noise.py,
# tune_vs_bench.py
from ._tune import synthetic as synthetic
from ._tune import TimedRun as TimedRun
from ._tune import timings as timings
# the memory model's stages and the peak of a choice: planning_time.py, studies/mixed_plans.py,
# step_model.py
from ._memory import Stage as Stage
from ._memory import peak_of as peak_of
# the solver and the frontier: planning_time.py
from ._solve import solve as solve
from ._solve import frontier as frontier
from ._solve import frontier_by_solving as frontier_by_solving
# the XLA options of measuring and profiling compiles: planning_time.py
from ._env import measuring_options as measuring_options
from ._env import profiling_options as profiling_options
# the compiles that profile a block and measure a step: planning_time.py, studies/kept_bytes.py
from ._profile import compiled_temp as compiled_temp
from ._profile import compiled_temps as compiled_temps
from ._profile import calibration as calibration
from ._profile import chainable as chainable
from ._profile import chain_job as chain_job
# the whole-step planner's tail and verification: studies/step_model.py
from ._step import quick_split as quick_split
from ._step import split_args as split_args
from ._step_plan import tail as tail
# the whole-step target, whose reference skip studies/reference_skip.py turns off
from ._step_plan import StepTarget as StepTarget
from ._planner import verified as verified
# a compile the device refuses for memory: studies/step_model.py
from ._refused import Refused as Refused
# the search's tie margin, replaced (`benchmarks.common.replaced`) while a check plans with another:
# accelerator_check.py's budgets ending in /tie=<share>
from ._search import TIE_MARGIN as TIE_MARGIN

__all__ = [
    "quick_split", "split_args", "round_orders", "synthetic", "TimedRun", "timings", "Stage", "peak_of", "solve", "frontier",
    "frontier_by_solving", "measuring_options", "profiling_options", "compiled_temp", "compiled_temps",
    "calibration", "chainable", "chain_job", "tail", "StepTarget", "verified", "Refused", "TIE_MARGIN",
]
