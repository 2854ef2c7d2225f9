"""One process of the two-process `jax.distributed` job of tests/test_distributed.py, on the CPU:
`python -m tests.distributed_job <process id> <port> <tune 0|1> <out.json> <store|broadcast|infeasible>`.

The batch is sharded over the job's two devices (one per process), the model replicated. Each
process plans the SGD step with `smartremat.filter_jit` at a budget below its temp without remat,
runs it, and writes what it ran: the assignments, the compiled temp per device, how many plans it
made itself, and the step's loss and new parameters against `eqx.filter_jit` without remat. In
process 1, `tune=True`'s timings are reversed, so that a process planning for itself would choose
differently. With `broadcast`, the plan goes through public `multihost_utils` instead of the
coordination service's key-value store (private API); with `infeasible`, the budget is below
any plan's and each process writes the error it raised."""

from __future__ import annotations

import json
import os
import sys

pid, port, tune, out = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", sys.argv[4]
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_disable_hlo_passes=cse_barrier_expander").strip()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)

import smartremat  # noqa: E402
from smartremat import _options, _planner, _share  # noqa: E402
from tests.models import Transformer  # noqa: E402

if sys.argv[5] == "broadcast":
    _share.key_value_store = lambda: None
made = []
make_plan = _planner.make_plan
_planner.make_plan = lambda *a: made.append(1) or make_plan(*a)
if pid == 1:  # a process timing for itself would see other times: here, the reverse order
    timings = _planner.timings
    _planner.timings = lambda steps: [tuple(-t for t in ts) for ts in timings(steps)]


def loss(model, x):
    return jnp.mean(model(x) ** 2)


def step(model, x):
    value, grads = eqx.filter_value_and_grad(loss)(model, x)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, model, grads)


mesh = Mesh(np.array(jax.devices()), ("data",))
model = Transformer(4, 32, 4, jax.random.key(0))
model = jax.device_put(model, NamedSharding(mesh, PartitionSpec()))
local = np.asarray(jax.random.normal(jax.random.key(1 + pid), (4, 64, 32)))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("data")), local)

plain = eqx.filter_jit(step)
no_remat = plain.lower(model, x).compile().compiled.memory_analysis().temp_size_in_bytes
budget_mb = 0.6 * no_remat / 2**20
if sys.argv[5] == "infeasible":
    try:
        # whole blocks only: an infeasible budget compiles every candidate to state the floor, and the
        # subject here is process 0's error reaching process 1, not the nested options
        smartremat.filter_jit(step, budget_mb=0.01, nested=False)(model, x)
    except ValueError as e:
        error = str(e)
    with open(out, "w") as f:
        json.dump({"process": pid, "made": len(made), "error": error}, f)
    jax.distributed.shutdown()
    sys.exit(0)
# whole blocks only, as below: the subject is one plan shared by both processes, not the nested
# options (a third of the block profile's compiles)
planned = smartremat.filter_jit(step, budget_mb=budget_mb, tune=tune, nested=False)
value, new = planned(model, x)
want_value, want = plain(model, x)
plan = planned.plan(model, x)
runs = planned._entry((model, x), {})[0][0].assignments
gather = lambda t: [np.asarray(a) for a in jax.tree.leaves(t)]  # replicated: whole on each process
rel = max(float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)) for a, b in zip(gather(new), gather(want)))
with open(out, "w") as f:
    json.dump({"process": pid, "made": len(made), "budget_mb": budget_mb,
               "runs": [_options.assignment_to_json(a) for a in runs],
               "no_remat_temp": no_remat, "temp": planned.lower(model, x).compile().memory_analysis().temp_size_in_bytes,
               "loss": float(value), "want_loss": float(want_value), "max_rel_param": rel,
               "compiles": plan.compiles, "timed": len(plan.timed), "notes": list(plan.notes)}, f)
jax.distributed.shutdown()
