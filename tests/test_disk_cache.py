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

from benchmarks.models import TutorialStack
from tests.helpers import backward, tree_allclose

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
    return TutorialStack(3, 16, 64, jax.random.key(0)), jnp.ones((8, 16))


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
    assert again.checked == first.checked  # each compiled candidate's predicted and compiled bytes
    assert (first.predicted_peak_bytes, first.compiled_peak_bytes) in first.checked
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


def _user_module(tmp_path, monkeypatch, n, body):
    """`usermodel.Block` from its own file: same name, module and fields, `__call__` as given."""
    folder = tmp_path / f"src{n}"
    folder.mkdir()
    (folder / "usermodel.py").write_text(textwrap.dedent(f"""
        import equinox as eqx, jax
        class Block(eqx.Module):
            linear: eqx.nn.Linear
            depth: int = eqx.field(static=True, default=1)
            def __call__(self, x):
                for _ in range(self.depth):
                    x = {body}
                return x
    """))
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop("usermodel", None)
    import usermodel

    sys.modules.pop("usermodel", None)
    return usermodel.Block


class Outer(eqx.Module):
    inner: eqx.Module

    def __call__(self, x):
        return self.inner(x)


@pytest.mark.parametrize("change", ["code", "static_field"])
def test_the_traced_program_is_part_of_the_key(disk, tmp_path, monkeypatch, change):
    """A changed `__call__`, or a static field that changes what runs, is a new plan."""
    x = jnp.ones(16)
    linear = eqx.nn.Linear(16, 16, key=jax.random.key(0))
    first = _user_module(tmp_path, monkeypatch, 0, "jax.numpy.tanh(self.linear(x))")
    if change == "code":
        second = _user_module(tmp_path, monkeypatch, 1, "jax.nn.relu(self.linear(x))")(linear)
    else:
        second = first(linear, depth=3)
    assert _plan(Outer(first(linear)), x, budget_mb=1.0).compiles > 0
    smartremat.clear_caches()
    assert _plan(Outer(second), x, budget_mb=1.0).compiles > 0, "read the other module's plan"
    assert len(list(disk.glob("*.json"))) == 2


def test_a_static_argument_of_the_step_is_part_of_the_key(disk):
    model, x = _model()

    def step(model, x, n):  # `n` is static for filter_jit: it changes the program, not the arrays
        return eqx.filter_grad(lambda m: jnp.mean(m(jnp.tile(x, (n, 1))) ** 2))(model)

    plans = []
    for n in (1, 4):
        smartremat.clear_caches()
        plans.append(smartremat.explain(smartremat.filter_jit(step, budget_mb=0.3), model, x, n))
    assert all(p.compiles > 0 for p in plans) and len(list(disk.glob("*.json"))) == 2


def test_an_automatic_budget_is_keyed_by_the_device_limit(disk, monkeypatch):
    from smartremat import _step_plan

    model, x = _model()
    plans = []
    for limit in (64 * 2**20, 32 * 2**20):
        monkeypatch.setattr(_step_plan, "_device_limit", lambda sig, limit=limit: limit)
        smartremat.clear_caches()
        plans.append(smartremat.explain(smartremat.filter_jit(_step, budget_mb="auto"), model, x))
    assert all(p.compiles > 0 for p in plans) and plans[0].budget_bytes > plans[1].budget_bytes


class TupleKeyed(eqx.Module):
    blocks: dict

    def __call__(self, x):
        for k in sorted(self.blocks):
            x = self.blocks[k](x)
        return x


def test_paths_that_do_not_survive_json_are_not_stored(disk):
    """Dict keys that are tuples come back from JSON as lists: such a plan is made, not cached."""
    model, x = _model()
    keyed = TupleKeyed({("enc", i): layer for i, layer in enumerate(model.layers)})
    plan = _plan(keyed, x, budget_mb=0.05)
    assert plan.compiles > 0 and any(isinstance(step[1], tuple) for path, _ in plan.assignment for step in path)
    assert list(disk.glob("*")) == []


def test_off_and_unstable_keys_store_nothing(disk, monkeypatch):
    model, x = _model()
    _plan(model, x, policies=[None, lambda *_, **__: False])  # a custom policy: no stable text
    assert list(disk.glob("*.json")) == []
    monkeypatch.setenv("SMARTREMAT_DISK_CACHE", "0")
    smartremat.clear_caches()
    _plan(model, x)
    assert list(disk.glob("*.json")) == []


def test_with_the_cache_off_no_disk_key_is_made(disk, monkeypatch):
    """A key's text hashes the traced program (seconds at real size): not made when nothing is stored."""
    from smartremat import _key

    def hashed(jaxpr):
        raise AssertionError("the disk key's text was made with the disk cache off")

    monkeypatch.setenv("SMARTREMAT_DISK_CACHE", "0")
    monkeypatch.setattr(_key, "_program", hashed)
    smartremat.clear_caches()
    model, x = _model()
    assert smartremat.explain(smartremat.filter_jit(_step, budget_mb=0.1), model, x).compiles > 0
    assert _plan(model, x).blocks


def test_a_blocks_function_whose_source_cannot_be_read_plans_without_a_disk_key(disk, monkeypatch):
    # the file changed on disk after import: `inspect.getsource` fails with whatever the tokenizer raises
    import inspect
    import tokenize

    def unreadable(obj):
        raise tokenize.TokenError("EOF in multi-line statement", (1, 0))

    model, x = _model()
    monkeypatch.setattr(inspect, "getsource", unreadable)
    plan = _plan(model, x, blocks=lambda m: m.layers)
    assert plan.blocks and list(disk.glob("*.json")) == []


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
    path.write_text("[1, 2]")  # JSON, but not a plan
    smartremat.clear_caches()
    assert _plan(model, x).compiles > 0
    data["key"] = "another key"
    path.write_text(json.dumps(data))
    smartremat.clear_caches()
    assert _plan(model, x).compiles > 0 and again.policies == first.policies


def test_a_second_process_reads_the_plan(disk):
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, smartremat
        from benchmarks.models import TutorialStack
        model = TutorialStack(3, 16, 64, jax.random.key(0))
        plan = smartremat.explain(smartremat.smartremat(budget_mb=0.05, calibrate=False, nested=False)(model),
                                  jnp.ones((8, 16)))
        print(plan.compiles, plan.policies)
    """)
    env = {**os.environ, "XLA_FLAGS": os.environ["XLA_FLAGS"], "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    (n1, p1), (n2, p2) = [r.stdout.strip().split(" ", 1) for r in runs]
    assert int(n1) > 0 and int(n2) == 0 and p1 == p2
