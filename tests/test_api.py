import json
import sys

import jax
import pytest
import jax.numpy as jnp

import smartremat
from smartremat import MB, Plan, PlanBlock, PolicyFigures, SmartRemat, explain, filter_jit
from smartremat import smartremat as smartremat_decorator

from benchmarks.models import TutorialBlock, TutorialStack
from tests.helpers import tree_allclose


def test_public_names():
    # `smartremat.internal` (the benchmarks' and studies' names, no stability promise) is a submodule,
    # an attribute of the package once anything imported it (benchmarks/run.py does)
    assert getattr(smartremat, "internal", None) in (None, sys.modules.get("smartremat.internal"))
    assert set(n for n in dir(smartremat) if not n.startswith("_")) - {"internal"} == {
        "MB", "Plan", "PlanBlock", "PolicyFigures", "SmartRemat", "clear_caches", "explain", "filter_jit", "load_plan",
        "smartremat"}
    assert callable(filter_jit)
    assert smartremat.smartremat is smartremat_decorator
    assert smartremat.explain is explain and smartremat.explain is not getattr(smartremat_decorator, "explain")
    assert MB == 2**20
    assert all(isinstance(t, type) for t in (Plan, PlanBlock, PolicyFigures, SmartRemat))


def test_class_decorator_keeps_fields_pytree_outputs():
    class Plain(TutorialStack):
        pass

    @smartremat_decorator(budget_mb=6)
    class Decorated(TutorialStack):
        pass

    key = jax.random.key(0)
    a, b = Plain(3, 64, 256, key), Decorated(3, 64, 256, key)
    assert type(b) is Decorated and isinstance(b, TutorialStack)
    assert [f.name for f in a.__dataclass_fields__.values()] == [f.name for f in b.__dataclass_fields__.values()]
    leaves_a, def_a = jax.tree.flatten(a)
    leaves_b, def_b = jax.tree.flatten(b)
    assert def_a.num_leaves == def_b.num_leaves and all(x is not None for x in leaves_b)
    assert tree_allclose(leaves_a, leaves_b, rtol=0)
    x = jnp.ones((8, 64))
    assert tree_allclose(b(x), a(x), rtol=1e-6)


def test_instance_form_shares_arrays():
    model = TutorialStack(2, 64, 256, jax.random.key(1))
    wrapped = smartremat_decorator(budget_mb=1)(model)
    assert isinstance(wrapped, SmartRemat)
    assert all(x is y for x, y in zip(jax.tree.leaves(wrapped), jax.tree.leaves(model)))
    x = jnp.ones((4, 64))
    assert tree_allclose(wrapped(x), model(x))


def test_the_decorators_explain_is_the_packages_with_a_warning_naming_it():
    # `from smartremat import smartremat` then `smartremat.explain(...)`, as earlier versions allowed
    model = TutorialBlock(64, 512, jax.random.key(2))
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    with pytest.warns(DeprecationWarning, match=r"`smartremat.explain\(...\)` after `import smartremat`, or "
                                                r"`from smartremat import explain`"):
        plan = smartremat_decorator.explain(model, x, budget_mb=4)  # type: ignore[attr-defined]
    assert plan == explain(model, x, budget_mb=4)


def test_explain_both_spellings_and_json():
    model = TutorialBlock(64, 512, jax.random.key(2))
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    plan = smartremat.explain(model, x, budget_mb=4)
    assert plan == explain(model, x, budget_mb=4)
    d = json.loads(json.dumps(plan.to_dict()))
    for k in ("budget_mb", "predicted_peak_mb", "no_remat_peak_mb", "full_remat_peak_mb",
              "recompute_flops", "blocks"):
        assert k in d
    (block,) = d["blocks"]
    assert set(block) >= {"path", "type", "calls", "policy", "saved_mb", "recompute_flops", "policies"}
    assert block["path"] == "<self>" and block["type"] == "TutorialBlock" and block["calls"] == 1
    assert set(block["policies"]) >= {"none", "nothing_saveable"}
    assert d["budget_mb"] == 4


def test_explain_reads_decorator_budget():
    @smartremat_decorator(budget_mb=3)
    class Block(TutorialBlock):
        pass

    m = Block(64, 512, jax.random.key(3))
    x = jnp.ones((16, 64))
    assert explain(m, x).budget_bytes == 3 * MB
    assert explain(m, x, budget_mb=5).budget_bytes == 5 * MB


def test_plan_table_names_blocks_and_totals():
    model = TutorialStack(3, 64, 256, jax.random.key(4))
    plan = explain(model, jnp.ones((8, 64)), budget_mb=2)
    text = str(plan)
    assert "ResidualBlock" in text and "predicted peak" in text and "budget 2.00 MB" in text
    for b in plan.blocks:
        assert b.policy in text
    assert "layers[0]" in text or "layers[0:" in text
