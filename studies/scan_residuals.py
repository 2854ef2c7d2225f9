"""What a scanned model's compiled step keeps across its loop, against the jaxpr's residuals.

    python studies/scan_residuals.py [--size gpt2-medium|tiny] [--dtype bfloat16] [--batch 8]
        [--policies full,dots_nb,dots] [--hlo OUT_DIR]

The accelerator check's scanned step (`benchmarks/accelerator_check.py --layout scanned`: blocks
stacked by `eqx.filter_vmap`, run by `jax.lax.scan` under one fixed policy, Adam, donated) is
compiled under each policy. For each, it prints the compiled temp bytes; the jaxpr's scans (the
forward scan's stacked outputs are the residuals JAX keeps for the backward, one slice per
iteration); and the compiled program's `while` loops, each with the bytes of its loop state and
its stacked buffers (those whose leading dimension is the number of layers). Where the compiler
keeps more than the jaxpr's residuals, the loop state shows what. `--hlo` writes each optimized
HLO, gzipped. A refused compile is a row.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (the CPU flag, only where there is no accelerator)

import argparse
import gzip
import pathlib
import re
from collections import Counter
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.extend import core as jcore

from benchmarks.accelerator_check import SIZES, Check, refused, step

MB = 2**20
_SHAPE = re.compile(r"\b(pred|s8|u8|s32|u32|bf16|f16|f32|f64|s64|u64)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "f64": 8, "s64": 8, "u64": 8}


def _bytes(dtype: str, dims: str) -> int:
    return _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))


def _subjaxprs(eqn: Any):
    for v in eqn.params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(x, jcore.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jcore.Jaxpr):
                yield x


def jaxpr_scans(jaxpr: Any, depth: int = 0) -> list[str]:
    """Each scan of the jaxpr (nested ones too): its length and its stacked outputs (`ys`)."""
    lines = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            n_carry = eqn.params["num_carry"]
            ys = [v.aval for v in eqn.outvars[n_carry:]]
            total = sum(a.size * a.dtype.itemsize for a in ys)
            kinds = Counter(f"{a.dtype}{list(a.shape[1:])}" for a in ys)
            lines.append(f"{'  ' * depth}scan length {eqn.params['length']}: {len(ys)} stacked outputs, "
                         f"{total / MB:.1f} MB ({total / MB / max(eqn.params['length'], 1):.2f} MB an iteration): "
                         + ", ".join(f"{k} x{c}" for k, c in kinds.most_common()))
        for sub in _subjaxprs(eqn):
            lines += jaxpr_scans(sub, depth + 1)
    return lines


def hlo_loops(text: str, layers: int) -> list[str]:
    """Each `while` of the optimized HLO: its loop state's bytes, and its buffers stacked over `layers`."""
    lines = []
    for line in text.splitlines():
        m = re.search(r"=\s*(\(.*\))\s+while\(", line)
        if not m:
            continue
        shapes = _SHAPE.findall(m.group(1))
        total = sum(_bytes(d, s) for d, s in shapes)
        stacked = [(d, s) for d, s in shapes if s.split(",")[0] == str(layers)]
        kinds = Counter(f"{d}[{s}]" for d, s in stacked)
        name = line.strip().split(" ")[0]
        lines.append(f"while {name}: state {total / MB:.1f} MB in {len(shapes)} buffers; stacked over {layers}: "
                     f"{sum(_bytes(d, s) for d, s in stacked) / MB:.1f} MB: "
                     + ", ".join(f"{k} x{c}" for k, c in kinds.most_common()))
    return lines


def study(c: Check, policy: str, layers: int, hlo: pathlib.Path | None) -> None:
    model, opt_state = c.fresh(policy)
    print(f"== {policy} ==", flush=True)
    jaxpr = eqx.filter_make_jaxpr(step)(model, opt_state, c.tokens)[0]
    for line in jaxpr_scans(jaxpr.jaxpr):
        print("  jaxpr " + line)
    try:
        compiled = eqx.filter_jit(step, donate="all").lower(model, opt_state, c.tokens).compile().compiled
    except Exception as e:  # noqa: BLE001 - a refusal is a row
        if refused(e) is None:
            raise
        print(f"  refused: {refused(e)}", flush=True)
        return
    mem = compiled.memory_analysis()
    print(f"  compiled temp {mem.temp_size_in_bytes / MB:.1f} MB, arguments {mem.argument_size_in_bytes / MB:.1f}, "
          f"outputs {mem.output_size_in_bytes / MB:.1f}, aliased {mem.alias_size_in_bytes / MB:.1f}")
    text = compiled.as_text()
    for line in hlo_loops(text, layers):
        print("  hlo " + line)
    if hlo is not None:
        hlo.mkdir(parents=True, exist_ok=True)
        (hlo / f"scan_{policy}.hlo.txt.gz").write_bytes(gzip.compress(text.encode()))
    print(flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--size", default="gpt2-medium", choices=sorted(SIZES))
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--policies", default="full,dots_nb,dots")
    ap.add_argument("--hlo", default=None, help="a folder for each optimized HLO, gzipped")
    args = ap.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()} ({jax.devices()[0].device_kind}), "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; {args.size} scanned {args.dtype} batch {args.batch}")
    c = Check(args.size, "scanned", args.dtype, args.batch)
    for policy in args.policies.split(","):
        study(c, policy, SIZES[args.size]["layers"], None if args.hlo is None else pathlib.Path(args.hlo))


if __name__ == "__main__":
    main()
