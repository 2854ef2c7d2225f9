"""Every process of a `jax.distributed` job runs the same plan. Each process compiles the step
itself, and two processes running different programs hang or fail at their first collective;
`tune=True`'s timings and each host's disk cache can differ between them. So process 0 plans
(or reads its disk cache) and publishes the plan, and every other process runs what it publishes:
one planning per job, never a second opinion.

Process 0 publishes a sequence of messages per plan: a request to time candidate steps
(`tune=True`: a sharded step runs on every process's devices, so all of them run the candidates
together, in the same order and rounds, and process 0's clock decides), then the plan, or the
error its planning raised."""

from __future__ import annotations

import contextvars
import dataclasses
import itertools
import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from ._jax_private import key_value_store
from ._key import PlanKey
from ._options import Option, assignment_to_json
from ._plan import Plan, plan_data
from ._serialise import assignment_from_json, plan_of
from ._tune import agreed

#: How long another process waits for process 0's next message (planning at real size with
#: `tune=True` takes minutes).
WAIT_SECONDS = 3600

_ROUNDS: dict[str, int] = {}  # plans shared so far per signature: the same sequence in every process
_ERRORS = {e.__name__: e for e in (ValueError, TypeError, RuntimeError, NotImplementedError)}
_CHANNEL: contextvars.ContextVar[_Channel | None] = contextvars.ContextVar("smartremat_share", default=None)

Made = tuple[Plan, tuple]  #: the plan and what runs (one assignment per module call)


@dataclasses.dataclass
class _Channel:
    """Process 0's numbered messages about one plan."""

    name: str
    sent: int = 0

    def publish(self, data: dict) -> None:
        _publish(f"{self.name}/{self.sent}", json.dumps(data))
        self.sent += 1


def shared(key: PlanKey, menu: tuple[Option, ...], make: Callable[[], Made],
           time_runs: Callable[[list[tuple]], Any]) -> Made:
    """`make()` in process 0, published to the job's other processes, which return it without
    planning (running `time_runs(candidates)` with process 0 where it times candidates); `make()`
    itself where the job has one process. An error in process 0's planning is raised in every
    process, with process 0's message."""
    if jax.process_count() == 1:
        return make()
    n = _ROUNDS[key.signature] = _ROUNDS.get(key.signature, 0) + 1
    channel = _Channel(f"smartremat/plan/{key.signature}/{n}")
    if jax.process_index() == 0:
        return _made_here(channel, make)
    named = {o.name: o for o in menu}.__getitem__
    for k in itertools.count():
        data = json.loads(_receive(f"{channel.name}/{k}"))
        if "time" in data:
            time_runs([tuple(assignment_from_json(a, named) for a in runs) for runs in data["time"]])
        elif "error" in data:
            raise _ERRORS.get(data["type"], RuntimeError)(data["error"])
        else:
            note = f"planned by process 0 of this jax.distributed job ({jax.process_count()} processes) and shared"
            plan = plan_of(data["plan"], named)
            plan = dataclasses.replace(plan, compiles=0, notes=plan.notes + (note,))
            return plan, tuple(assignment_from_json(a, named) for a in data["runs"])
    raise AssertionError("unreachable")  # for the type checker: `itertools.count()` never ends


def _made_here(channel: _Channel, make: Callable[[], Made]) -> Made:
    token = _CHANNEL.set(channel)
    try:
        made = make()
    except Exception as e:
        channel.publish({"error": str(e), "type": type(e).__name__})
        raise
    finally:
        _CHANNEL.reset(token)
    channel.publish({"plan": plan_data(made[0]), "runs": [assignment_to_json(a) for a in made[1]]})
    return made


def timing_together(candidates: list[tuple]) -> None:
    """In process 0 of a job, while it plans: ask the other processes to time `candidates` (what
    runs, per candidate) with it, now. Elsewhere nothing."""
    channel = _CHANNEL.get()
    if channel is not None:
        channel.publish({"time": [[assignment_to_json(a) for a in runs] for runs in candidates]})


def _publish(name: str, text: str) -> None:
    store = key_value_store()
    if store is not None:
        store.key_value_set(name, text)
    else:
        _broadcast(text.encode())


def _receive(name: str) -> str:
    store = key_value_store()
    if store is not None:
        return store.blocking_key_value_get(name, WAIT_SECONDS * 1000)
    return _broadcast(b"").decode()


def _broadcast(data: bytes) -> bytes:
    """Process 0's `data` in every process, through public `multihost_utils` (a collective: every
    process calls it, in the same order)."""
    size = agreed(len(data))
    buffer = np.zeros(size, np.uint8)
    buffer[:len(data)] = np.frombuffer(data, np.uint8)
    with jax.ensure_compile_time_eval():
        return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer)))
