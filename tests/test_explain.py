"""explain's table, the frontier (exact against brute force), plot, and SMARTREMAT_LOG."""

import dataclasses
import itertools
import re
import sys

import jax
import jax.numpy as jnp
import pytest

import smartremat
from smartremat import MB
from smartremat import smartremat as sr
from smartremat._memory import cost_of, peak_of

from benchmarks.models import TutorialStack
from tests.helpers import backward
from tests.models import Transformer


@pytest.fixture(scope="module")
def plan():
    model = Transformer(3, 32, 4, jax.random.key(0))
    return smartremat.explain(sr(budget_mb=0.5, verify=False, calibrate=False)(model), jnp.ones((2, 32, 32)))


def test_frontier_is_exact_against_brute_force(plan):
    stages = plan.stages
    every = {(peak_of(stages, c), cost_of(stages, c))
             for c in itertools.product(*[range(len(s.saved)) for s in stages])}
    pareto = sorted((p, c) for p, c in every if not any(q <= p and d <= c and (q, d) != (p, c) for q, d in every))
    assert plan.frontier() == [((p + plan.fixed_bytes) / MB, c) for p, c in pareto]
    peaks = [p for p, _ in plan.frontier()]
    costs = [c for _, c in plan.frontier()]
    assert peaks == sorted(peaks) and costs == sorted(costs, reverse=True)
    # the chosen plan is the frontier point at the budget
    best = [(p, c) for p, c in plan.frontier() if p * MB <= plan.budget_bytes][-1]
    assert plan.recompute_flops == best[1]


def _rows(text):
    """`{block path: row cells}` from the table, expanding grouped rows like `layers[0:2]`."""
    lines = text.splitlines()
    rows = {}
    for line in lines[2:]:
        if not line.strip():
            break
        cells = line.split()
        label = cells[0]
        m = re.fullmatch(r"(.*)\[(\d+):(\d+)\]", label)
        paths = [f"{m.group(1)}[{i}]" for i in range(int(m.group(2)), int(m.group(3)))] if m else [label]
        for p in paths:
            rows[p] = cells
    return rows


def test_table_content(plan):
    text = str(plan)
    header = text.splitlines()[0].split()
    assert header[:4] == ["block", "type", "calls", "policy"] and header[-2:] == ["recompute", "GFLOP"]
    rows = _rows(text)
    assert set(rows) == {b.path for b in plan.blocks}
    for block in plan.blocks:
        cells = rows[block.path]
        assert cells[1] == block.type
        assert block.policy in cells
        marked = [c for c in cells if c.endswith("*")]
        assert marked == [f"{block.chosen.saved_bytes * block.calls / MB:.2f}*"]
    assert f"{plan.predicted_peak_bytes / MB:.2f} MB   budget {plan.budget_bytes / MB:.2f} MB" in text
    assert f"{plan.no_remat_peak_bytes / MB:.2f} MB   full remat {plan.full_remat_peak_bytes / MB:.2f} MB" in text
    overhead = 100 * plan.recompute_flops / plan.forward_flops
    assert f"{plan.recompute_flops / 1e9:.3f} GFLOP ({overhead:.1f}% of the forward)" in text
    assert f"{plan.planning_seconds:.2f} s on {plan.backend}" in text


def test_kept_bytes_below_zero_are_shown_as_a_note_not_a_negative_figure(plan):
    """A block whose gradient buffers hold later blocks' activations keeps "below zero" bytes in the
    model (docs/facts.md, fact 12): the table shows 0.00 (no "-7.60" a reader takes for a bug), and
    a note says how much those buffers hold."""
    first = plan.blocks[0]
    lending = dataclasses.replace(first, options=tuple(
        dataclasses.replace(o, saved_bytes=-int(0.25 * MB)) if o.name == "nothing_saveable" else o
        for o in first.options))
    text = str(dataclasses.replace(plan, blocks=(lending, *plan.blocks[1:])))
    table = text.split("\n\n")[0]
    assert not re.search(r"\s-\d", table)
    assert f"{first.path} {0.25 * first.calls:.2f} MB" in text and "(shown as 0.00 kept)" in text
    assert "shown as 0.00" not in str(plan)  # no note where nothing is below zero


def test_identical_consecutive_blocks_are_grouped():
    model = TutorialStack(6, 32, 64, jax.random.key(0))
    plan = smartremat.explain(sr(budget_mb=100, verify=False)(model), jnp.ones((4, 32)))
    assert set(plan.policies.values()) == {"none"}
    assert re.search(r"^layers\[0:6\]\s+ResidualBlock x6", str(plan), flags=re.M)


def test_plot_writes_a_figure(plan, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "frontier.png"
    plan.plot(str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_says_what_to_do(plan, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"`Plan.plot\(.*\)` needs matplotlib, which is not installed\. Install it"):
        plan.plot(str(tmp_path / "x.png"))


def test_smartremat_log_prints_each_new_plan(monkeypatch, capsys):
    monkeypatch.setenv("SMARTREMAT_LOG", "1")
    model = TutorialStack(2, 16, 32, jax.random.key(1))
    wrapped = sr(budget_mb=7.5, verify=False)(model)
    backward(wrapped, jnp.ones((3, 16)))
    out = capsys.readouterr().out
    assert "smartremat planned TutorialStack" in out and "budget 7.50 MB" in out
    backward(wrapped, jnp.ones((3, 16)))  # cached: no new plan, nothing printed
    assert "smartremat planned" not in capsys.readouterr().out


def test_logging_at_info_shows_the_plan(caplog):
    import logging

    caplog.set_level(logging.INFO, logger="smartremat")
    model = TutorialStack(2, 16, 32, jax.random.key(2))
    backward(sr(budget_mb=6.5, verify=False)(model), jnp.ones((3, 16)))
    assert any("smartremat planned TutorialStack" in r.getMessage() and "budget 6.50 MB" in r.getMessage()
               for r in caplog.records)


def test_worked_example_in_docs_holds():
    # docs/how-it-works.md: three blocks, no remat keeps 10 MB, full remat 1 MB, each needs 20 MB.
    from smartremat._memory import Stage
    from smartremat._solve import solve

    stages = [Stage(saved=(10, 1), peak=(20, 20), cost=(0, 7), group=i) for i in range(3)]
    assert peak_of(stages, (0, 0, 0)) == 40
    assert peak_of(stages, (1, 0, 0)) == 31 and peak_of(stages, (0, 0, 1)) == 40
    assert solve(stages, 32).choice == (1, 0, 0)
    assert solve(stages, 22).choice == (1, 1, 0) and solve(stages, 22).peak == 22


def test_two_lambdas_are_two_options_and_run_as_planned():
    calls = []
    saves_dots = lambda prim, *avals, **params: prim is jax.lax.dot_general_p  # noqa: E731
    saves_nothing = lambda prim, *avals, **params: calls.append(prim) or False  # noqa: E731
    model = TutorialStack(2, 16, 256, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (32, 16))
    options = dict(policies=[saves_dots, saves_nothing], verify=False, calibrate=False, nested=False)
    roomy = smartremat.explain(sr(budget_mb=100, **options)(model), x)
    for block in roomy.blocks:
        by_name = {o.name: o for o in block.options}
        assert {"<lambda>", "<lambda>#2"} <= set(by_name) and len(block.options) == 3
        assert by_name["<lambda>#2"].saved_bytes < by_name["<lambda>"].saved_bytes < by_name["none"].saved_bytes
    assert "MB <lambda>#2" in str(roomy)
    tight = sr(budget_mb=(roomy.min_peak_bytes + 1) / MB, **options)(model)
    plan = smartremat.explain(tight, x)
    assert "<lambda>#2" in plan.policies.values() and plan.predicted_peak_bytes == roomy.min_peak_bytes
    loss = lambda m: jnp.mean((m(x) - 1.0) ** 2)  # noqa: E731
    got = jax.jit(jax.grad(loss))(tight).module
    want = jax.grad(loss)(model)
    assert calls and all(jnp.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
