"""The benchmark's machinery end to end on a tiny configuration (fields and fit, not timings), and
the rules of the `tune=True` study (`studies/tune_rules.py`)."""

import json
import sys
import types

import jax
import numpy as np
import pytest


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    sys.modules.pop("benchmarks.run", None)
    from benchmarks import run

    out = tmp_path_factory.mktemp("bench")
    run.main(["--size", "tiny", "--models", "tutorial", "--budgets", "3", "--repeat", "2", "--out", str(out)])
    return out


def test_json_fields_and_fit(results):
    data = json.loads((results / "tutorial.json").read_text())
    assert set(data["fixed"]) == {"none", "full", "dots", "dots_nb", "alternate", "sqrt"}
    for f in data["fixed"].values():
        assert {"temp_mb", "gflops", "step_s", "grad_rel_diff"} <= set(f)
        assert f["grad_rel_diff"] < 1e-5
    rows = data["smartremat"]
    assert len(rows) >= 3
    for r in rows:
        assert {"budget_mb", "predicted_mb", "temp_mb", "fits", "gflops", "step_s", "grad_rel_diff",
                "planning_s", "policies"} <= set(r)
        assert r["temp_mb"] <= r["budget_mb"] * (1 + 1e-9) and r["fits"]
        assert r["grad_rel_diff"] < 1e-5
    budgets = [r["budget_mb"] for r in rows]
    assert max(budgets) == pytest.approx(max(data["fixed"]["none"]["temp_mb"], data["fixed"]["full"]["temp_mb"]))
    head = data["headlines"]
    assert head["fit_share"] == 1.0
    assert len(head["tightness"]) == len(rows) and all(t <= 1 + 1e-9 for t in head["tightness"])
    assert {"speed_vs_best_fitting_fixed", "overhead_recovered_at_half", "model_error", "noise", "env"} - set(head) == {"env"}
    assert head["none_again_step_s"] > 0  # the no-remat step, compiled and timed a second time
    none = data["fixed"]["none"]["step_s"]
    assert head["noise"] == pytest.approx(abs(head["none_again_step_s"] - none) / none)
    assert data["env"]["jax"]


def test_tuned_rows_and_shared_programs(results):
    """Both plans per budget are reported; a plan that is a fixed strategy's program is timed as it."""
    data = json.loads((results / "tutorial.json").read_text())
    assert len(data["tuned"]) == len(data["smartremat"])
    for r in data["tuned"]:
        assert r["fits"] and r["grad_rel_diff"] < 1e-5
    head = data["headlines_tuned"]
    assert head["fit_share"] == 1.0
    half = min(data["tuned"], key=lambda r: abs(r["budget_mb"] - head["half_budget_mb"]))
    fitting = [f["step_s"] for f in data["fixed"].values() if f["temp_mb"] <= half["budget_mb"]]
    if max(fitting) > min(fitting):  # the measure, from the recorded times
        want = (max(fitting) - half["step_s"]) / (max(fitting) - min(fitting))
        assert head["gap_recovered_at_half"] == pytest.approx(want)
    rows = data["smartremat"] + data["tuned"]
    shared = [r for r in rows if r["same_as"] is not None]
    assert shared  # the tiny stack's plans include uniform ones
    for r in shared:
        assert r["step_s"] == data["fixed"][r["same_as"]]["step_s"]
        assert r["temp_mb"] == data["fixed"][r["same_as"]]["temp_mb"]


def test_summary_written(results):
    text = (results / "summary.md").read_text()
    assert "| tutorial | default | 100% |" in text and "| tutorial | tune=True | 100% |" in text
    assert "## tutorial" in text


@pytest.mark.parametrize("a, b, want", [
    ([5.0] * 7 + [10.1] * 4, [10.0] * 11, True),  # 7 of 11 won, by far: significant by rank, not by count
    ([9.9] * 7 + [15.0] * 4, [10.0] * 11, False),  # 7 won by a hair, 4 lost by far
    ([9.0] * 5, [10.0] * 5, True),  # every one of 5 rounds: p = 1/32
    ([9.0] * 4, [10.0] * 4, False),  # every one of 4: p = 1/16
    ([10.0] * 11, [10.0] * 11, False),  # equal
])
def test_tune_rules_signed_rank_rule_is_a_one_sided_test_at_five_percent(a, b, want):
    from studies.tune_rules import faster

    assert faster(a, b) is want


@pytest.mark.parametrize("rule, want", [
    ("default", 0),
    ("lowest median", 1),  # median 4 < 5 < 6
    ("lowest mean", 2),  # 1's one slow round (50) lifts its mean above 2's
    ("lowest min", 0),  # 0's fastest round (2) is the fastest of those that fit
    ("lowest q25", 1),
])
def test_tune_rules_each_rule_picks_by_its_statistic_among_those_that_fit(rule, want):
    from studies.tune_rules import choose

    times = [[2.0, 6.0, 6.0, 6.0, 6.0], [3.5, 4.0, 4.0, 4.0, 50.0], [5.0, 5.0, 5.0, 5.0, 5.0], [0.1] * 5]
    assert choose(rule, times, fits=[0, 1, 2], incumbent=0) == want  # 3 is fastest but does not fit


def test_tune_rules_replays_recorded_rounds_without_timing(tmp_path, capsys):
    from studies.tune_rules import main

    programs = [{"temp": t, "flops": 1.0, "times": [s + 0.01 * (k % 3) for k in range(12)]}
                for t, s in [(4, 1.0), (2, 2.0), (3, 1.5)]]
    run = {"programs": programs, "fixed": {"none": 0, "full": 1}, "default": [0, 1, 2], "budgets": [4, 2, 3]}
    (tmp_path / "r.json").write_text(json.dumps({"toy": run}))
    main(["--load", str(tmp_path / "r.json"), "--models", "toy", "--trials", "5", "--n", "6",
          "--rules", "default", "lowest median"])
    out = capsys.readouterr().out
    assert "toy" in out and "Spearman between two halves" in out
    # ratios 1, 1 and 0.75 (at budget 3 the default, program 2 at 1.5, beats the one fixed that fits, 1 at 2.0)
    assert "n=  6 default        median ratio 1.000" in out
    assert "n=  6 lowest median  median ratio 1.000" in out and "worst 1.000" in out
    with pytest.raises(ValueError, match=r"`--n 12` leaves none of the 12 rounds to judge .* below 12"):
        main(["--load", str(tmp_path / "r.json"), "--models", "toy", "--trials", "5", "--n", "12"])


@pytest.mark.parametrize("step, repeat, want", [(1.0, 20, 20), (1 / 64, 20, 256), (1 / 64, 300, 300), (1e-6, 20, 400)])
def test_benchmark_times_short_steps_in_more_rounds(step, repeat, want):
    from benchmarks import run

    class Fake:
        def run(self):
            return step

    assert run.SECONDS == 4.0 and run.MAX_REPEAT == 400  # about 4 s per program, at most 400 rounds
    assert run.repeat_for([Fake(), Fake()], repeat) == want


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_the_accelerator_check_runs_tiny_on_a_simulated_chip(tmp_path, standard_promotion):
    """`benchmarks/accelerator_check.py` (a step that does not fit the chip without remat) on a tiny
    GPT here, on a simulated chip of 1 MB (tests/simulated_chip.py), so it cannot rot: the step
    without remat is a refused row, smartremat's "auto" plan fits the chip, runs and equals full
    remat's loss, gradients and parameters; every field is written."""
    from benchmarks import accelerator_check
    from tests.simulated_chip import simulated_chip

    with simulated_chip(2**20):
        result = accelerator_check.main(["--size", "tiny", "--batch", "2", "--budgets", "0.9/flat/raw/tie=0,auto", "--strategies",
                                         "full,none", "--steps", "1", "--out", str(tmp_path), "--precision", "highest",
                                         "--rounds", "2"])
    path = next(tmp_path.glob("accelerator_check_*.json"))
    written = json.loads(path.read_text())
    md = path.with_suffix(".md").read_text()
    assert written == json.loads(json.dumps(result)) and md
    assert path.name.endswith("_unrolled_float32_batch2_highest.json") and written["matmul_precision"] == "highest"
    assert {"device", "jax", "equinox", "bytes_limit", "flops_per_step", "commands", "runs"} <= set(written)
    assert written["bytes_limit"] == 2**20 and written["commands"][0].startswith("benchmarks/accelerator_check.py")
    runs = written["runs"]
    # "auto" on a fresh process, then the fixed strategies (the reference first), then the other budgets
    assert list(runs) == ["smartremat auto", "full", "none", "smartremat 0.9/flat/raw/tie=0"]
    assert "dots_saveable" in runs["smartremat 0.9/flat/raw/tie=0"]["options"]  # what planning weighed ("/flat": nested=False)
    assert "RESOURCE_EXHAUSTED" in runs["none"]["refused"] and written["compute_dtype"] == "float32"
    for smart in (runs["smartremat 0.9/flat/raw/tie=0"], runs["smartremat auto"]):
        assert smart["temp_mb"] <= smart["budget_mb"] and smart["policies"] and smart["explain"]
        assert max(smart["loss_diff"], smart["grad_diff"], smart["param_diff"]) < 1e-5
        assert smart["answer"] == "same"
    assert "block profiles" not in runs["smartremat 0.9/flat/raw/tie=0"]["compiles_by_kind"]  # "/raw": calibrate=False
    kinds = runs["smartremat auto"]["compiles_by_kind"]  # the first call's compiles, by what for
    assert kinds["block profiles"][0] > 0 and kinds["candidate steps (verify)"][0] > 0 and "compiles_by_kind" not in runs["full"]
    assert kinds["all"][0] == sum(n for k, (n, _, _) in kinds.items() if k != "all")
    assert kinds["all"][2] <= runs["smartremat auto"]["first_s"] and "Compiles of the first call (" in path.with_suffix(".md").read_text()
    g, p = np.linspace(-1.0, 1.0, 8, dtype=np.float32), np.ones(8, np.float32)
    moved = types.SimpleNamespace(kept={"full": (1.0, [g], [p]), "x": (1.0, [g * 1.01], [p])}, compute="float32")
    assert accelerator_check.differences(moved, "x")["answer"].startswith("1 leaves differ; [1][0]: 8 of 8 entries")
    assert smart["step_s"] > 0 and smart["vs_fastest_fixed"] is not None and written["fastest_fitting_fixed"] == "full"
    assert smart["back_to_back_s"] > 0 and smart["back_to_back_vs_fastest_fixed"] is not None
    # the steps timed in turn on one shared state (each run's treedef over the same leaves), after the runs
    assert "interleaved_s" not in runs["none"] and runs["full"]["interleaved_vs_fastest_fixed"] == 1.0
    for smart in (runs["smartremat 0.9/flat/raw/tie=0"], runs["smartremat auto"]):
        assert smart["rounds"] == 2 and smart["interleaved_s"] > 0 and smart["interleaved_against"] == "full"
    assert "| smartremat auto | 2 |" in md and "Interleaved on one training state" in md
    # the program smartremat ran (its executable, not compiled again) against the fixed strategies'
    # three programs: with the default tie margin "0.9/flat" ran one of the other two (on 99186fb), "/tie=0" another
    # (uncalibrated, "/raw", too)
    assert len({runs[n]["program"] for n in ("full", "smartremat 0.9/flat/raw/tie=0", "smartremat auto")}) == 3
    assert runs["smartremat auto"]["same_program_as"] is None and "a program no fixed strategy compiled" in md
    runs["full"]["program"] = runs["smartremat auto"]["program"]
    accelerator_check.derived(written, written["flops_per_step"], written["peak_tflops"])
    assert runs["smartremat auto"]["same_program_as"] == "full"
    assert "the same program as full" in accelerator_check.markdown(written)
    with pytest.raises(SystemExit, match="--strategies none: the reference of the differences, full, is needed"):
        accelerator_check.main(["--size", "tiny", "--strategies", "none", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--budgets 1e3: auto or numbers of MB, each optionally followed by /flat"):
        accelerator_check.main(["--size", "tiny", "--budgets", "1e3", "--out", str(tmp_path)])
    from smartremat import _search, internal

    with accelerator_check.margin_of("smartremat auto/tie=0.25"):  # "/tie=": the search's tie margin while it plans
        assert _search.TIE_MARGIN == 0.25
    assert _search.TIE_MARGIN == internal.TIE_MARGIN != 0.25


def test_a_mixed_strategy_places_each_blocks_policy_and_gives_the_same_answer():
    """`benchmarks/strategies.py`'s per-block strategies (hand-placed plans the accelerator check
    times against smartremat's): each block under its named policy, the attention alone under
    `attn:<policy>`, the loss and gradient of no remat; a spec of the wrong length is refused."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from benchmarks.models import SequenceGPT, sequence_gpt_loss
    from benchmarks.strategies import Ckpt, strategy
    from tests.helpers import tree_allclose

    model = SequenceGPT(layers=3, d=16, heads=2, seq=8, vocab=32, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 32)
    mixed = strategy(model, "attn:dots_nb+full*1+none", lambda m: m.blocks)
    assert isinstance(mixed.blocks[0].attn, Ckpt) and not isinstance(mixed.blocks[0], Ckpt)
    assert isinstance(mixed.blocks[1], Ckpt) and type(mixed.blocks[2]) is type(model.blocks[2])
    grad = eqx.filter_jit(lambda m: eqx.filter_value_and_grad(sequence_gpt_loss)(m, tokens))
    (l0, g0), (l1, g1) = grad(model), grad(mixed)
    unwrap = lambda t: t.module if isinstance(t, Ckpt) else t  # noqa: E731
    g1 = jax.tree.map(unwrap, g1, is_leaf=lambda t: isinstance(t, Ckpt))
    assert jnp.allclose(l0, l1, rtol=1e-6) and tree_allclose(eqx.filter(g0, eqx.is_array), eqx.filter(g1, eqx.is_array))
    with pytest.raises(ValueError, match=r"strategy 'dots_nb\*2': 2 policies of .* for 3 blocks"):
        strategy(model, "dots_nb*2", lambda m: m.blocks)
    with pytest.raises(ValueError, match=r"strategy 'dots_nb\+sometimes\+none': 3 policies of"):
        strategy(model, "dots_nb+sometimes+none", lambda m: m.blocks)


def test_the_planning_breakdown_is_judged_against_dots_nb_where_the_chip_refuses_no_remat(standard_promotion):
    """`benchmarks/planning_time.py --real` on an accelerator at real size: the plain step is
    refused, so the first plan is judged against the step with every block under dots_nb, and no
    remat's temp bytes (which set the budget) are read off the refusal."""
    import equinox as eqx
    import jax

    from benchmarks.models import GPT, gpt_loss
    from benchmarks.planning_time import baseline_compile
    from benchmarks.strategies import strategy
    from tests.simulated_chip import simulated_chip

    model = GPT(2, 32, 2, 32, 64, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (32, 32), 0, 64)

    def step(model, tokens):
        loss, grads = eqx.filter_value_and_grad(gpt_loss)(model, tokens)
        return loss, eqx.apply_updates(model, jax.tree.map(lambda g: -1e-3 * g, grads))

    what, seconds, plain = baseline_compile(step, model, tokens)
    assert what == "plain" and seconds > 0
    fixed = strategy(model, "dots_nb", lambda m: m.blocks)
    m = eqx.filter_jit(step).lower(fixed, tokens).compile().compiled.memory_analysis()
    assert m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes < plain - 1  # dots_nb fits
    with simulated_chip(plain - 1) as chip:
        what, seconds, read = baseline_compile(step, model, tokens)
    assert what == "no remat refused; dots_nb's" and len(chip.refused) == 1
    assert abs(read - plain) <= 0.005 * plain  # XLA prints two decimals of the unit


def test_the_accelerator_check_compiles_a_strategy_again_under_another_name(tmp_path):
    """`<name>@<k>` is the fixed strategy `<name>` (a second compile of one program, to time two
    compiles of it against each other), and smartremat at a budget `/placed=<name>` plans the model
    under it; an unknown name stays an error."""
    from benchmarks import accelerator_check

    c = accelerator_check.Check("tiny", "unrolled", "float32", 2)
    again, plain = c.fresh("full@2")[0], c.fresh("full")[0]
    assert jax.tree.structure(again) == jax.tree.structure(plain) != jax.tree.structure(c.fresh("smartremat")[0])
    with pytest.raises(ValueError, match="unknown strategy 'fulll'"):
        c.fresh("fulll@2")
    for argv in (["--strategies", "full,fulll@2"], ["--budgets", "9/placed=fulll", "--strategies", "full"]):  # before any run
        with pytest.raises(SystemExit, match="unknown strategy 'fulll'; a fixed strategy is none, full"):
            accelerator_check.main(["--size", "tiny", "--out", str(tmp_path), *argv])
    # "/placed=": smartremat planning the model with a fixed strategy placed by hand
    assert jax.tree.structure(c.fresh("smartremat 100000/placed=full")[0]) == jax.tree.structure(plain)
    rows = {"full": {"step_s": 1.0, "program": "a", "compile_s": 1.0},
            "smartremat 9": {"step_s": 1.0, "program": "b", "first_s": 2.0},
            "smartremat 100000/placed=full": {"step_s": 1.0, "program": "b", "first_s": 2.0}}
    accelerator_check.derived({"runs": rows}, 1.0, None)  # a plan's program is a fixed strategy's, or another plan's
    assert rows["smartremat 9"]["same_program_as"] == "smartremat 100000/placed=full"
    rows["full"]["program"] = "b"
    accelerator_check.derived({"runs": rows}, 1.0, None)
    assert rows["smartremat 9"]["same_program_as"] == "full"
