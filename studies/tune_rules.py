"""Which rule should `tune=True` use to pick among the candidates it times, and over how many rounds?
(issue 13: measured, not guessed.)

    python studies/tune_rules.py [--models gpt resnet] [--rounds 70] [--trials 400] [--random 4]
                                    [--n 15 25 40] [--json PATH] [--load PATH] [--rules ...]

For each model, the candidates are the fixed strategies of `benchmarks/run.py`, smartremat's default
(fewest compiled FLOPs) plan at each of the quick benchmark's budgets, and `--random` mixed plans
(a random policy per block; none for a lone block, `tutorial_block`). Each distinct program
(`strategies.program_text`) is compiled once as the benchmark's training step and timed in `--rounds`
interleaved rounds, each round in a fresh order (`smartremat.internal.round_orders`; the run of
docs/results/tune_rules_cpu.json was rotated by one). Then, `--trials` times, the rounds are split
at random: `--rounds - max(--n)` of them judge, and `n` others are what a rule sees (what
`tune=True` would have measured). The rule picks one of the candidates that fit the budget
(compiled temp bytes <= budget); the judging rounds weigh its pick as the benchmark does: its
median time over the fastest fitting fixed strategy's. Rules:

- **default**: smartremat's default plan (no timing);
- **signed-rank**: the default, unless a fitting candidate has a lower median and a one-sided
  Wilcoxon signed-rank test at 5% over the paired rounds says it is faster (`faster`; `tune=True`'s
  rule before this script);
- **lowest median**: the fitting candidate of the lowest median (`tune=True`'s rule since);
- **lowest mean**, **lowest q25**, **lowest min**: the fitting candidate of the lowest mean, lower
  quartile or minimum of its rounds (timing noise on a shared CPU is mostly added time, so a lower
  statistic may rank with less of it);
- **lowest paired**: the fitting candidate of the lowest median over the rounds of its time over
  the round's median time among the fitting candidates (`paired`: a slow round, from drift or
  another process, weighs on none).

With `--load PATH` the rules are simulated again on the rounds a `--json` run wrote (no timing).

Printed per rule and `n`: the mean over trials of the median and of the worst ratio over the
budgets, and how often the worst exceeds 1.03 and the median 1.00 (the issue's targets); and the
rank correlation between two halves of the rounds, the ceiling for any cost model's (`ceiling`).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.common  # noqa: F401  (sets the CPU flag before JAX starts)

import argparse
import functools
import json
import pathlib
import random
import statistics
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import smartremat
from benchmarks.strategies import exact, strategy
from studies.mixed_plans import mixed
from benchmarks.run import FIXED, MB, Timer, build, environment, time_all
from studies.time_model import spearman

POLICIES = [None, "dots", "dots_nb", "full"]
#: The signed-rank rule's level.
SIGNIFICANCE = 0.05


def faster(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether times `a` beat times `b` beyond the noise: a lower median, and a one-sided Wilcoxon
    signed-rank test over the paired rounds at `SIGNIFICANCE` (exact: every sign pattern of the
    ranks counted). Unlike a count of rounds won, it weighs a round by how much it was won by."""
    d = [y - x for x, y in zip(a, b) if y != x]  # > 0 where `a` was faster
    order = sorted(range(len(d)), key=lambda i: abs(d[i]))
    rank = [0] * len(d)  # twice the rank (ties share their mean rank), to stay in integers
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and abs(d[order[j + 1]]) == abs(d[order[i]]):
            j += 1
        for k in order[i:j + 1]:
            rank[k] = i + j + 2
        i = j + 1
    won = sum(r for r, v in zip(rank, d) if v > 0)
    counts = _sign_patterns(tuple(sorted(rank)))
    tail = sum(n for total, n in counts.items() if total >= won) / 2 ** len(d)
    return statistics.median(a) < statistics.median(b) and tail <= SIGNIFICANCE


@functools.cache
def _sign_patterns(ranks: tuple[int, ...]) -> dict[int, int]:
    """How many of the `2**len(ranks)` sign patterns give each sum of the positive ranks: the
    signed-rank statistic's exact null distribution (a pure function of the ranks, so cached)."""
    counts = {0: 1}
    for r in ranks:
        for total, n in list(counts.items()):
            counts[total + r] = counts.get(total + r, 0) + n
    return counts


def candidates(name: str, n_budgets: int, n_random: int, seed: int):
    """`(programs, fixed, default, budgets)`: one `Timer` per distinct program; the fixed strategies'
    and, per budget, smartremat's default plan's indices into it."""
    case = build(name, "quick")
    programs: dict[str, Timer] = {}

    def add(model) -> int:
        t = Timer(model, case.x)
        programs.setdefault(t.program, t)
        return list(programs).index(t.program)

    fixed = {s: add(strategy(case.model, s, case.where)) for s in FIXED}
    temp = [t.temp for t in programs.values()]
    lo, hi = sorted((temp[fixed["full"]], temp[fixed["none"]]))  # as benchmarks/run.py spreads them
    budgets = sorted(set(np.linspace(hi, lo, n_budgets).tolist()) | {(lo + hi) / 2}, reverse=True)
    default = []
    for b in budgets:
        wrapped = smartremat.smartremat(budget_mb=b / MB, **exact(case.model, case.x))(case.model)
        default.append(add(wrapped))
    rng = random.Random(seed)
    if case.where is not None:  # a lone block (its own call) has no mixed plans
        n = len(list(case.where(case.model)))
        for _ in range(n_random):
            add(mixed(case.model, case.where, [rng.choice(POLICIES) for _ in range(n)]))
    return case, list(programs.values()), fixed, default, budgets


RULES = ["default", "signed-rank", "lowest median", "lowest mean", "lowest q25", "lowest min", "lowest paired"]
#: The statistic each "lowest ..." rule ranks by.
STATISTICS = {
    "lowest median": statistics.median,
    "lowest mean": statistics.mean,
    "lowest q25": lambda t: float(np.quantile(t, 0.25)),
    "lowest min": min,
}


def paired(times: Sequence[Sequence[float]]) -> list[float]:
    """Each step's median over the rounds of its time over that round's median step time: what is
    slow or fast in a whole round (drift, another process) cancels out."""
    per_round = [statistics.median(r) for r in zip(*times)]
    return [statistics.median(t / m for t, m in zip(ts, per_round)) for ts in times]


def choose(rule: str, times: list[list[float]], fits: list[int], incumbent: int) -> int:
    if rule == "default":
        return incumbent
    if rule in STATISTICS:
        stat = {i: STATISTICS[rule](times[i]) for i in fits}
        return min(fits, key=lambda i: (stat[i], i))
    if rule == "lowest paired":
        stat = paired([times[i] for i in fits])
        return min(fits, key=lambda i: (stat[fits.index(i)], i))
    med = {i: statistics.median(times[i]) for i in fits}
    better = [i for i in fits if i != incumbent and faster(times[i], times[incumbent])]
    return min(better, key=lambda i: (med[i], i), default=incumbent)


def simulate(timers, fixed, default, budgets, rules, ns, trials, seed) -> list[str]:
    """Per `n` of `ns`: each rule's mean median and worst ratio over `trials` draws of `n` rounds
    seen; the judging rounds are as many for every `n` (those `max(ns)` leaves), so that the
    judge's own noise is alike and `n`s compare."""
    rng = random.Random(seed)
    rounds = len(timers[0].times)
    if max(ns) >= rounds:
        raise ValueError(f"`--n {max(ns)}` leaves none of the {rounds} rounds to judge the picks: pass `--n` "
                         f"values below {rounds} (at most half of them leaves as many rounds to judge as to see)")
    out = []
    for n in ns:
        stats = {r: ([], []) for r in rules}
        for _ in range(trials):
            order = rng.sample(range(rounds), rounds)
            held, seen = order[: rounds - max(ns)], order[rounds - n:]
            view = [[t.times[k] for k in seen] for t in timers]
            judge = [statistics.median([t.times[k] for k in held]) for t in timers]
            for rule in rules:
                ratios = []
                for b, inc in zip(budgets, default):
                    fits = [i for i, t in enumerate(timers) if t.temp <= b]
                    best_fixed = min(judge[i] for i in set(fixed.values()) if timers[i].temp <= b)
                    ratios.append(judge[choose(rule, view, fits, inc)] / best_fixed)
                stats[rule][0].append(statistics.median(ratios))
                stats[rule][1].append(max(ratios))
        for rule, (med, worst) in stats.items():
            out.append(f"n={n:3d} {rule:14s} median ratio {statistics.mean(med):.3f} (>1.00 in "
                       f"{np.mean([m > 1.0 + 1e-12 for m in med]):4.0%}), worst {statistics.mean(worst):.3f} "
                       f"(>1.03 in {np.mean([w > 1.03 for w in worst]):4.0%})")
    return out


def ceiling(timers: Sequence[Any], trials: int, seed: int) -> str:
    """How well any cost model could rank these programs' times: Spearman's rank correlation
    between their medians over two disjoint random halves of the rounds (what a second measurement
    would rank), beside compiled FLOPs' against the medians of all rounds (issue 13's goal: 0.9)."""
    rng = random.Random(seed)
    rounds = len(timers[0].times)
    rho = []
    for _ in range(trials):
        order = rng.sample(range(rounds), rounds)
        halves = [[statistics.median([t.times[k] for k in h]) for t in timers]
                  for h in (order[: rounds // 2], order[rounds // 2:])]
        rho.append(spearman(*halves))
    flops = spearman([t.flops for t in timers], [statistics.median(t.times) for t in timers])
    return (f"Spearman between two halves of the rounds: mean {statistics.mean(rho):+.3f}, lowest "
            f"{min(rho):+.3f} over {trials} splits; compiled FLOPs against all rounds {flops:+.3f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt", "resnet"])
    ap.add_argument("--rounds", type=int, default=70)
    ap.add_argument("--trials", type=int, default=400)
    ap.add_argument("--budgets", type=int, default=8)
    ap.add_argument("--random", type=int, default=4)
    ap.add_argument("--n", type=int, nargs="+", default=[15, 25, 40])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write each program's temp bytes, FLOPs and round times here")
    ap.add_argument("--load", help="simulate the rules again on the rounds of this --json file (no timing)")
    ap.add_argument("--rules", nargs="+", default=RULES, choices=RULES)
    args = ap.parse_args(argv)
    if args.load:
        return replay(args)
    dump: dict[str, dict] = {}
    env = environment()
    print(f"jax {env['jax']} on {env['device']} ({env['machine']}); XLA_FLAGS={env['xla_flags']!r}")
    for name in args.models:
        case, timers, fixed, default, budgets = candidates(name, args.budgets, args.random, args.seed)
        time_all(timers, args.rounds)
        print(f"== {case.label}: {len(timers)} distinct programs x {len(timers[0].times)} rounds; "
              f"budgets {', '.join(f'{b / MB:.1f}' for b in budgets)} MB ==")
        names = {i: s for s, i in reversed(list(fixed.items()))}
        for i, t in enumerate(timers):
            at = ", ".join(f"{b / MB:.1f}" for b, d in zip(budgets, default) if d == i)
            tag = " ".join(filter(None, [names.get(i), at and f"default @ {at}"])) or "random"
            print(f"  {i:2d} {tag:40s} temp {t.temp / MB:8.2f} MB  {t.flops / 1e9:7.3f} GFLOP  "
                  f"median {statistics.median(t.times) * 1e3:7.1f} ms")
        print(ceiling(timers, args.trials, args.seed))
        if args.json:
            dump[name] = {"programs": [{"temp": t.temp, "flops": t.flops, "times": t.times} for t in timers],
                          "fixed": fixed, "default": default, "budgets": budgets, "env": env}
            pathlib.Path(args.json).write_text(json.dumps(dump))
        print("\n".join(simulate(timers, fixed, default, budgets, args.rules, args.n, args.trials, args.seed)),
              flush=True)


def replay(args: argparse.Namespace) -> None:
    """The rules simulated again on the rounds a `--json` run recorded."""
    for name, run in json.loads(pathlib.Path(args.load).read_text()).items():
        if name not in args.models:
            continue
        timers = [argparse.Namespace(**p) for p in run["programs"]]
        print(f"== {name} (from {args.load}): {len(timers)} distinct programs x {len(timers[0].times)} rounds ==")
        print(ceiling(timers, args.trials, args.seed))
        print("\n".join(simulate(timers, run["fixed"], run["default"], run["budgets"], args.rules, args.n,
                                 args.trials, args.seed)), flush=True)


if __name__ == "__main__":
    main()
