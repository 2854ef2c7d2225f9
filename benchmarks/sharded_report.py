"""Sharded training: per-device budgets held against the compiler, over 8 simulated CPU devices.

    python benchmarks/sharded_report.py [--quick] [--json PATH]

Runs in its own process: it asks JAX for 8 CPU devices (`jax_num_cpu_devices`) and, on CPU, sets
the barrier flag of docs/facts.md, fact 1, before JAX starts a backend. A residual MLP stack is trained
data parallel over a mesh `('data',)` of 8 and over a 2-D mesh `('data', 'model')` of 4 x 2
(Megatron-style: the first weight split by columns, the second by rows), and a per-example model
called as `jax.vmap(model)(x)` on the data-parallel mesh (`dp_vmap`), all with Explicit
axes (`jax.make_mesh`'s default), parameters and inputs placed with `NamedSharding`; and data
parallel the classic way (`Mesh(jax.devices(), ("data",))`, Auto axes, `dp_classic`), where the
whole step (loss, gradient, SGD update, all arguments donated) goes through
`smartremat.filter_jit`. At
budgets between the per-device compiled temp of full remat and of no remat it reports the
plan's per-device predicted peak, the compiled per-device temp of the real sharded training
step of the decorated model, whether it fits, and the gradients against no remat.
"""

from __future__ import annotations

import os
import shutil
import sys

if "jax" not in sys.modules:
    flags = os.environ.get("XLA_FLAGS", "")
    if shutil.which("nvidia-smi") is None and "cse_barrier_expander" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_disable_hlo_passes=cse_barrier_expander").strip()

import argparse
import json
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts: JAX fixes the count then

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import smartremat
from benchmarks.models import Stack

MB = smartremat.MB


class Block(eqx.Module):
    """`x + gelu(x @ w1) @ w2`; the second matmul names its output sharding (needed when its
    contraction runs over the 'model' axis)."""

    w1: jax.Array
    w2: jax.Array
    out: P = eqx.field(static=True)

    def __init__(self, d: int, hidden: int, out: P, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.w1 = jax.random.normal(k1, (d, hidden)) / d**0.5
        self.w2 = jax.random.normal(k2, (hidden, d)) / hidden**0.5
        self.out = out

    def __call__(self, x):
        return x + jnp.matmul(jax.nn.gelu(x @ self.w1), self.w2, out_sharding=self.out)


class Uniform(eqx.Module):
    """A block under one fixed policy (the per-device floor and ceiling of the budgets)."""

    block: Block
    policy: object = eqx.field(static=True)

    def __call__(self, x):
        return eqx.filter_checkpoint(lambda b, x: b(x), policy=self.policy)(self.block, x)


def loss(model, x):
    """A real loss: squared error against targets (`tanh(x)`, sharded like `x`)."""
    return jnp.mean((model(x) - jnp.tanh(x)) ** 2)


def step_temp(model, x) -> int:
    """Per-device temp bytes of the compiled training step, on the real sharded arrays."""
    params, static = eqx.partition(model, eqx.is_array)
    step = jax.jit(jax.grad(lambda p, x: loss(eqx.combine(p, static), x)))
    return int(step.lower(params, x).compile().memory_analysis().temp_size_in_bytes)


def classic(d: int, hidden: int, n: int, batch: int) -> dict:
    """Data parallel as the Equinox docs teach it: `Mesh(jax.devices(), ("data",))` (Auto axes),
    parameters replicated and the batch split with `NamedSharding`, the whole training step (SGD
    with momentum) planned by `smartremat.filter_jit`, which compiles it with those shardings."""
    import optax

    mesh = jax.sharding.Mesh(jax.devices(), ("data",))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    model = Stack([Block(d, hidden, None, k) for k in jax.random.split(jax.random.key(0), n)])
    model = jax.tree.map(lambda a: put(a, P()) if eqx.is_array(a) else a, model)
    x = put(jax.random.normal(jax.random.key(1), (batch, d)), P("data"))
    y = put(jnp.tanh(x), P("data"))
    opt = optax.sgd(1e-2, momentum=0.9)

    def step(model, opt_state, x, y):
        value, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return value, grads, eqx.apply_updates(model, updates), opt_state

    def args(m):
        fresh = lambda t: jax.tree.map(lambda a: jnp.array(a, copy=True) if eqx.is_array(a) else a, t)  # noqa: E731
        return fresh(m), opt.init(eqx.filter(m, eqx.is_array)), fresh(x), fresh(y)

    def temp(jitted, m):
        lowered = jitted.lower(*args(m))
        return int(getattr(lowered, "lowered", lowered).compile().memory_analysis().temp_size_in_bytes)

    plain = eqx.filter_jit(step, donate="all")
    uniform = lambda pol: Stack([Uniform(b, pol) for b in model.blocks])  # noqa: E731
    full, none = temp(plain, uniform(jax.checkpoint_policies.nothing_saveable)), temp(plain, model)
    want = plain(*args(model))
    rows = []
    for b in np.linspace(full, none, 5)[1:-1] / MB:
        planned = smartremat.filter_jit(step, budget_mb=float(b), donate="all")
        with warnings.catch_warnings(record=True) as seen:  # filter_jit sees the shardings: nothing to warn of
            warnings.simplefilter("always")
            got = planned(*args(model))
            plan = smartremat.explain(planned, *args(model))
        rows.append({"warnings": [str(w.message) for w in seen], "budget_mb": float(b), "predicted_mb": plan.predicted_peak_bytes / MB,
                     "compiled_mb": temp(planned, model) / MB, "plan_compiled_mb": plan.compiled_peak_bytes / MB,
                     "policies": [blk.policy for blk in plan.blocks], "grad_rel_diff": rel_diff(got, want)})
    unplaced = jax.tree.map(lambda a: jnp.array(np.asarray(a)) if eqx.is_array(a) else a, model)  # on one device
    planned = smartremat.filter_jit(step, budget_mb=float(np.mean([full, none]) / MB))
    unplaced_diff = rel_diff(planned(unplaced, opt.init(eqx.filter(unplaced, eqx.is_array)), x, y),
                             eqx.filter_jit(step)(unplaced, opt.init(eqx.filter(unplaced, eqx.is_array)), x, y))
    return {"layout": "dp_classic", "unplaced_grad_rel_diff": unplaced_diff, "mesh": dict(mesh.shape), "full_mb": full / MB, "none_mb": none / MB,
            "predicted_none_mb": plan.no_remat_peak_bytes / MB,
            "one_device_predicted_none_mb": one_device_none(d, hidden, n, batch), "rows": rows,
            "decorator": decorator_under_classic(model, x, (full + none) / 2 / MB)}


def decorator_under_classic(model, x, budget_mb: float) -> str:
    """What `@smartremat` says inside a step over an Auto mesh, where JAX hides the shardings."""
    wrapped = smartremat.smartremat(budget_mb=budget_mb)(model)
    try:
        eqx.filter_jit(eqx.filter_grad(loss))(wrapped, x)
    except ValueError as e:
        return str(e)
    return "planned"


def rel_diff(got, want) -> float:
    return max(float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
               for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)) if jnp.max(jnp.abs(w)) > 0)


def layout(name: str, d: int, hidden: int, n: int, batch: int):
    """`(mesh, model, x)` with parameters and inputs placed on the mesh."""
    if name in ("dp", "dp_vmap"):
        mesh, w1, w2 = jax.make_mesh((8,), ("data",)), P(), P()
    else:
        mesh, w1, w2 = jax.make_mesh((4, 2), ("data", "model")), P(None, "model"), P("model", None)
    keys = jax.random.split(jax.random.key(0), n)
    out = None if name == "dp_vmap" else P("data", None)  # per example under vmap: no batch axis
    model = Stack([Block(d, hidden, out, k) for k in keys])
    shard = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    model = Stack([eqx.tree_at(lambda b: (b.w1, b.w2), b, (shard(b.w1, w1), shard(b.w2, w2)))
                   for b in model.blocks])
    x = shard(jax.random.normal(jax.random.key(1), (batch, d)), P("data", None))
    return mesh, model, x


class Batched(eqx.Module):
    """`jax.vmap(model)(x)`: the Equinox idiom of a per-example model called on a batch."""

    model: eqx.Module

    def __call__(self, x):
        return jax.vmap(self.model)(x)


def run_layout(name: str, d: int, hidden: int, n: int, batch: int) -> dict:
    mesh, model, x = layout(name, d, hidden, n, batch)
    vmapped = name == "dp_vmap"
    outer = Batched if vmapped else (lambda m: m)
    with jax.set_mesh(mesh):
        uniform = lambda pol: Stack([Uniform(b, pol) for b in model.blocks])
        full = step_temp(outer(uniform(jax.checkpoint_policies.nothing_saveable)), x)
        none = step_temp(outer(model), x)
        want = eqx.filter_jit(eqx.filter_grad(loss))(outer(model), x)
        rows = []
        for b in np.linspace(full, none, 5)[1:-1] / MB:
            wrapped = smartremat.smartremat(float(b))(model)
            got = eqx.filter_jit(eqx.filter_grad(loss))(outer(wrapped), x)
            plan = smartremat.explain(wrapped, x, vmap=vmapped)
            diff = rel_diff(got, want)
            rows.append({"budget_mb": float(b), "predicted_mb": plan.predicted_peak_bytes / MB,
                         "compiled_mb": step_temp(outer(wrapped), x) / MB,
                         "plan_compiled_mb": plan.compiled_peak_bytes / MB,
                         "policies": [blk.policy for blk in plan.blocks], "grad_rel_diff": diff})
    return {"layout": name, "mesh": dict(mesh.shape), "full_mb": full / MB, "none_mb": none / MB,
            "predicted_none_mb": plan.no_remat_peak_bytes / MB,
            "one_device_predicted_none_mb": one_device_none(d, hidden, n, batch), "rows": rows}


def one_device_none(d: int, hidden: int, n: int, batch: int) -> float:
    """The same model and global batch on one device: smartremat's predicted no-remat peak."""
    keys = jax.random.split(jax.random.key(0), n)
    model = Stack([Block(d, hidden, None, k) for k in keys])
    x = jax.ShapeDtypeStruct((batch, d), jnp.float32)
    return smartremat.explain(model, x, budget_mb=1e6).no_remat_peak_bytes / MB


def table(result: dict) -> list[str]:
    lines = [f"### {result['layout']} mesh {result['mesh']}: per-device compiled temp, full remat "
             f"{result['full_mb']:.2f} MB, no remat {result['none_mb']:.2f} MB", "",
             f"Predicted no-remat peak per device {result['predicted_none_mb']:.2f} MB; the same model "
             f"and global batch planned on one device: {result['one_device_predicted_none_mb']:.2f} MB.", "",
             "| budget MB | predicted MB | compiled MB (real sharded step) | fits | policies | grad rel diff |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        fits = "yes" if r["compiled_mb"] <= r["budget_mb"] else "NO"
        pols = " ".join(p.replace("_saveable", "").replace("nothing", "full") for p in r["policies"])
        lines.append(f"| {r['budget_mb']:.2f} | {r['predicted_mb']:.2f} | {r['compiled_mb']:.2f} | {fits} | "
                     f"{pols} | {r['grad_rel_diff']:.1e} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (the test runs this)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None, help="write the markdown tables here")
    args = ap.parse_args()
    d, hidden, n, batch = (32, 256, 4, 4096) if args.quick else (256, 1024, 6, 4096)
    results = [run_layout(name, d, hidden, n, batch) for name in ("dp", "2d", "dp_vmap")]
    results.append(classic(d, hidden, n, batch))
    lines = [f"Sharded fit, jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].device_kind}; "
             f"{n} blocks d={d} hidden={hidden}, global batch {batch}", ""]
    for r in results:
        lines += table(r) + [""]
    lines += ["`@smartremat` inside a step over the classic (Auto) mesh, at the half-way budget:", "",
              "> " + results[-1]["decorator"], ""]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
