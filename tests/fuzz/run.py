"""`make fuzz`: check `--count` cases drawn from `--seed`, print progress and a summary, and write
each failure class's first case, shrunk, as a standalone reproducer into `--out`.

Run from the repository root with the CPU flag set before JAX starts (the Makefile does):

    XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander SMARTREMAT_DISK_CACHE=0 \\
        .venv/bin/python -m tests.fuzz.run --seed 1 --count 2000 --jobs 2

`--jobs n` checks cases in `n` processes (each compiles on every core as well); `--start k` begins at
case `k` of the seed's sequence, so a run cut short goes on where it stopped.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import multiprocessing
import os
import re
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

FLAG = "--xla_disable_hlo_passes=cse_barrier_expander"


def _environment() -> None:
    """The CPU barrier flag and no disk cache, as tests/conftest.py sets them (before JAX starts)."""
    if FLAG not in os.environ.get("XLA_FLAGS", ""):
        if "jax" in sys.modules:
            raise RuntimeError(f"set XLA_FLAGS={FLAG} before JAX is imported")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FLAG).strip()
    os.environ.setdefault("SMARTREMAT_DISK_CACHE", "0")


_environment()

from tests.fuzz.check import CLASSES, Outcome, check_case  # noqa: E402
from tests.fuzz.grammar import CHOICES, Case, case_at, normalise  # noqa: E402


def check_at(seed: int, index: int) -> Outcome:
    """`check_case(case_at(seed, index))`, warnings ignored (a worker process's entry)."""
    warnings.simplefilter("ignore")  # smartremat's and JAX's warnings are not failures here
    return check_case(case_at(seed, index))


def _exit_with(parent: int) -> None:
    """A worker's initializer: exit when the run that started it is gone (killed, not only ended),
    instead of going on with its cases for nobody."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(2)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def outcomes(seed: int, indexes: range, jobs: int) -> Iterator[tuple[int, Outcome]]:
    """`(index, outcome)` of each case, in order; in `jobs` processes when more than one."""
    if jobs <= 1:
        yield from ((i, check_at(seed, i)) for i in indexes)
        return
    context = multiprocessing.get_context("spawn")  # JAX is not fork-safe; each worker sets the flag itself
    with ProcessPoolExecutor(jobs, mp_context=context, initializer=_exit_with, initargs=(os.getpid(),)) as pool:
        yield from zip(indexes, pool.map(check_at, [seed] * len(indexes), indexes))


def signature(outcome: Outcome) -> set[tuple[str, str]]:
    """The failure classes of an outcome, as `(kind, key)`."""
    return {(f.kind, f.key) for f in outcome.failures}


def shrink(case: Case, target: tuple[str, str], budget_s: float = 300.0) -> Case:
    """A simpler case that still fails with `target`: greedily set each field to a simpler value
    (earlier in `CHOICES`; the seed to 0) while the failure persists, until nothing changes or
    `budget_s` is spent."""
    t0 = time.perf_counter()
    changed = True
    while changed and time.perf_counter() - t0 < budget_s:
        changed = False
        for name, values in [("seed", (0,)), *CHOICES.items()]:
            current = getattr(case, name)
            simpler = values[: values.index(current)] if current in values else values
            for value in simpler:
                candidate = normalise(dataclasses.replace(case, **{name: value}))
                if candidate == case or time.perf_counter() - t0 > budget_s:
                    continue
                if target in signature(check_case(candidate)):
                    case, changed = candidate, True
                    print(f"    shrunk: {name}={value!r}", flush=True)
                    break
    return case


def slug(kind: str, key: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", f"{kind} {key}".lower()).strip("-")[:70]


REPRODUCER = '''"""smartremat fuzz failure [{kind}]: {key}

Found by `make fuzz SEED={seed} COUNT={count}` (case {index}), shrunk from
{original}

Run from the repository root: `.venv/bin/python {path}`. What the check reported:

{detail}
"""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " {flag}").strip()
os.environ["SMARTREMAT_DISK_CACHE"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.fuzz.check import assert_case  # noqa: E402
from tests.fuzz.grammar import Case  # noqa: E402

# the case as data: tests/fuzz/grammar.py builds its model, data and step from it
CASE = Case(**{fields})

if __name__ == "__main__":
    assert_case(CASE)  # raises AssertionError naming each invariant broken
'''


def write_reproducer(out: str, outcome: Outcome, original: Case, target: tuple[str, str],
                     meta: dict) -> str:
    """Write the reproducer of `outcome` (a shrunk case) to `out/<slug>.py`; its path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, slug(*target) + ".py")
    detail = next(f.detail for f in outcome.failures if (f.kind, f.key) == target)
    detail = detail.replace('"""', "'''").replace("\\", "\\\\")
    text = REPRODUCER.format(kind=target[0], key=target[1].replace('"""', "'''"), original=original,
                             detail="\n".join(detail.splitlines()[-40:]), path=path, flag=FLAG,
                             fields=repr(dataclasses.asdict(outcome.case)), **meta)
    with open(path, "w") as f:
        f.write(text)
    return path


def summary(outcomes: list[Outcome], found: dict, written: dict) -> str:
    """How often each idiom was drawn, the time per case, failures by class."""
    n = len(outcomes)
    drawn = collections.Counter(i for o in outcomes for i in o.case.idioms())
    failed = collections.Counter(i for o in outcomes if not o.ok for i in o.case.idioms())
    lines = [f"\n{n} cases, {sum(o.ok for o in outcomes)} passed; seconds per case: median "
             f"{statistics.median(o.seconds for o in outcomes):.1f}, mean {statistics.mean(o.seconds for o in outcomes):.1f}, "
             f"max {max(o.seconds for o in outcomes):.1f}", "", "idiom drawn (failing):"]
    lines += [f"  {k:28s} {v:5d} ({failed[k]})" for k, v in sorted(drawn.items())]
    lines += ["", "failures by class:"]
    by_kind = collections.Counter(f.kind for o in outcomes for f in o.failures)
    for kind in CLASSES:
        if by_kind[kind]:
            lines.append(f"  {kind}: {by_kind[kind]}")
            for (k, key), cases in sorted(found.items()):
                if k == kind:
                    lines.append(f"    {len(cases):4d} x {key}   (first: case {cases[0]}; {written.get((k, key), '-')})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seed", type=int, default=None, help="the run's seed (default: from the clock)")
    parser.add_argument("--count", type=int, default=2000, help="cases to check (default 2000)")
    parser.add_argument("--start", type=int, default=0, help="the first case's index in the seed's sequence")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--out", default="fuzz-failures", help="folder for reproducers (default fuzz-failures/)")
    parser.add_argument("--no-shrink", action="store_true", help="write reproducers of the cases as drawn")
    parser.add_argument("--shrink-seconds", type=float, default=300.0, help="time to shrink one failure class")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    print(f"smartremat fuzz: --seed {seed} --count {args.count} --start {args.start} --jobs {args.jobs} "
          f"(reproducers into {args.out}/)", flush=True)
    warnings.simplefilter("ignore")  # smartremat's and JAX's warnings are not failures here
    done: list[Outcome] = []
    found: dict[tuple[str, str], list[int]] = {}
    written: dict[tuple[str, str], str] = {}
    for i, outcome in outcomes(seed, range(args.start, args.start + args.count), args.jobs):
        done.append(outcome)
        status = "ok" if outcome.ok else "FAIL " + "; ".join(f"[{k}] {key}" for k, key in sorted(signature(outcome)))
        print(f"[{i + 1 - args.start}/{args.count}] case {i} {outcome.seconds:5.1f}s {status}  "
              f"{' '.join(outcome.case.idioms())}", flush=True)
        for target in sorted(signature(outcome)):
            found.setdefault(target, []).append(i)
            if target not in written:
                written[target] = _reproduce(args, outcome, target, {"seed": seed, "count": args.count, "index": i})
    print(summary(done, found, written), flush=True)
    return 1 if found else 0


def _reproduce(args: argparse.Namespace, outcome: Outcome, target: tuple[str, str], meta: dict) -> str:
    """Shrink the first case of a new failure class and write its reproducer."""
    small = outcome
    if not args.no_shrink:
        print(f"  new failure class [{target[0]}] {target[1]}: shrinking case {meta['index']}", flush=True)
        case = shrink(outcome.case, target, args.shrink_seconds)
        small = check_case(case)
        if target not in signature(small):  # flaky: keep the case as drawn
            small = outcome
    path = write_reproducer(args.out, small, outcome.case, target, meta)
    print(f"  reproducer: {path}\n    {small.case}", flush=True)
    return path


if __name__ == "__main__":
    sys.exit(main())
