"""Whether XLA's effort options make planning's compiles cheaper at the same figures.

    python studies/compile_effort.py [--size gpt2-medium|tiny] [--layout scanned|unrolled]
        [--dtype bfloat16] [--batch 8] [--efforts default,exec-1,O0,O1,mem-O0] [--first N] [--warmup] [--whole dots_nb]

The accelerator check's step (`benchmarks/accelerator_check.py`) is planned by
`smartremat.filter_jit(step, budget_mb="auto")` on abstract arguments until the first block's
profile asks for its compiles (`smartremat.internal.compiled_temps`: the block's gradient alone
under each policy, its copies in a row); planning stops there. Each recorded program is then
lowered once (the seconds printed), then compiled one at a time under each set of options (`--efforts`: XLA's default; `exec-1`:
`exec_time_optimization_effort=-1`; `O0`, `O1`: `optimization_level`; `mem-O0`:
`memory_fitting_level`), and the study prints each set's summed compile seconds and whether every
program's temp bytes equal the default's (the figures the model is built from). `--whole`: the
whole step under that fixed policy too, once per set (its temp bytes and compile seconds).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (the CPU flag, only where there is no accelerator)

import argparse
import time
from typing import Any, Callable

import equinox as eqx
import jax

import smartremat
from benchmarks.accelerator_check import SIZES, Check, refused, step
from benchmarks.common import replaced
from smartremat.internal import compiled_temps

MB = smartremat.MB
EFFORTS: dict[str, dict[str, Any]] = {
    "default": {}, "exec-1": {"exec_time_optimization_effort": -1.0},
    "O0": {"optimization_level": 9}, "O1": {"optimization_level": 19}, "mem-O0": {"memory_fitting_level": 9},
}


class _Stop(Exception):
    """Raised by the recording stand-in once it has the first profile's programs: planning stops."""


def abstract(c: Check, name: str) -> tuple[Any, Any]:
    """The run's model and Adam state as `jax.ShapeDtypeStruct`s (nothing on the device)."""
    model, opt_state = eqx.filter_eval_shape(c.fresh, name)
    return model, opt_state


def profile_jobs(c: Check) -> list[tuple[Callable, tuple]]:
    """The programs of the first block profile `filter_jit(step, budget_mb="auto")` compiles."""
    jobs: list = []

    def recording(js: Any) -> list:
        jobs.extend(js)
        raise _Stop

    model, opt_state = abstract(c, "smartremat")
    tokens = jax.ShapeDtypeStruct(c.tokens.shape, c.tokens.dtype)
    with replaced(compiled_temps, recording):
        smartremat.clear_caches()
        try:
            smartremat.explain(smartremat.filter_jit(step, budget_mb="auto", donate="all"), model, opt_state, tokens)
        except _Stop:
            pass
    return jobs


def lowered_all(jobs: list) -> tuple[list, float]:
    """Each job lowered (traced to StableHLO) once, and the seconds that took."""
    t0 = time.perf_counter()
    out = []
    for fn, avals in jobs:
        out.append(jax.jit(fn).lower(*avals))
    return out, time.perf_counter() - t0


def compile_all(lowered: list, options: dict) -> tuple[list[int | None], float]:
    """Each program compiled with `options`, one at a time: `(temp bytes or None where refused, seconds)`."""
    temps, t0 = [], time.perf_counter()
    for low in lowered:
        try:
            temps.append(low.compile(options).memory_analysis().temp_size_in_bytes)
        except Exception as e:  # noqa: BLE001 - a refusal is a figure
            if refused(e) is None:
                raise
            temps.append(None)
    return temps, time.perf_counter() - t0


def whole(c: Check, policy: str, options: dict) -> tuple[float, float]:
    """`(temp MB, compile seconds)` of the whole donated step under the fixed `policy` with `options`."""
    model, opt_state = abstract(c, policy)
    params, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    tokens = jax.ShapeDtypeStruct(c.tokens.shape, c.tokens.dtype)
    jitted = jax.jit(lambda p, o, t: step(eqx.combine(p, static), o, t), donate_argnums=(0, 1))
    lowered = jitted.lower(params, opt_state, tokens)
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile(options)
    except Exception as e:  # noqa: BLE001
        if refused(e) is None:
            raise
        return float("nan"), time.perf_counter() - t0
    memory = compiled.memory_analysis()
    return (float("nan") if memory is None else memory.temp_size_in_bytes / MB), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--size", default="gpt2-medium", choices=sorted(SIZES))
    ap.add_argument("--layout", default="scanned", choices=["scanned", "unrolled"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--efforts", default="default,exec-1,O0,O1,mem-O0")
    ap.add_argument("--first", type=int, default=None, help="only the first N programs (each option's own peak "
                    "comes first)")
    ap.add_argument("--warmup", action="store_true", help="compile the first program once, untimed, before the "
                    "sets (else the first set's seconds hold the process's first compile)")
    ap.add_argument("--whole", default=None, help="a fixed policy whose whole step is compiled per set too")
    args = ap.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()} ({jax.devices()[0].device_kind}); "
          f"{args.size} {args.layout} {args.dtype} batch {args.batch}", flush=True)
    c = Check(args.size, args.layout, args.dtype, args.batch)
    jobs = profile_jobs(c)[: args.first]
    lowered, seconds = lowered_all(jobs)
    print(f"first block profile: {len(jobs)} programs, lowered in {seconds:.1f} s", flush=True)
    if args.warmup:  # options equal to the default's but another cache key: the first program compiles again below
        compile_all(lowered[:1], {"exec_time_optimization_effort": 0.0})
    base: list | None = None
    for name in args.efforts.split(","):
        temps, seconds = compile_all(lowered, EFFORTS[name])
        base = temps if base is None else base
        same = sum(a == b for a, b in zip(temps, base))
        worst = max((abs(a - b) for a, b in zip(temps, base) if a is not None and b is not None), default=0)
        line = (f"{name:>8}: {seconds:7.1f} s for {len(jobs)} programs, temp bytes equal to the first set's in "
                f"{same} of {len(jobs)} (largest difference {worst / MB:.2f} MB)")
        if args.whole:
            temp, s = whole(c, args.whole, EFFORTS[name])
            line += f"; whole step under {args.whole}: {temp:.1f} MB in {s:.1f} s"
        print(line, flush=True)


if __name__ == "__main__":
    main()
