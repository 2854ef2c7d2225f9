"""`smartremat.filter_jit` as a user meets it: errors, no retracing, `explain`, `.lower`, decorated
modules inside, two modules in one step, an outer `jit`, and `budget_mb="auto"`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import numpy as np
import pytest

import smartremat
from smartremat import MB, _step, _step_plan

from benchmarks.models import TutorialStack
from tests.helpers import tree_allclose

OPT = optax.sgd(1e-2, momentum=0.9)


def step(model, opt_state, x, y):
    value, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    updates, opt_state = OPT.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return value, eqx.apply_updates(model, updates), opt_state


def grads(model, x, y):
    """A step whose outputs are produced during the backward (so temp bytes are not ~0)."""
    return eqx.filter_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)


def _temp(jitted, *args) -> int:
    lowered = jitted.lower(*args)
    return getattr(lowered, "lowered", lowered).compile().memory_analysis().temp_size_in_bytes


def _setup(model=None):
    model = TutorialStack(3, 64, 1024, jax.random.key(0)) if model is None else model
    x = jax.random.normal(jax.random.key(1), (64, 64))
    return model, OPT.init(eqx.filter(model, eqx.is_array)), x, jnp.tanh(x)


def test_plans_once_then_runs_without_retracing():
    traces = []

    def counted(*args):
        traces.append(1)
        return step(*args)

    planned = smartremat.filter_jit(counted, budget_mb=8)
    args = _setup()
    first = planned(*args)
    n = len(traces)
    second = planned(*args)
    assert len(traces) == n, "a second call with the same signature must not trace again"
    assert tree_allclose(first, second, rtol=0)
    assert tree_allclose(first, eqx.filter_jit(step)(*args), rtol=1e-6)


def test_the_step_that_runs_is_lowered_once_with_its_candidate(monkeypatch):
    """The plan's step was lowered (and compiled) as a candidate: running it lowers nothing again."""
    lowered = []
    original = _step._lowered
    monkeypatch.setattr(_step, "_lowered", lambda *a: lowered.append(_step.compiled_key(*a)) or original(*a))
    smartremat.clear_caches()
    args = _setup()
    planned = smartremat.filter_jit(step, budget_mb=8)
    planned(*args)
    assert planned.plan(*args).compiles >= 1 and len(lowered) >= 2  # the plain step and a candidate
    assert len(set(lowered)) == len(lowered), "a step lowered twice in one planning"


def test_lower_compile_and_explain_read_the_step_that_runs():
    args = _setup()
    planned = smartremat.filter_jit(step, budget_mb=8)
    compiled = planned.lower(*args).compile()
    plan = smartremat.explain(planned, *args)
    assert compiled.memory_analysis().temp_size_in_bytes == plan.compiled_peak_bytes <= 8 * MB
    assert plan is planned.plan(*args)
    assert tree_allclose(compiled(*args), planned(*args), rtol=0)
    assert "ResidualBlock" in str(plan) and set(plan.policies) == {f"layers[{i}]" for i in range(3)}


def test_lower_compile_after_a_call_is_the_executable_that_runs(monkeypatch):
    """`.lower(...).compile()` after a call compiles nothing: it is the executable the calls run,
    and its `as_text()` is that program's optimised HLO."""
    args = _setup()
    planned = smartremat.filter_jit(step, budget_mb=8)
    expected = planned(*args)
    compiles = []
    original = jax.stages.Lowered.compile
    monkeypatch.setattr(jax.stages.Lowered, "compile", lambda self, *a, **k: compiles.append(1) or original(self, *a, **k))
    compiled = planned.lower(*args).compile()
    assert not compiles, "the step that runs was compiled again"
    assert "ENTRY" in compiled.as_text()
    assert compiled.memory_analysis().temp_size_in_bytes == planned.plan(*args).compiled_peak_bytes
    assert tree_allclose(compiled(*args), expected, rtol=0)


@smartremat.smartremat(budget_mb=1000)
class Decorated(TutorialStack):
    pass


def test_a_decorated_module_is_planned_by_the_step_not_by_its_own_budget():
    model, _, x, y = _setup(Decorated(3, 64, 1024, jax.random.key(0)))
    none = _temp(eqx.filter_jit(grads), _setup()[0], x, y)
    tight = smartremat.filter_jit(grads, budget_mb=none / MB * 0.7)
    plan = smartremat.explain(tight, model, x, y)
    assert any(p != "none" for p in plan.policies.values()), plan.policies  # its own 1000 MB would keep none
    assert _temp(tight, model, x, y) <= none * 0.7
    want = eqx.filter_jit(grads)(_setup()[0], x, y)
    assert tree_allclose(jax.tree.leaves(tight(model, x, y)), jax.tree.leaves(want), rtol=1e-6)


def test_two_modules_in_one_step_are_planned_together():
    enc, dec = TutorialStack(2, 64, 1024, jax.random.key(0)), TutorialStack(2, 64, 1024, jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (64, 64))

    def autoencoder(enc, dec, x):  # the decoder is called first: labels follow the arrays
        return eqx.filter_grad(lambda ed: jnp.mean((ed[0](ed[1](x)) - x) ** 2))((enc, dec))

    none = _temp(eqx.filter_jit(autoencoder), enc, dec, x)
    planned = smartremat.filter_jit(autoencoder, budget_mb=none / MB * 0.6)
    plan = smartremat.explain(planned, enc, dec, x)
    assert {p.split(".")[0] for p in plan.policies} == {"enc", "dec"}, plan.policies
    assert _temp(planned, enc, dec, x) <= none * 0.6
    assert tree_allclose(planned(enc, dec, x), eqx.filter_jit(autoencoder)(enc, dec, x), rtol=1e-6)


def test_inside_an_outer_jit_the_planned_step_is_inlined():
    args = _setup()
    planned = smartremat.filter_jit(step, budget_mb=8)
    got = jax.jit(lambda *a: planned(*a))(*args)
    assert tree_allclose(got, eqx.filter_jit(step)(*args), rtol=1e-6)


class _Trainer(eqx.Module):
    """A model trained through its own method, decorated as `eqx.filter_jit` allows."""

    net: TutorialStack

    @smartremat.filter_jit(budget_mb=0.9)  # plain temp 1.31 MB, floor 0.52 MB
    def grads(self, x, y):
        return eqx.filter_grad(lambda t: jnp.mean((t.net(x) - y) ** 2))(self)

    @eqx.filter_jit
    def plain_grads(self, x, y):
        return eqx.filter_grad(lambda t: jnp.mean((t.net(x) - y) ** 2))(self)


def test_a_method_binds_its_instance_as_eqx_filter_jit_does():
    model, _, x, y = _setup()
    trainer = _Trainer(model)
    assert _Trainer.__dict__["grads"].__get__(None, _Trainer) is _Trainer.__dict__["grads"]
    plan = trainer.grads.plan(x, y)
    assert plan == smartremat.explain(trainer.grads, x, y) and plan.compiled_peak_bytes <= 0.9 * MB
    assert any(b.policy != "none" for b in plan.blocks)
    assert tree_allclose(trainer.grads(x, y), trainer.plain_grads(x, y), rtol=1e-6)
    assert _temp(trainer.grads, x, y) == plan.compiled_peak_bytes
    compiled = trainer.grads.lower(x, y).compile()  # the bound instance goes with it, as in a call
    assert tree_allclose(compiled(x, y), trainer.plain_grads(x, y), rtol=1e-6)


def test_auto_budget_is_the_device_memory_less_arguments_outputs_and_reserve(monkeypatch):
    args = _setup()
    plain = smartremat.filter_jit(step, budget_mb=1e6).lower(*args).compile().memory_analysis()  # no remat
    limit = 64 * MB
    monkeypatch.setattr(_step_plan, "_device_limit", lambda sig: limit)
    plan = smartremat.explain(smartremat.filter_jit(step, budget_mb="auto"), *args)
    want = (int(limit * (1 - _step_plan.AUTO_RESERVE)) - plain.argument_size_in_bytes - plain.output_size_in_bytes
            + plain.alias_size_in_bytes - plain.generated_code_size_in_bytes)
    assert plan.budget_bytes == want
    assert plan.compiled_peak_bytes <= want


def test_auto_budget_without_a_device_limit_asks_for_a_number():
    if jax.devices()[0].memory_stats() is not None:
        pytest.skip("this backend reports a memory limit")
    with pytest.raises(ValueError, match=r"filter_jit\(budget_mb=\"auto\"\)` needs the device's memory limit.*"
                                         r"budget_mb=4096"):
        smartremat.filter_jit(step, budget_mb="auto")(*_setup())


def test_errors_name_the_argument_the_value_and_the_fix():
    with pytest.raises(TypeError, match=r"filter_jit\(fun=...\)` should be your training step.*not int"):
        smartremat.filter_jit(3, budget_mb=1)
    with pytest.raises(ValueError, match=r"filter_jit\(donate=...\)` should be one of.*not 'some'"):
        smartremat.filter_jit(step, budget_mb=1, donate="some")
    with pytest.raises(ValueError, match=r"filter_jit\(budget_mb=...\)` should be a positive"):
        smartremat.filter_jit(step, budget_mb=-1)
    model, _, x, y = _setup()
    with pytest.raises(ValueError, match=r"filter_jit\(budget_mb=0.001\)` is below the lowest.*at least"):
        smartremat.filter_jit(grads, budget_mb=1e-3)(model, x, y)
    with pytest.raises(ValueError, match=r"found no call of an Equinox module.*model \(TutorialStack\)"):
        smartremat.filter_jit(lambda model, x: x * 2, budget_mb=1)(_setup()[0], jnp.ones(3))
    planned = smartremat.filter_jit(step, budget_mb=8)
    with pytest.raises(ValueError, match=r"explain\(model=...\)` got a step made by `smartremat.filter_jit`"):
        smartremat.explain(planned, *_setup(), budget_mb=3)


def test_decorator_loss_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"smartremat\(loss=...\)` should be your loss.*not int"):
        smartremat.smartremat(budget_mb=1, loss=3)
    with pytest.raises(ValueError, match=r"smartremat\(loss_args=...\)` was given without `loss=`"):
        smartremat.smartremat(budget_mb=1, loss_args=(jnp.ones(3),))
    with pytest.raises(TypeError, match=r"smartremat\(loss_args=...\)` should be arrays"):
        smartremat.smartremat(budget_mb=1, loss=jnp.mean, loss_args=("targets",))


@eqx.filter_jit
def jitted_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def test_a_loss_under_its_own_filter_jit_gets_the_plan():
    """JAX caches the inner jit's trace: the plan of each candidate must still reach the module."""
    model, _, x, y = _setup()
    inner = lambda m, x, y: eqx.filter_grad(jitted_loss)(m, x, y)  # noqa: E731
    want = eqx.filter_jit(inner)(model, x, y)  # the inner trace is cached before planning
    none = _temp(eqx.filter_jit(inner), model, x, y)
    planned = smartremat.filter_jit(inner, budget_mb=none / MB * 0.6)
    assert any(p != "none" for p in smartremat.explain(planned, model, x, y).policies.values())
    assert _temp(planned, model, x, y) <= none * 0.6
    assert tree_allclose(planned(model, x, y), want, rtol=1e-6)


class Sub(TutorialStack):
    def __call__(self, x):
        return super().__call__(x) * 2.0


class Inherits(TutorialStack):
    pass


@pytest.mark.parametrize("cls", [Sub, Inherits])
def test_a_subclass_and_its_base_in_one_step(cls):
    base, other = _setup()[0], cls(3, 64, 1024, jax.random.key(1))
    x = jnp.ones((64, 64))

    def both(a, b, x):
        return eqx.filter_grad(lambda ab: jnp.mean(ab[0](x) ** 2) + jnp.mean(ab[1](x) ** 2))((a, b))

    planned = smartremat.filter_jit(both, budget_mb=100)
    assert {p.split(".")[0] for p in smartremat.explain(planned, base, other, x).policies} == {"a", "b"}
    assert tree_allclose(planned(base, other, x), eqx.filter_jit(both)(base, other, x), rtol=1e-6)
    assert TutorialStack.__call__ is TutorialStack.__dict__["__call__"] and "__call__" not in Inherits.__dict__


class TrainState(eqx.Module):
    model: TutorialStack
    step: jax.Array


def test_a_model_inside_a_train_state_and_keyword_arguments():
    model, _, x, y = _setup()

    def train(state, x, y):
        return grads(state.model, x, y)

    planned = smartremat.filter_jit(train, budget_mb=100, donate="all-except-first")
    plan = planned.plan(TrainState(model, jnp.zeros(())), x, y)
    assert set(plan.policies) == {f"layers[{i}]" for i in range(3)}
    state = TrainState(model, jnp.zeros(()))
    planned(state=state, x=jnp.array(x), y=jnp.array(y))  # by keyword: `state` is still the first argument
    assert not model.layers[0].block.w1.is_deleted()


def test_loss_args_as_a_dict_keep_their_structure():
    model, _, x, y = _setup()
    loss = lambda out, t: jnp.mean((out - t["y"]) ** 2)  # noqa: E731
    wrapped = smartremat.smartremat(budget_mb=100, loss=loss, loss_args={"y": y})(model)
    assert smartremat.explain(wrapped, x).compiled_peak_bytes is not None


def test_typed_prng_keys_among_the_step_arguments():
    """`jax.random.key` arrays (typed keys, e.g. one dropout key per example) are step arguments
    like any other: planned on, then the planned step runs and equals the plain one."""
    model, _, x, y = _setup()
    keys = jax.random.split(jax.random.key(2), x.shape[0])

    def noisy(model, x, y, keys):
        noise = jax.vmap(lambda k: jax.random.normal(k, x.shape[1:]))(keys)
        return grads(model, x + 0.01 * noise, y)

    planned = smartremat.filter_jit(noisy, budget_mb=100)
    assert set(planned.plan(model, x, y, keys).policies) == {f"layers[{i}]" for i in range(3)}
    assert tree_allclose(planned(model, x, y, keys), eqx.filter_jit(noisy)(model, x, y, keys), rtol=1e-6)


def test_quiet_donation_holds_while_any_thread_is_inside_it():
    # candidate plans compile in threads: one thread leaving the quiet block must not bring the
    # donation warning back (an error under pytest's filters) for another still lowering
    import threading
    import warnings

    from smartremat._step import quiet_donation

    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def a():
        with quiet_donation():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b():
        a_in.wait(5)
        with quiet_donation():
            b_in.set()
            a_out.wait(5)
            try:
                warnings.warn("Some donated buffers were not usable: float32[4]", UserWarning)
                seen.append("quiet")
            except UserWarning as e:
                seen.append(e)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == ["quiet"]
    with pytest.raises(UserWarning, match="donated buffers"):
        warnings.warn("Some donated buffers were not usable: float32[4]", UserWarning)


def _variants() -> list:
    """Calls of one step that differ in one thing each (or in nothing but the arrays' values)."""
    x = jnp.ones((4, 3))
    return [(x, 2), (jnp.zeros((4, 3)), 2), (x, 3), (x.astype(jnp.float16), 2), (jnp.ones((4, 4)), 2),
            (jnp.asarray(1.0), 2), (jnp.float32(1.0), 2), (np.ones((4, 3), np.float32), 2),
            (jax.device_put(x, jax.devices()[0]), 2), (jax.ShapeDtypeStruct((4, 3), jnp.float32), 2),
            ({"a": x}, 2), (jax.random.key(0), 2)]


def test_a_call_is_found_by_its_quick_key_only_where_its_signature_is_the_same():
    """`quick_split`'s key (read from the leaves without making avals, what each call of a planned
    step computes) is never equal where the signature differs, and equal for new arrays of the
    same shapes, so each training step finds its entry without the signature being made."""
    f = lambda a, n: a  # noqa: E731
    calls = _variants()
    quick = [_step.quick_split(f, c, {})[0] for c in calls]
    full = [_step.split_args(f, c, {})[0].key() for c in calls]
    for i in range(len(calls)):
        for j in range(len(calls)):
            if quick[i] == quick[j]:
                assert full[i] == full[j], (calls[i], calls[j])
    assert quick[0] == quick[1] and quick[0] != quick[2] and quick[0] != quick[3] and quick[5] != quick[6]
    inside = []
    jax.jit(lambda a: inside.append(_step.quick_split(f, (a, 2), {})[0]) or a)(jnp.ones(2))
    assert inside == [None], "under an outer jit the leaves are tracers: the full signature decides"
