"""`smartremat.filter_jit`'s model of a whole step against the compiler, on the real-model corpus
(`tests/real/`, each model's own loss and gradient, as `tests/test_real.py` plans them).

    python studies/step_model.py [--models vit bert nanogpt] [--random 6] [--seed 0]

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
from smartremat.internal import Stage, peak_of, tail, verified

os.environ.setdefault("SMARTREMAT_DISK_CACHE", "0")  # every run measures, none reads an old plan
MB = smartremat.MB


def _captured(step, model, batch) -> dict:
    """The joined model before and after `tail`, the compiled temp without remat, and the
    planner's own measure of a choice (the user's step, compiled), from planning at a budget
    every plan fits."""
    got: dict = {}

    def tailed(m, temp):
        got["before"], got["temp"] = m, temp
        got["after"] = tail(m, temp)
        return got["after"]

    def capture(m, config, target, *a, **k):
        got["measure"] = lambda c: target.measure(target.runs(m, c), config, every_loss=False)
        return verified(m, config, target, *a, **k)

    with replaced(tail, tailed), replaced(verified, capture):
        smartremat.filter_jit(step, budget_mb=1e6).plan(model, batch)
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


def _report(name: str, n_random: int, seed: int) -> tuple[list[float], list[float]]:
    from tests.real import bert, nanogpt, resnet, unet, vit
    from tests.test_real import make_step

    module = {m.NAME: m for m in (unet, bert, vit, nanogpt, resnet)}[name]
    model, batch = module.make(jax.random.PRNGKey(0))
    t0 = time.perf_counter()
    got = _captured(make_step(module), model, batch)
    before, after = got["before"], got["after"]
    none = (0,) * len(before.stages)
    const = max(got["temp"] - peak_of(before.stages, none), 0)
    print(f"\n== {name} == {len(before.stages)} stages; step without remat {got['temp'] / MB:.3f} MB; "
          f"glue residuals {after.fixed_bytes / MB:.4f} MB; constant {const / MB:.3f} MB")
    print(f"{'plan':>28} | {'compiled MB':>11} | {'constant MB':>11} {'err':>7} | {'tail MB':>8} {'err':>7}")
    errs_c, errs_t = [], []
    for c in _choices(before.stages, n_random, seed):
        temp = got["measure"](c)[0]
        a = peak_of(before.stages, c) + const
        b = peak_of(after.stages, c) + after.fixed_bytes
        errs_c.append((a - temp) / temp)
        errs_t.append((b - temp) / temp)
        print(f"{str(c):>28} | {temp / MB:11.3f} | {a / MB:11.3f} {errs_c[-1]:+7.3f} | {b / MB:8.3f} {errs_t[-1]:+7.3f}")
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
    args = parser.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()} ({jax.devices()[0].device_kind}), "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    for name in args.models:
        _report(name, args.random, args.seed)


if __name__ == "__main__":
    main()
