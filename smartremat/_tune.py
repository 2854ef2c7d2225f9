"""`tune=True`: time the few best fitting candidates of the whole step and keep the fastest
(docs/how-it-works.md, step 5). Compiled FLOPs do not order step times (docs/facts.md, facts 5 and
17). Timing noise is sampling noise, not a per-compile offset (fact 18); on simulated tunings over
measured rounds (fact 19, `studies/tune_rules.py`) the lowest median missed fewer switches to plans
3-11% faster than a signed-rank test or any other statistic tried. The times are kept in this
process, and a tuned plan is stored on disk like any plan.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from ._cache import KeyedCache
from ._jax_private import carrying_config
from ._search import Choice, Outcome, CandidateFigures, spread

#: Frontier points of lower predicted peak than the search's choice that are timed beside it.
TUNE_FRONTIER = 3
#: Interleaved timing rounds per candidate at least (after two warm-up runs each); the median counts.
TUNE_ROUNDS = 25
#: Shorter steps get rounds for about `TUNE_SECONDS` per candidate, up to `TUNE_MAX_ROUNDS`: on the
#: lone tutorial block (20 ms steps, docs/facts.md, fact 19) 25 rounds picked a plan over 3% slower
#: than the fastest in 38% of simulated tunings, 100 rounds in 6%.
TUNE_SECONDS = 2.0
TUNE_MAX_ROUNDS = 200
ORDER_SEED = 0  #: the seed of `round_orders`
#: Synthetic floating inputs are uniform in `[-SCALE, SCALE]`: a deep stack of them neither
#: overflows nor reaches denormals, which would time other arithmetic.
SCALE = 0.05


@dataclass(frozen=True)
class Timed:
    """One candidate step to time: `build()` compiles the executable the step runs (called with
    arrays of `avals`); arguments at `donated` are consumed by a call, so each run gets copies."""

    key: Hashable
    build: Callable[[], Any]
    avals: tuple
    donated: tuple[int, ...] = ()


_TIMES: KeyedCache[tuple[tuple[float, ...], ...]] = KeyedCache()


def synthetic(avals: Sequence[jax.ShapeDtypeStruct], seed: int = 0) -> tuple[jax.Array, ...]:
    """Concrete arrays of `avals`' shapes and dtypes (placed with their shardings where those are
    concrete): small uniform floats, zeros otherwise (valid indices, `False` masks, PRNG keys)."""
    keys = jax.random.split(jax.random.key(seed), max(len(avals), 1))
    return tuple(_placed(_array(k, a), getattr(a, "sharding", None)) for k, a in zip(keys, avals))


def _array(key: jax.Array, a: jax.ShapeDtypeStruct) -> jax.Array:
    if jnp.issubdtype(a.dtype, jnp.floating) or jnp.issubdtype(a.dtype, jnp.complexfloating):
        return jax.random.uniform(key, a.shape, jnp.float32, -SCALE, SCALE).astype(a.dtype)
    return jnp.zeros(a.shape, a.dtype)


def _placed(x: jax.Array, sharding: Any) -> jax.Array:
    """`x` with `sharding`, if that names concrete devices; an abstract one (from a tracer)
    leaves `x` on the default device, which only the timing sees."""
    if sharding is None or not hasattr(sharding, "device_set"):
        return x
    try:
        return jax.device_put(x, sharding)
    except (ValueError, TypeError):  # an abstract mesh; out of memory and other runtime errors are raised
        return x


def timings(steps: Sequence[Timed], rounds: int | None = None) -> list[tuple[float, ...]]:
    """Seconds per call of each step in each of `rounds` interleaved rounds (after two warm-up
    calls each; by default `rounds_for` the warm steps' median time), so that drift falls on all
    alike; each round in a fresh order (`round_orders`, docs/facts.md, fact 18). The steps are
    compiled in parallel and share synthetic inputs per signature; timed once per process."""
    return list(_TIMES.get((tuple(s.key for s in steps), rounds), lambda: _time_steps(steps, rounds)))


def rounds_for(seconds: float, per_step: float = TUNE_SECONDS, floor: int = TUNE_ROUNDS,
               cap: int = TUNE_MAX_ROUNDS) -> int:
    """Timing rounds for steps of about `seconds` each: enough for `per_step` seconds per step,
    no fewer than `floor` and (unless `floor` is more) no more than `cap`."""
    return max(floor, min(cap, math.ceil(per_step / max(seconds, 1e-9))))


def _time_steps(steps: Sequence[Timed], rounds: int | None) -> tuple[tuple[float, ...], ...]:
    with ThreadPoolExecutor(max(1, min(len(steps), os.cpu_count() or 1))) as pool:
        executables = list(pool.map(carrying_config(lambda s: s.build()), steps))
    inputs = {_signature(s.avals): s.avals for s in steps}  # candidates of one signature share inputs
    inputs = {sig: synthetic(avals) for sig, avals in inputs.items()}
    runs = [TimedRun(e, inputs[_signature(s.avals)], s.donated) for e, s in zip(executables, steps)]
    warm = [[r.once(), r.once()][1] for r in runs]  # warm-up
    rounds = agreed(rounds_for(statistics.median(warm))) if rounds is None else rounds  # one count per job
    times: list[list[float]] = [[] for _ in runs]
    for order in round_orders(len(runs), rounds):
        for j in order:
            times[j].append(runs[j].once())
    return tuple(tuple(t) for t in times)


def round_orders(n: int, rounds: int, seed: int = ORDER_SEED) -> list[list[int]]:
    """The order of `n` steps in each of `rounds` interleaved rounds: shuffled afresh each round
    (seeded: every process times alike). A step run right after a memory-hungry one is slowed, by
    up to 23% on this CPU (docs/facts.md, fact 18): a merely rotated order makes one step pay."""
    rng = random.Random(seed)
    return [rng.sample(range(n), n) for _ in range(rounds)]


def agreed(value: int) -> int:
    """Process 0's `value` in every process of a `jax.distributed` job (a collective: all of them
    call it together), `value` itself in a job of one."""
    if jax.process_count() == 1:
        return value
    with jax.ensure_compile_time_eval():
        return int(multihost_utils.broadcast_one_to_all(np.int64(value)))


def _signature(avals: Sequence[jax.ShapeDtypeStruct]) -> tuple:
    return tuple((a.shape, str(a.dtype), str(getattr(a, "sharding", None))) for a in avals)


@dataclass
class TimedRun:
    executable: Any
    args: tuple
    donated: tuple[int, ...]

    def once(self) -> float:
        args = tuple(jnp.copy(a) if i in self.donated else a for i, a in enumerate(self.args))
        jax.block_until_ready(args)
        t0 = time.perf_counter()
        jax.block_until_ready(self.executable(*args))
        return time.perf_counter() - t0


def pool(points: Sequence[Choice], uniforms: Sequence[Choice], chosen: Choice) -> list[Choice]:
    """The candidates to time: the search's choice first, every uniform plan, and up to
    `TUNE_FRONTIER` frontier points of lower predicted peak than the choice, evenly spaced
    (`points` are sorted by predicted peak)."""
    below = list(points[: points.index(chosen)]) if chosen in points else []
    return list(dict.fromkeys([chosen, *uniforms, *spread(below, TUNE_FRONTIER)]))


def tuned(outcome: Outcome, candidates: Sequence[Choice], budget: int, compiled: CandidateFigures,
          time_of: Callable[[Sequence[Choice]], list[tuple[float, ...]]],
          progress: Callable[[str], None]) -> tuple[Choice, tuple[tuple[int, float, float], ...]]:
    """`(fastest choice, timed)`: `candidates` (the search's choice first) compiled for their temp
    bytes; those that fit (under every loss) timed by `time_of` (seconds per round); the one of
    the lowest median wins (on a tie, the earlier: the search's choice first). `timed` is
    `(temp, flops, median seconds)` per candidate timed, the search's choice first."""
    compiled(*candidates)
    fits = [c for c in candidates if compiled.figures[c][0] <= budget and compiled.exact(c) <= budget]
    if outcome.choice not in fits:  # the search's choice fits by construction (compiled: `_planner.verified`
        assert outcome.compiled is not None  # returns an unconfirmed plan before tuning)
        fits.insert(0, outcome.choice)
        compiled.figures[outcome.choice] = outcome.compiled
    progress(f"timing {len(fits)} fitting candidate plan(s) ({TUNE_ROUNDS}-{TUNE_MAX_ROUNDS} rounds, "
             f"about {TUNE_SECONDS:g} s each)")
    medians = [statistics.median(r) for r in time_of(fits)]
    best = min(range(len(fits)), key=lambda i: (medians[i], i))  # fits[0] is the search's choice
    timed = tuple((*compiled.figures[c], m) for c, m in zip(fits, medians))
    return fits[best], timed
