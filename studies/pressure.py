"""Why saving more can be slower on a TPU: the bytes a plan keeps, or how close its program comes
to the chip's memory (issue 38: `"auto"` chose the fewest FLOPs and ran 5.7% slower than
`dots_with_no_batch_dims_saveable` on the scanned bfloat16 accelerator check).

    python studies/pressure.py [--batch 8] [--steps 10] [--dtypes bfloat16,float32] [--size tiny]
        [--out docs/results]

The model is the accelerator check's (`benchmarks.models.SequenceGPT`, GPT-2-medium shape,
scanned), its step the check's (cross-entropy, gradient, Adam, parameters and optimizer state
donated). Two questions, each answered by programs that differ in one thing only:

- **kept bytes**: the first `k` iterations of the scan under `dots_saveable` (which keeps the
  attention scores), the rest under `dots_with_no_batch_dims_saveable` (which recomputes them),
  for growing `k`. Each iteration moved over keeps about the same bytes more and recomputes the
  same FLOPs less, so a time linear in `k` from small `k` on is a cost per byte kept.
- **pressure**: the `dots_with_no_batch_dims_saveable` step with an extra argument of `G` GB that
  the step reads one element of (`ballast`): the same computation, with `G` GB less of the chip
  free. A slower step here is the compiler's reaction to a program near the chip's limit.

Each program is compiled (its temp, argument and output bytes read from `memory_analysis()`), run
once, then timed over `--steps` steps (median). One line per program is printed and the whole
table written to `<out>/pressure_<device>.json` after each program.
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
import statistics
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.models import SequenceGPT

cp = jax.checkpoint_policies
POLICIES = {"full": cp.nothing_saveable, "dots_nb": cp.dots_with_no_batch_dims_saveable, "dots": cp.dots_saveable}
SHAPES = {"gpt2-medium": dict(layers=24, d=1024, heads=16, seq=1024, vocab=32768),
          "tiny": dict(layers=24, d=32, heads=2, seq=16, vocab=64)}
OPT = optax.adam(1e-4)
GB = 1e9


def forward(model: SequenceGPT, tokens: jax.Array, first: str, k: int, rest: str) -> jax.Array:
    """The scanned model on one sequence, iterations `[:k]` under `first`, `[k:]` under `rest`."""
    x = jax.vmap(model.embed)(tokens) + model.pos[: tokens.shape[0]]
    params, static = eqx.partition(model.blocks, eqx.is_array)
    for policy, piece in ((first, jax.tree.map(lambda a: a[:k], params)),
                          (rest, jax.tree.map(lambda a: a[k:], params))):
        if jax.tree.leaves(piece)[0].shape[0] == 0:
            continue
        body = lambda x, p: (eqx.combine(p, static)(x), None)  # noqa: E731
        body = body if policy == "none" else jax.checkpoint(body, policy=POLICIES[policy])
        x, _ = jax.lax.scan(body, x, piece)
    return jax.vmap(model.head)(jax.vmap(model.ln_f)(x))


def make_step(static: Any, first: str, k: int, rest: str) -> Any:
    def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
        model = eqx.combine(params, static)
        logits = jax.vmap(lambda t: forward(model, t, first, k, rest))(tokens[:, :-1]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    def step(params: Any, opt_state: Any, tokens: jax.Array, ballast: jax.Array) -> tuple:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return loss + 0 * ballast[0].astype(loss.dtype), optax.apply_updates(params, updates), opt_state

    return jax.jit(step, donate_argnums=(0, 1))


def run(host: Any, static: Any, tokens: jax.Array, first: str, k: int, rest: str, ballast_gb: float,
        steps: int) -> dict:
    params = jax.tree.map(jnp.asarray, host)
    opt_state = OPT.init(params)
    ballast = jnp.zeros((max(1, int(ballast_gb * GB) // 2),), jnp.bfloat16)
    t0 = time.perf_counter()
    compiled = make_step(static, first, k, rest).lower(params, opt_state, tokens, ballast).compile()
    row: dict = {"compile_s": time.perf_counter() - t0}
    m = compiled.memory_analysis()
    row.update(temp_gb=m.temp_size_in_bytes / GB, argument_gb=m.argument_size_in_bytes / GB,
               output_gb=m.output_size_in_bytes / GB, alias_gb=m.alias_size_in_bytes / GB)
    _, params, opt_state = jax.block_until_ready(compiled(params, opt_state, tokens, ballast))
    times = []
    for _ in range(steps):
        t1 = time.perf_counter()
        _, params, opt_state = jax.block_until_ready(compiled(params, opt_state, tokens, ballast))
        times.append(time.perf_counter() - t1)
    row.update(step_ms=1e3 * statistics.median(times), min_ms=1e3 * min(times))
    del params, opt_state, ballast, compiled
    gc.collect()
    return row


def host_state(size: str, dtype: str, batch: int) -> tuple[Any, Any, jax.Array]:
    """The check's scanned model of `size` in `dtype`: its arrays on the host, its static part, and
    a batch of `batch` token sequences."""
    shape = SHAPES[size]
    model = SequenceGPT(**shape, key=jax.random.key(0), scanned=True, dtype=jnp.dtype(dtype))
    params, static = eqx.partition(model, eqx.is_array)
    tokens = jax.random.randint(jax.random.key(1), (batch, shape["seq"] + 1), 0, shape["vocab"])
    return jax.tree.map(np.asarray, params), static, tokens


def record(result: dict, path: pathlib.Path, row: dict) -> None:
    """Add `row` to `result`, print it, and write the whole of `result` to `path`."""
    result["runs"].append(row)
    print(json.dumps(row), flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--size", choices=list(SHAPES), default="gpt2-medium")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/results"))
    args = parser.parse_args()
    device = jax.devices()[0]
    path = args.out / f"pressure_{re.sub(r'[^a-z0-9]+', '_', device.device_kind.lower())}.json"
    result: dict = {"device": device.device_kind, "jax": jax.__version__, "batch": args.batch,
                    "command": " ".join(["python", *sys.argv]), "runs": []}
    plans = {"bfloat16": [("full", 0, "full", 0), ("dots_nb", 0, "dots_nb", 0), ("dots", 4, "dots_nb", 0),
                          ("dots", 8, "dots_nb", 0), ("dots", 12, "dots_nb", 0), ("dots", 24, "dots_nb", 0),
                          ("none", 2, "dots_nb", 0), ("none", 4, "dots_nb", 0), ("dots_nb", 0, "dots_nb", 3),
                          ("dots_nb", 0, "dots_nb", 5), ("dots_nb", 0, "dots_nb", 7), ("dots", 4, "dots_nb", 5),
                          ("full", 0, "full", 7)],
             "float32": [("full", 0, "full", 0), ("dots_nb", 0, "dots_nb", 0), ("dots_nb", 0, "dots_nb", 3),
                         ("full", 0, "full", 6)]}
    for dtype in args.dtypes.split(","):
        host, static, tokens = host_state(args.size, dtype, args.batch)
        for first, k, rest, ballast in plans[dtype]:
            name = f"{dtype} {first}[:{k}] {rest} ballast {ballast} GB"
            try:
                row = run(host, static, tokens, first, k, rest, ballast, args.steps)
            except Exception as e:  # noqa: BLE001 - a refusal is a row
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                row = {"refused": str(e).strip().splitlines()[0]}
            row.update(name=name, dtype=dtype, first=first, k=k, rest=rest, ballast_gb=ballast)
            record(result, path, row)


if __name__ == "__main__":
    main()
