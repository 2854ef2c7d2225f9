"""What XLA:TPU holds: by which figure it refuses a program, and whether every program it compiles
runs (issue 38: `"auto"`'s budget, the device's memory less the step's arguments and outputs not
aliased, left out `dots_with_no_batch_dims_saveable` on the scanned float32 check at `--precision
highest`, a program of 13990 MB of temp that ran, 8% faster than the full remat `"auto"` chose).

    python studies/capacity.py [--ballast 0,1,2,2.5,3] [--donated 2,4,6] [--out docs/results]

The step is `studies/pressure.py`'s (the accelerator check's scanned GPT-2-medium shape, float32,
batch 8, Adam, parameters and optimizer state donated) under `dots_with_no_batch_dims_saveable`
on every iteration, with a ballast argument of `G` GB that it reads one element of: kept
(`--ballast`: not donated, it stays beside the step) or donated and returned (`--donated`: aliased
to an output, as the training state is). For each: `memory_analysis()` and whether one step runs,
or the compiler's refusal with the figure it names. One JSON line per program, and the table in
`<out>/capacity_<device>.json`.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (the CPU flag, only where there is no accelerator)

import argparse
import gc
import json
import pathlib
import re
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from studies.pressure import GB, OPT, SHAPES, forward, host_state, record


def make_step(static: Any, donated: bool) -> Any:
    """The step under dots_nb on every iteration; the ballast donated and returned, or kept."""
    def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
        model = eqx.combine(params, static)
        logits = jax.vmap(lambda t: forward(model, t, "dots_nb", 0, "dots_nb"))(tokens[:, :-1]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    def step(params: Any, opt_state: Any, tokens: jax.Array, ballast: jax.Array) -> tuple:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = OPT.update(grads, opt_state, params)
        loss = loss + 0 * ballast[0].astype(loss.dtype)
        out = (loss, optax.apply_updates(params, updates), opt_state)
        return (*out, ballast + 1) if donated else out

    return jax.jit(step, donate_argnums=(0, 1, 3) if donated else (0, 1))


def probe(host: Any, static: Any, tokens: jax.Array, ballast_gb: float, donated: bool) -> dict:
    params = jax.tree.map(jnp.asarray, host)
    opt_state = OPT.init(params)
    ballast = jnp.zeros((max(1, int(ballast_gb * GB) // 2),), jnp.bfloat16)
    row: dict = {"ballast_gb": ballast_gb, "donated": donated}
    t0 = time.perf_counter()
    try:
        compiled = make_step(static, donated).lower(params, opt_state, tokens, ballast).compile()
    except Exception as e:  # noqa: BLE001 - a refusal is a row
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return {**row, "refused": str(e).strip().splitlines()[0]}
    m = compiled.memory_analysis()
    row.update(compile_s=time.perf_counter() - t0, temp_gb=m.temp_size_in_bytes / GB,
               argument_gb=m.argument_size_in_bytes / GB, output_gb=m.output_size_in_bytes / GB,
               alias_gb=m.alias_size_in_bytes / GB, code_gb=m.generated_code_size_in_bytes / GB)
    row["in_use_before_gb"] = (jax.devices()[0].memory_stats() or {}).get("bytes_in_use", 0) / GB
    try:
        jax.block_until_ready(compiled(params, opt_state, tokens, ballast))
        row["ran"] = True
    except Exception as e:  # noqa: BLE001 - running out of memory at run time is the answer
        row.update(ran=False, error=str(e).strip().splitlines()[0])
    del params, opt_state, ballast, compiled
    gc.collect()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ballast", default="0,1,2,2.5,3")
    parser.add_argument("--donated", default="2,4,6")
    parser.add_argument("--size", choices=list(SHAPES), default="gpt2-medium")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/results"))
    args = parser.parse_args()
    device = jax.devices()[0]
    path = args.out / f"capacity_{re.sub(r'[^a-z0-9]+', '_', device.device_kind.lower())}.json"
    stats = device.memory_stats() or {}
    result: dict = {"device": device.device_kind, "jax": jax.__version__, "bytes_limit_gb": stats.get("bytes_limit", 0) / GB,
                    "command": " ".join(["python", *sys.argv]), "runs": []}
    host, static, tokens = host_state(args.size, "float32", 8)
    probes = [(float(g), False) for g in args.ballast.split(",") if g] + [(float(g), True) for g in args.donated.split(",") if g]
    for g, donated in probes:
        record(result, path, probe(host, static, tokens, g, donated))


if __name__ == "__main__":
    main()
