"""What an infeasible budget costs on the accelerator: the wall time until `filter_jit` raises the
error that states the lowest budget it reaches, beside one compile of the plain step, and the
compiles it made by what they are for (`benchmarks/planning_time.py`).

    python studies/infeasible_budget.py                       # on the TPU: 2 layers, d=768
    python studies/infeasible_budget.py --layers 2 --d 96     # small, on the CPU

The model: the accelerator check's `SequenceGPT`, unrolled, T=512, vocab 8192, 12 heads (4 below
d=768), batch 8, Adam, every argument donated; the budget 1 MB, below any plan's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (sets the CPU flag before JAX starts)

import equinox as eqx
import jax

import smartremat
from benchmarks.accelerator_check import OPT, step
from benchmarks.models import SequenceGPT
from benchmarks.planning_time import compile_breakdown, recorded_compiles

os.environ.setdefault("SMARTREMAT_DISK_CACHE", "0")  # it plans, it reads no old plan
MB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    heads = 12 if args.d >= 768 else 4
    model = SequenceGPT(layers=args.layers, d=args.d, heads=heads, seq=512, vocab=8192, key=jax.random.key(0),
                        scanned=False)
    opt_state = OPT.init(eqx.filter(model, eqx.is_array))
    tokens = jax.random.randint(jax.random.key(1), (args.batch, 513), 0, 8192)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, smartremat {smartremat.__version__}; "
          f"SequenceGPT(layers={args.layers}, d={args.d}, heads={heads}, seq=512, vocab=8192), batch {args.batch}")
    t = time.perf_counter()
    plain = eqx.filter_jit(step, donate="all").lower(model, opt_state, tokens).compile()
    temp = plain.compiled.memory_analysis().temp_size_in_bytes
    print(f"plain step: one compile {time.perf_counter() - t:.1f} s, temp {temp / MB:.1f} MB", flush=True)
    with recorded_compiles() as record:
        t = time.perf_counter()
        try:
            smartremat.filter_jit(step, budget_mb=1.0, donate="all").plan(model, opt_state, tokens)
            said = "planned: the budget was not infeasible"
        except ValueError as e:
            said = str(e)
        seconds = time.perf_counter() - t
    print(f"budget_mb=1: raised after {seconds:.1f} s\n  {said}")
    for kind, (n, summed, wall) in compile_breakdown(record).items():
        print(f"  compiles, {kind}: {n} ({summed:.1f} s summed, {wall:.1f} s of wall time)")


if __name__ == "__main__":
    main()
