"""smartremat: choose `jax.checkpoint` placement and policies for an Equinox module under a memory budget."""

from ._cache import clear_caches as clear_caches
from ._decorator import SmartRemat as SmartRemat
from ._decorator import smartremat as smartremat
from ._explain import explain as explain
from ._env import MB as MB
from ._env import VERSION as __version__
from ._plan import Plan as Plan
from ._plan import PlanBlock as PlanBlock
from ._plan import PolicyFigures as PolicyFigures
from ._serialise import load_plan as load_plan
from ._filter_jit import filter_jit as filter_jit

