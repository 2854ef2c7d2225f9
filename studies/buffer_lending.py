"""Where XLA keeps a stack's activations: in its temp bytes, or in the weight gradients' output
buffers, which the backward writes only when it reaches their block (docs/facts.md, fact 12).

The quick tutorial stack (`benchmarks/run.py --quick`) with its first (or last) k blocks under one
policy and the others without remat, k = 0 to all; each training step is compiled with XLA's
buffer-assignment and live-range dumps, and per k the script prints the compiled temp bytes and,
at the point of the step where the most bytes are alive, how many of them XLA keeps in its temp
allocation and how many in the output buffers of weight gradients not written yet. The split is
an approximation read off the dumps: every output allocation counts as a weight gradient's, a value
as big as its allocation is taken for the output itself, and tuple-indexed values are left out.

    python studies/buffer_lending.py [--model tutorial] [--policy full] [--last]
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (sets the CPU flag before JAX starts)
from benchmarks.strategies import grad_step

import jax

import smartremat
from studies.mixed_plans import mixed
from benchmarks.run import build

MB = smartremat.MB
_ALLOCATION = re.compile(r"^allocation \d+: size (\d+), (.*)$")
_VALUE = re.compile(r"^ value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\)")
_RANGE = re.compile(r"^    (\S+)\{\}:(\d+)-(\d+)$")


def placements(assignment: str) -> tuple[int, dict[str, tuple[str, int]]]:
    """`(temp bytes, {value: (where, bytes)})` from a buffer-assignment dump; `where` is "temp"
    (the preallocated temp allocation) or "gradient" (an output allocation the size of a weight
    gradient, for a value smaller than it: the gradient itself is written there last)."""
    temp, where, out = 0, None, {}
    for line in assignment.splitlines():
        if m := _ALLOCATION.match(line):
            size, kind = int(m.group(1)), m.group(2)
            where = ("temp", size) if "preallocated-temp" in kind else ("gradient", size) if "maybe-live-out" in kind else None
            temp = size if "preallocated-temp" in kind else temp
        elif (v := _VALUE.match(line)) and where is not None and (where[0] == "temp" or int(v.group(2)) < where[1]):
            out[v.group(1)] = (where[0], int(v.group(2)))
    return temp, out


def at_peak(assignment: str, live_range: str) -> tuple[int, int, int]:
    """`(temp bytes, bytes in temp, bytes in weight-gradient buffers)`: the latter two summed
    over the values alive at the step where their sum is largest (the program's peak demand)."""
    temp, placed = placements(assignment)
    ranges = [(m.group(1), int(m.group(2)), int(m.group(3))) for m in map(_RANGE.match, live_range.splitlines()) if m]
    end = max((b for _, _, b in ranges), default=0)
    live = {"temp": [0] * (end + 2), "gradient": [0] * (end + 2)}
    for name, a, b in ranges:
        if name in placed:
            kind, size = placed[name]
            for t in range(a, b + 1):
                live[kind][t] += size
    t = max(range(end + 1), key=lambda t: live["temp"][t] + live["gradient"][t])
    return temp, live["temp"][t], live["gradient"][t]


def compiled_dumps(model, x) -> tuple[str, str]:
    """The buffer-assignment and live-range dumps of `model`'s training step (default options)."""
    step, params, target = grad_step(model, x)
    with tempfile.TemporaryDirectory() as folder:
        step.lower(params, x, target).compile({"xla_dump_to": folder})
        texts = []
        for suffix in ("buffer-assignment.txt", "live-range.txt"):
            (path,) = glob.glob(os.path.join(folder, f"*jit__lambda*after_optimizations-{suffix}"))
            with open(path) as f:
                texts.append(f.read())
        return texts[0], texts[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tutorial")
    ap.add_argument("--policy", default="full", choices=["dots", "dots_nb", "full"])
    ap.add_argument("--last", action="store_true", help="the last k blocks under the policy, not the first k")
    args = ap.parse_args()
    case = build(args.model, "quick")
    n = len(list(case.where(case.model)))
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; quick {args.model}, {n} blocks; "
          f"{'last' if args.last else 'first'} k under {args.policy}, the others without remat")
    for k in range(n + 1):
        chosen = [(i >= n - k) if args.last else (i < k) for i in range(n)]
        model = mixed(case.model, case.where, [args.policy if c else None for c in chosen])
        temp, in_temp, in_gradients = at_peak(*compiled_dumps(model, case.x))
        print(f"k={k}: temp {temp / MB:7.3f} MB; at the peak demand {(in_temp + in_gradients) / MB:7.3f} MB alive: "
              f"{in_temp / MB:7.3f} MB in temp, {in_gradients / MB:7.3f} MB in weight-gradient buffers", flush=True)


if __name__ == "__main__":
    main()
