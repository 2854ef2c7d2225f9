"""What a block keeps for the backward: the profile's chains against long stacks, per policy.

    python studies/kept_bytes.py [--d 768] [--layers 4 8 24]

A stack of pre-LayerNorm GPT blocks (d, d/64 heads, T=512, batch 8, abstract: nothing is
allocated), each block under one policy, compiled at each depth under the mean squared error; what
one more block adds, (temp(n2) - temp(n1)) / (n2 - n1), beside the chain measures smartremat
could take from copies of one block: `temp(j, j, none) - temp(j, none)` and `temp(j, none) -
temp(none)` (the copy under `j` first, its input an argument: through d61ddb0 smartremat took the
smaller, the second only where `temp(j, none)` is above the copy's own peak), `temp(none, j, none) -
temp(none, none)` (its input a temporary: what it measures now) and the kept bytes the profile
reports (docs/fit.md, "Model error").
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (sets the CPU flag before JAX starts)
from benchmarks.strategies import UNIFORM, Ckpt

import equinox as eqx
import jax
import jax.numpy as jnp

import smartremat
from benchmarks.models import GPTBlock, Stack
from benchmarks.common import replaced
from smartremat.internal import calibration, chain_job, chainable, compiled_temps

MB = smartremat.MB
SHORT = {"none": "none", "dots_saveable": "dots", "dots_with_no_batch_dims_saveable": "dots_nb",
         "nothing_saveable": "full"}


def stack(d: int, n: int) -> Stack:
    def build() -> Stack:
        return Stack([GPTBlock(d, d // 64, k) for k in jax.random.split(jax.random.key(0), n)])

    return eqx.filter_eval_shape(build)


def compiled(d: int, n: int, policy: str) -> int:
    model = stack(d, n)
    if UNIFORM[policy] is not None:
        model = eqx.tree_at(lambda m: m.blocks, model, [Ckpt(b, UNIFORM[policy]) for b in model.blocks])
    params, static = eqx.partition(model, lambda leaf: isinstance(leaf, jax.ShapeDtypeStruct))
    step = jax.grad(lambda p, x: jnp.mean(eqx.combine(p, static)(x) ** 2))
    x = jax.ShapeDtypeStruct((8, 512, d), jnp.float32)
    return jax.jit(step).lower(params, x).compile().memory_analysis().temp_size_in_bytes


def chains(d: int) -> tuple[dict, dict]:
    """`({option: {chain label: temp bytes}}, {option: kept bytes in the profile})` of one block."""
    found: dict = {}

    def recording(raw, spec, n_module, calibrate):
        out = calibration(raw, spec, n_module, calibrate)
        at = chainable(raw[0].f, spec, n_module)
        none = raw[0].f
        for m in raw:
            jobs = {"j": [m.f, none], "jj": [m.f, m.f, none], "n": [none, none], "nj": [none, m.f, none],
                    "alone": [none]}
            temps = compiled_temps([chain_job(c, spec, n_module, at) for c in jobs.values()])
            found[m.option.name] = dict(zip(jobs, temps))
        return out

    with replaced(calibration, recording):
        smartremat.clear_caches()
        plan = smartremat.explain(smartremat.smartremat(budget_mb=1e6, verify=False, nested=False)(stack(d, 2)),
                                  jax.ShapeDtypeStruct((8, 512, d), jnp.float32))
    kept = {o.name: o.saved_bytes for o in plan.blocks[0].options}
    return found, kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 24])
    args = ap.parse_args()
    found, kept = chains(args.d)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; GPT blocks d={args.d}, T=512, batch 8; MB")
    print(f"{'policy':>8} " + " ".join(f"{f'temp n={n}':>12}" for n in args.layers)
          + f" {'per block':>10} {'(j,j,n)-(j,n)':>14} {'(j,n)-(n)':>12} {'(n,j,n)-(n,n)':>14} {'profile':>9}")
    for name, short in SHORT.items():
        temps = [compiled(args.d, n, short) for n in args.layers]
        per_block = (temps[-1] - temps[0]) / (args.layers[-1] - args.layers[0])
        c = found.get(name)
        old = (c["jj"] - c["j"]) / MB if c else float("nan")
        new = (c["nj"] - c["n"]) / MB if c else float("nan")
        first = (c["j"] - c["alone"]) / MB if c else float("nan")
        print(f"{short:>8} " + " ".join(f"{t / MB:12.2f}" for t in temps)
              + f" {per_block / MB:10.2f} {old:14.2f} {first:12.2f} {new:14.2f}"
              + f" {kept.get(name, float('nan')) / MB:9.2f}",
              flush=True)


if __name__ == "__main__":
    main()
