"""`smartremat.filter_jit`'s model of a whole step against the compiler, on the real-model corpus
(`tests/real/`, each model's own loss and gradient, as `tests/test_real.py` plans them).

    python studies/step_model.py [--models vit bert nanogpt] [--random 6] [--seed 0]
    python studies/step_model.py --check scanned bfloat16 8   # on an accelerator

`--check LAYOUT DTYPE BATCH` studies the accelerator check's GPT-2-medium step instead
(`benchmarks/accelerator_check.py`: Adam, donated), where the step without remat may be refused:
a plan the device refuses is a row with the compiler's figure, and the tail is calibrated on the
reference the planner compiled (its choice is printed).

Per model: the uniform plans (one menu entry on every block) and `--random` plans (a random entry
per block; one per scan run), each compiled as the user's step, beside two predictions from the
same profiles and the same compile of the step without remat:

- **constant**: the rest of the step (what follows the blocks, the loss, the update) as bytes alive
  beside every block, `peak(plan) + max(temp(none) - peak(none), 0)` (through f50784f);
- **tail**: the rest of the step as a tail whose backward runs first, while every block's kept bytes
  are alive (`smartremat.internal.tail`, docs/facts.md fact 16): what `filter_jit` predicts now.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (sets the CPU flag before JAX starts)

import jax

import smartremat
from benchmarks.common import replaced
from smartremat.internal import Refused, Stage, peak_of, tail, verified

os.environ.setdefault("SMARTREMAT_DISK_CACHE", "0")  # every run measures, none reads an old plan
MB = smartremat.MB


def _captured(step, *args, donate: str = "none") -> dict:
    """The joined model before and after `tail`, the compiled temp of the reference step (without
    remat, or the plan `StepTarget.reference` fell back to), and the planner's own measure of a
    choice (the user's step, compiled), from planning at a budget every plan fits; the arguments
    donated as `donate` says (the accelerator check's step donates them all)."""
    got: dict = {}

    def tailed(m, temp, choice=None):
        got["before"], got["temp"], got["choice"] = m, temp, choice
        got["after"] = tail(m, temp, choice)
        return got["after"]

    def capture(m, config, target, *a, **k):
        got["measure"] = lambda c: target.measure(target.runs(m, c), config, every_loss=False)
        return verified(m, config, target, *a, **k)

    with replaced(tail, tailed), replaced(verified, capture):
        smartremat.filter_jit(step, budget_mb=1e6, donate=donate).plan(*args)
    return got


def _choices(stages: tuple[Stage, ...], n_random: int, seed: int) -> list[tuple[int, ...]]:
    """Uniform plans, then random ones (one entry per group; one per scan run)."""
    n = max(len(st.saved) for st in stages)
    out = [tuple(min(k, len(st.saved) - 1) for st in stages) for k in range(n)]
    rng = random.Random(seed)
    for _ in range(n_random):
        picked: dict = {}
        out.append(tuple(picked.setdefault(("run", st.run) if st.run is not None else st.group,
                                           rng.randrange(len(st.saved))) for st in stages))
    return list(dict.fromkeys(out))


def _real(name: str) -> tuple:
    from tests.real import bert, nanogpt, resnet, unet, vit
    from tests.test_real import make_step

    module = {m.NAME: m for m in (unet, bert, vit, nanogpt, resnet)}[name]
    return (make_step(module), *module.make(jax.random.PRNGKey(0)))


def _check(size: str, layout: str, dtype: str, batch: int) -> tuple:
    from benchmarks.accelerator_check import Check, step

    c = Check(size, layout, dtype, batch)
    return (step, *c.fresh("smartremat"), c.tokens)


def _measured(measure, choice: tuple[int, ...]) -> tuple[float | None, str]:
    try:
        return measure(choice)[0], ""
    except Refused as e:
        return None, f"refused: {e.message[:90]}"


def _report(name: str, args: tuple, n_random: int, seed: int, split: bool,
            donate: str = "none") -> tuple[list[float], list[float]]:
    t0 = time.perf_counter()
    got = _captured(*args, donate=donate)
    before, after = got["before"], got["after"]
    none = (0,) * len(before.stages)
    const = max(got["temp"] - peak_of(before.stages, got["choice"] or none), 0)
    print(f"\n== {name} == {len(before.stages)} stages; reference {got['choice'] or 'without remat'} "
          f"{got['temp'] / MB:.3f} MB; glue residuals {after.fixed_bytes / MB:.4f} MB; constant {const / MB:.3f} MB")
    print(f"{'plan':>28} | {'compiled MB':>11} | {'constant MB':>11} {'err':>7} | {'tail MB':>8} {'err':>7}")
    errs_c, errs_t = [], []
    choices = _choices(before.stages, n_random, seed)
    choices += [(*c[:-1], 0) for c in choices if split and c[-1]]  # the last block alone without remat
    for c in choices:
        temp, refused = _measured(got["measure"], c)
        a = peak_of(before.stages, c) + const
        b = peak_of(after.stages, c) + after.fixed_bytes
        shown = str(c) if len(c) <= 8 else f"{c[:2]}..{c[-2:]}"
        if temp is None:
            print(f"{shown:>28} | {refused} | {a / MB:11.3f} | {b / MB:8.3f}")
            continue
        errs_c.append((a - temp) / temp)
        errs_t.append((b - temp) / temp)
        print(f"{shown:>28} | {temp / MB:11.3f} | {a / MB:11.3f} {errs_c[-1]:+7.3f} | {b / MB:8.3f} {errs_t[-1]:+7.3f}")
    for label, e in (("constant", errs_c), ("tail", errs_t)):
        a = [abs(x) for x in e]
        print(f"{name} {label}: |error| median {statistics.median(a):.3f}, max {max(a):.3f} over {len(a)} plans")
    print(f"({name}: {time.perf_counter() - t0:.1f} s)")
    return errs_c, errs_t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["vit", "bert", "nanogpt"])
    parser.add_argument("--random", type=int, default=6, help="random plans per model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", nargs=3, metavar=("LAYOUT", "DTYPE", "BATCH"), default=None,
                        help="the accelerator check's GPT-2-medium step instead (e.g. scanned bfloat16 8)")
    parser.add_argument("--size", default="gpt2-medium", help="with --check: its --size (tiny on the CPU)")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()} ({jax.devices()[0].device_kind}), "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    if args.check:
        layout, dtype, batch = args.check
        _report(f"{args.size} {layout} {dtype} batch {batch}", _check(args.size, layout, dtype, int(batch)), 0,
                args.seed, True, donate="all")
        return
    for name in args.models:
        _report(name, _real(name), args.random, args.seed, False)


if __name__ == "__main__":
    main()
