"""The accelerator check's report: its results (`benchmarks/accelerator_check.py`) as Markdown."""

from __future__ import annotations

from typing import Any

MB = 2**20


def _f(x: Any, spec: str, scale: float = 1.0) -> str:
    """`x * scale` formatted, or "-" for a figure a run does not have."""
    return "-" if x is None else format(x * scale, spec)


def markdown(r: dict, reference: str = "full") -> str:
    """The check's results (`benchmarks/accelerator_check.py`'s JSON) as Markdown; differences are
    from the `reference` run."""
    lines = [f"# Accelerator check: {r['model']}", "",
             f"{r['device']} ({r['platform']}, bytes_limit {_f(r['bytes_limit'], '.0f', 1 / MB)} MB), jax {r['jax']}, "
             f"equinox {r['equinox']}, smartremat {r['smartremat_version']}, XLA_FLAGS=`{r['xla_flags']}`, matmul precision "
             f"{r.get('matmul_precision', 'default')}; "
             f"median of {r['steps']} steps after the first; MFU at {r['peak_tflops']} TFLOP/s; differences from "
             f"`{reference}` (loss, gradient, parameters after one step; per leaf over its largest value); same answer: "
             f"within the gradient standard (`benchmarks/answers.py`, in {r.get('compute_dtype', '?')} ulps)", ""]
    lines += [f"    python {c}" for c in r["commands"]] + ["",
              "| run | temp MB | compile / first call s | step ms | of which host ms | / fastest fixed | back to back ms "
              "| / fastest fixed | MFU | peak in use MB | loss diff | grad diff | param diff | same answer |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, x in r["runs"].items():
        if "refused" in x:
            lines.append(f"| {name} | refused: {x['refused']} | {x['first_s']:.1f} | - | - | - | - | - | - | - | - | - | - | - |")
            continue
        first = x.get("compile_s", x.get("first_s"))
        lines.append(f"| {name} | {_f(x.get('temp_mb'), '.1f')} | {_f(first, '.1f')} | {_f(x.get('step_s'), '.1f', 1e3)} "
                     f"| {_f(x.get('host_s'), '.1f', 1e3)} | {_f(x.get('vs_fastest_fixed'), '.3f')} "
                     f"| {_f(x.get('back_to_back_s'), '.1f', 1e3)} | {_f(x.get('back_to_back_vs_fastest_fixed'), '.3f')} "
                     f"| {_f(x.get('mfu'), '.1%')} "
                     f"| {_f(x.get('peak_bytes_in_use'), '.0f', 1 / MB)} | {_f(x.get('loss_diff'), '.1e')} "
                     f"| {_f(x.get('grad_diff'), '.1e')} | {_f(x.get('param_diff'), '.1e')} | {x.get('answer', '-')} |")
    timed = [(n, x) for n, x in r["runs"].items() if "interleaved_s" in x]
    if timed:
        lines += ["", "Interleaved on one training state (median of each run's rounds; its time over the fastest "
                  "fixed strategy's in the same round, median over rounds):", "",
                  "| run | rounds | interleaved ms | / fastest fixed (same round) |", "|---|---|---|---|"]
        lines += [f"| {n} | {x['rounds']} | {x['interleaved_s'] * 1e3:.1f} | {_f(x.get('interleaved_vs_fastest_fixed'), '.4f')}"
                  f" ({x.get('interleaved_against', '-')}) |" for n, x in timed]
    for name, x in r["runs"].items():
        if name.startswith("smartremat") and "explain" in x:
            lines += ["", f"## {name}: budget {x['budget_mb']:.0f} MB, predicted {x['predicted_mb']:.0f} MB, compiled "
                      f"{x['temp_mb']:.0f} MB (model error {x['predicted_mb'] / x['temp_mb'] - 1:+.1%}); first call "
                      f"{x['first_s']:.1f} s, {_f(x.get('first_call_vs_fastest_fixed_compile'), '.1f')}x the fastest "
                      "fixed strategy's compile" + _same(x), ""] + _compiles(x) + ["```", x["explain"], "```"]
    return "\n".join(lines) + "\n"


def _same(x: dict) -> str:
    """Whether smartremat compiled the program of a fixed strategy (then their times differ by noise
    and the wrapper's host work alone), or that of another of its runs (e.g. of a `/placed=` one)."""
    if "same_program_as" not in x:
        return ""
    other = x["same_program_as"]
    return f"; the same program as {other}" if other else "; a program no fixed strategy compiled"


def _compiles(x: dict) -> list[str]:
    """The first call's compiles by what they are for (`benchmarks.planning_time.compile_breakdown`)."""
    kinds = dict(x.get("compiles_by_kind") or {})
    every = kinds.pop("all", None)
    if every is None:
        return []
    parts = "; ".join(f"{k}: {n}, {summed:.1f} s summed, {wall:.1f} s wall" for k, (n, summed, wall) in kinds.items())
    return [f"Compiles of the first call ({every[0]}, covering {every[2]:.1f} s of its {x['first_s']:.1f} s): {parts}.", ""]
