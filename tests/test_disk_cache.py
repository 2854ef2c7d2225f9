"""Plans cached on disk: a second process reads the plan instead of planning, and anything the plan
depends on (budget, flags, menu, the module's code) makes a new one."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import smartremat
from smartremat import _disk
from smartremat import smartremat as sr

from tests.helpers import backward, tree_allclose
from tests.models import MLPStack

OPTIONS = dict(calibrate=False, nested=False)


@pytest.fixture
def disk(tmp_path, monkeypatch):
    """The disk cache on, in a fresh folder; the in-memory caches empty."""
    monkeypatch.setenv("SMARTREMAT_DISK_CACHE", "1")
    monkeypatch.setenv("SMARTREMAT_CACHE_DIR", str(tmp_path))
    smartremat.clear_caches()
    yield tmp_path
    smartremat.clear_caches()


def _model():
    return MLPStack(3, 16, 64, jax.random.key(0)), jnp.ones((8, 16))


def _plan(model, x, budget_mb=1.0, **options):
    return smartremat.explain(sr(budget_mb=budget_mb, **{**OPTIONS, **options})(model), x)


def test_a_stored_plan_is_read_back_and_runs_the_same(disk):
    model, x = _model()
    first = _plan(model, x, budget_mb=0.05)
    assert first.compiles > 0 and len(list(disk.glob("*.json"))) == 1
    smartremat.clear_caches()  # as a new process: only the disk remembers
    again = _plan(model, x, budget_mb=0.05)
    assert again.compiles == 0 and "disk cache" in again.notes[-1]
    assert again.assignment == first.assignment and again.policies == first.policies
    assert again.compiled_peak_bytes == first.compiled_peak_bytes
    assert again.frontier() == first.frontier() and again.uniform() == first.uniform()  # the model came along
    got = backward(sr(budget_mb=0.05, **OPTIONS)(model), x).module
    want = backward(model, x)
    assert tree_allclose(got, want)


def _step(model, x):
    return eqx.filter_value_and_grad(lambda m: jnp.mean((m(x) - 1.0) ** 2))(model)


def test_filter_jit_plans_are_stored_and_read_back(disk):
    model, x = _model()
    first = smartremat.explain(smartremat.filter_jit(_step, budget_mb=0.1), model, x)
    assert first.compiles > 0 and len(list(disk.glob("*.json"))) == 1
    smartremat.clear_caches()
    planned = smartremat.filter_jit(_step, budget_mb=0.1)
    again = smartremat.explain(planned, model, x)
    assert again.compiles == 0 and "disk cache" in again.notes[-1]
    assert again.policies == first.policies and again.compiled_peak_bytes == first.compiled_peak_bytes
    assert tree_allclose(planned(model, x), _step(model, x))
    smartremat.clear_caches()
    assert smartremat.explain(smartremat.filter_jit(_step, budget_mb=0.09), model, x).compiles > 0


@pytest.mark.parametrize("change", ["budget", "xla_flags", "menu", "loss"])
def test_anything_the_plan_depends_on_makes_a_new_plan(disk, monkeypatch, change):
    model, x = _model()
    _plan(model, x)
    smartremat.clear_caches()
    options = {}
    if change == "budget":
        options["budget_mb"] = 0.9
    elif change == "xla_flags":  # read when the key is made; a flag XLA ignores here
        monkeypatch.setenv("XLA_FLAGS", os.environ["XLA_FLAGS"] + " --xla_dump_disable_metadata=true")
    elif change == "menu":
        options["policies"] = [None, jax.checkpoint_policies.nothing_saveable]
    else:
        options["loss"] = lambda out, t: jnp.mean((out - t) ** 2)
        options["loss_args"] = (jax.ShapeDtypeStruct(x.shape, x.dtype),)
    plan = _plan(model, x, **options)
    assert plan.compiles > 0, "planned again, not read from the disk"
    assert len(list(disk.glob("*.json"))) == 2


def test_the_modules_code_is_part_of_the_key(tmp_path, monkeypatch):
    """Two classes of the same name, module and fields whose `__call__` differs give different keys."""
    keys = []
    for n, body in enumerate(("return self.linear(x)", "return jax.nn.relu(self.linear(x))")):
        folder = tmp_path / str(n)
        folder.mkdir()
        (folder / "usermodel.py").write_text(textwrap.dedent(f"""
            import equinox as eqx, jax
            class Block(eqx.Module):
                linear: eqx.nn.Linear
                def __call__(self, x):
                    {body}
        """))
        monkeypatch.syspath_prepend(str(folder))
        sys.modules.pop("usermodel", None)
        import usermodel

        block = usermodel.Block(eqx.nn.Linear(4, 4, key=jax.random.key(0)))
        keys.append(_disk._code([block], type(block).__call__))
    sys.modules.pop("usermodel", None)
    assert None not in keys and keys[0] != keys[1]
    namespace: dict = {}
    exec("import equinox as eqx\nclass Typed(eqx.Module):\n    def __call__(self, x):\n        return x", namespace)
    typed = namespace["Typed"]()  # as typed into a REPL: no source to read, so never cached
    assert _disk._code([typed], type(typed).__call__) is None


def test_off_and_unstable_keys_store_nothing(disk, monkeypatch):
    model, x = _model()
    _plan(model, x, policies=[None, lambda *_, **__: False])  # a custom policy: no stable text
    assert list(disk.glob("*.json")) == []
    monkeypatch.setenv("SMARTREMAT_DISK_CACHE", "0")
    smartremat.clear_caches()
    _plan(model, x)
    assert list(disk.glob("*.json")) == []


def test_an_unreadable_or_foreign_file_is_ignored(disk, caplog):
    model, x = _model()
    first = _plan(model, x)
    (path,) = disk.glob("*.json")
    path.write_text(path.read_text()[:40])  # truncated
    smartremat.clear_caches()
    with caplog.at_level(logging.WARNING, logger="smartremat"):
        again = _plan(model, x)
    assert again.compiles > 0 and "ignoring the unreadable cached plan" in caplog.text
    data = json.loads(path.read_text())  # rewritten whole
    data["key"] = "another key"
    path.write_text(json.dumps(data))
    smartremat.clear_caches()
    assert _plan(model, x).compiles > 0 and again.policies == first.policies


def test_a_second_process_reads_the_plan(disk):
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, smartremat
        from tests.models import MLPStack
        model = MLPStack(3, 16, 64, jax.random.key(0))
        plan = smartremat.explain(smartremat.smartremat(budget_mb=0.05, calibrate=False, nested=False)(model),
                                  jnp.ones((8, 16)))
        print(plan.compiles, plan.policies)
    """)
    env = {**os.environ, "XLA_FLAGS": os.environ["XLA_FLAGS"], "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    (n1, p1), (n2, p2) = [r.stdout.strip().split(" ", 1) for r in runs]
    assert int(n1) > 0 and int(n2) == 0 and p1 == p2
