"""Saved plans are one truth: what `load_plan` reads back is what runs, what prints and what explain shows."""

import json
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

import smartremat
from smartremat import MB, _planner
from smartremat._options import NO_REMAT
from smartremat import smartremat as sr

from benchmarks.models import TutorialStack
from tests.helpers import tree_allclose

OPTIONS = dict(verify=False, calibrate=False, nested=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`(model, x, plan, path, its JSON)` for a plan that checkpoints some blocks and not others."""
    model = TutorialStack(3, 16, 256, jax.random.key(0))
    x = jnp.ones((32, 16))
    roomy = smartremat.explain(sr(budget_mb=100, **OPTIONS)(model), x)
    budget = (roomy.min_peak_bytes + roomy.no_remat_peak_bytes) / 2 / MB
    plan = smartremat.explain(sr(budget_mb=budget, **OPTIONS)(model), x)
    assert len(set(plan.policies.values())) > 1, plan.policies
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    plan.save(str(path))
    return model, x, plan, path, json.loads(path.read_text())


def test_load_plan_names_the_file_and_what_is_wrong(saved, tmp_path):
    _, _, _, path, data = saved
    truncated = tmp_path / "truncated.json"
    truncated.write_text(path.read_text()[: len(path.read_text()) // 2])
    with pytest.raises(ValueError, match=r"`load_plan\('.*truncated\.json'\)`: the file is not JSON .*"
                       r"Save the plan again with `plan\.save\(path\)`"):
        smartremat.load_plan(truncated)
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps({k: v for k, v in data.items() if k != "blocks"}))
    with pytest.raises(ValueError, match=r"`load_plan\('.*missing\.json'\)`: the field 'blocks' is missing.*plan\.save\(path\)"):
        smartremat.load_plan(missing)
    unknown = json.loads(json.dumps(data))
    unknown["assignment"][0][1] = "dots_savable"
    with pytest.raises(ValueError, match=r"`load_plan\(the dict given\)`: the plan names the policy 'dots_savable', "
                       r"which `load_plan` cannot rebuild.*Plan again"):
        smartremat.load_plan(unknown)


def test_budget_below_the_saved_plans_peak_is_refused(saved):
    model, x, plan, path, _ = saved
    loaded = smartremat.load_plan(path)
    low = plan.predicted_peak_bytes / MB / 2
    with pytest.raises(ValueError, match=rf"`smartremat\(budget_mb={low:g}, plan=\.\.\.\)`: the saved plan runs as it "
                       rf"was saved, and its peak is {plan.predicted_peak_bytes / MB:.3f} MB .*Raise `budget_mb` to at "
                       r"least \d+\.\d\d to run this plan, or plan again"):
        sr(budget_mb=low, plan=loaded)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sr(budget_mb=1000, plan=loaded)  # far above the plan's budget: runs the plan, says nothing


def test_explain_of_a_model_with_a_saved_plan_shows_that_plan(saved, monkeypatch):
    model, x, plan, path, _ = saved
    loaded = smartremat.load_plan(path)
    monkeypatch.setattr(_planner, "make_plan", lambda *a: pytest.fail("planned despite a loaded plan"))
    wrapped = sr(budget_mb=1000, plan=loaded)(model)
    assert smartremat.explain(wrapped, x) is loaded
    with pytest.raises(ValueError, match=r"`smartremat\(plan=\.\.\.\)` was made for a different module or input signature"):
        smartremat.explain(wrapped, jnp.ones((8, 16)))


def test_hand_edited_policy_must_agree_with_what_runs(saved, tmp_path):
    model, x, plan, path, data = saved
    row = next(b for b in data["blocks"] if b["policy"] != "none")
    edited = json.loads(json.dumps(data))
    next(b for b in edited["blocks"] if b["path"] == row["path"])["policy"] = "none"
    with pytest.raises(ValueError, match=re.escape(f"block '{row['path']}' is shown with the policy 'none' in 'blocks' but runs "
                                                   f"'{row['policy']}' by the 'assignment'") + ".*Re-plan .*or edit both"):
        smartremat.load_plan(edited)
    entry = next(e for e in edited["assignment"] if e[1] == row["policy"])
    entry[1] = "none"  # both edited: loads, and prints what runs
    both = tmp_path / "both.json"
    both.write_text(json.dumps(edited))
    loaded = smartremat.load_plan(both)
    assert loaded.policies[row["path"]] == "none" and dict(loaded.assignment)[tuple(map(tuple, entry[0]))] == NO_REMAT
    got = jax.grad(lambda m: jnp.mean(m(x) ** 2))(sr(budget_mb=1000, plan=loaded)(model)).module
    assert tree_allclose(got, jax.grad(lambda m: jnp.mean(m(x) ** 2))(model), rtol=1e-5)


def test_a_loaded_plan_keeps_its_frontier_and_one_saved_without_says_how_to_get_it(saved):
    """`Plan.save`, `load_plan` and the disk cache share one format, which keeps the profile: a
    loaded plan has the saved plan's frontier and uniform plans; a file without it (written before
    the format kept it) says how to get them."""
    _, _, plan, path, _ = saved
    loaded = smartremat.load_plan(path)
    assert loaded.frontier() == plan.frontier() and len(plan.frontier()) > 1
    assert loaded.uniform() == plan.uniform() != {}
    data = json.loads(pathlib.Path(path).read_text())
    del data["stages"], data["menu"]
    old = smartremat.load_plan(data)
    with pytest.raises(ValueError, match=r"loaded from JSON \(`smartremat\.load_plan`\) without the profile.*Call `smartremat\.explain"):
        old.frontier()
    assert old.uniform() == {}
