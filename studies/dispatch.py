"""What a call of a planned step costs on the host, before the device waits: smartremat's
`filter_jit` against Equinox's `filter_jit` and its AOT-compiled step, over a model of many leaves
(the accelerator check's `SequenceGPT` with 24 blocks, tiny widths, Adam state: 928 leaves), and
the two ways smartremat finds the planned step (the full signature, `split_args` and its key, as
on ac8ba80; the key read from the leaves, `quick_split`).

    python studies/dispatch.py [--calls 40]

On a TPU, smartremat's plan ran 8.7 ms slower than the same plan placed by hand (docs/fit.md,
TPU section): one program, so the difference was the host's work per call.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (the CPU flag, only where there is no accelerator)

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import smartremat
from smartremat import internal
from benchmarks.accelerator_check import OPT, step
from benchmarks.models import SequenceGPT


def copied(tree):
    return jax.tree.map(lambda a: jnp.copy(a) if eqx.is_array(a) else a, tree)


def per_call(f, model, opt, tokens, calls: int) -> tuple[float, float]:
    """Median ms until `f` returns, and until its outputs are ready; each call fed the last outputs."""
    host, total = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        out = f(model, opt, tokens)
        t1 = time.perf_counter()
        _, model, opt = jax.block_until_ready(out)
        host.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    return statistics.median(host) * 1e3, statistics.median(total) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--calls", type=int, default=40)
    calls = ap.parse_args(argv).calls
    model = SequenceGPT(layers=24, d=32, heads=2, seq=16, vocab=64, key=jax.random.key(0))
    opt = OPT.init(eqx.filter(model, eqx.is_array))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 64)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; {len(jax.tree.leaves((model, opt)))} leaves; "
          f"median of {calls} calls, ms (until the call returns / until its outputs are ready)")
    runs = {"eqx.filter_jit(step).lower(...).compile()":
            eqx.filter_jit(step, donate="all").lower(model, opt, tokens).compile(),  # pyright: ignore[reportFunctionMemberAccess]
            "eqx.filter_jit(step)": eqx.filter_jit(step, donate="all"),
            "smartremat.filter_jit(step, budget_mb=1e6)": smartremat.filter_jit(step, budget_mb=1e6, donate="all")}
    for name, f in runs.items():
        m, o = copied(model), copied(opt)
        _, m, o = f(m, o, tokens)  # compiled (or planned) before timing
        host, total = per_call(f, m, o, tokens, calls)
        print(f"{name:45s} {host:7.2f} / {total:7.2f}")
    args = (model, opt, tokens)
    for name, find in (("split_args(...).key() (the full signature)", lambda: internal.split_args(step, args, {})[0].key()),
                       ("quick_split(...) (the key from the leaves)", lambda: internal.quick_split(step, args, {}))):
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            find()
            times.append(time.perf_counter() - t0)
        print(f"{name:45s} {statistics.median(times) * 1e3:7.2f}")


if __name__ == "__main__":
    main()
