import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import smartremat
from smartremat import _policies
from smartremat import smartremat as sr

from benchmarks.models import TutorialBlock, TutorialStack
from tests.helpers import backward


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, "10", None, True])
def test_bad_budget(bad):
    with pytest.raises(ValueError, match=r"budget_mb=\.\.\.\)` should be a positive, finite number .*not " + __import__("re").escape(repr(bad))):
        sr(budget_mb=bad)


def test_not_a_module_class():
    with pytest.raises(TypeError, match=r"decorates `eqx.Module` subclasses or instances, not the class 'Foo'"):
        @sr(budget_mb=1)
        class Foo:
            pass


def test_not_a_module_instance():
    with pytest.raises(TypeError, match=r"should be applied to an `eqx.Module` subclass or a callable module instance, not function"):
        sr(budget_mb=1)(lambda x: x)


def test_blocks_not_callable_argument():
    with pytest.raises(TypeError, match=r"`smartremat\(blocks=\.\.\.\)` should be a function .* not 3"):
        sr(budget_mb=1, blocks=3)


def test_blocks_naming_nothing_callable():
    model = TutorialStack(2, 16, 32, jax.random.key(0))
    wrapped = sr(budget_mb=1, blocks=lambda m: m.layers[0].block.w1)(model)
    with pytest.raises(ValueError, match=r"`smartremat\(blocks=\.\.\.\)` returned an array \(float32\[16, 32\]\), which is not a callable `eqx.Module`"):
        backward(wrapped, jnp.ones((2, 16)))


def test_blocks_returning_nothing():
    model = TutorialStack(2, 16, 32, jax.random.key(0))
    with pytest.raises(ValueError, match=r"returned no sub-modules"):
        backward(sr(budget_mb=1, blocks=lambda m: [])(model), jnp.ones((2, 16)))


def test_blocks_naming_an_uncalled_sub_module_warns():
    from tests.test_discover import Branchy

    wrapped = sr(budget_mb=1, verify=False, calibrate=False, blocks=lambda m: [m.last, m.unused])(Branchy(jax.random.key(0)))
    with pytest.warns(UserWarning, match=r"`smartremat\(blocks=\.\.\.\)` named unused, which the module's forward never calls"):
        plan = smartremat.explain(wrapped, jnp.ones(8))
    assert [b.path for b in plan.blocks] == ["last"]


def test_bad_policies():
    with pytest.raises(TypeError, match=r"`smartremat\(policies=\.\.\.\)` holds 'dots', which is not a `jax.checkpoint` policy"):
        sr(budget_mb=1, policies=["dots"])
    with pytest.raises(TypeError, match=r"should be a sequence of `jax.checkpoint` policies"):
        sr(budget_mb=1, policies=jax.checkpoint_policies.dots_saveable)


@pytest.mark.parametrize("made", [True, False], ids=["called", "itself"])
def test_a_policy_that_ignores_its_names_is_refused(made):
    cp = jax.checkpoint_policies
    policy = cp.save_anything_except_these_names("attn") if made else cp.save_anything_except_these_names
    if not _policies._ignores_names() and made:  # a JAX that honours the names: offered as it is
        sr(budget_mb=1, policies=[policy])
        return
    with pytest.raises(ValueError, match=r"holds `save_anything_except_these_names`, which in jax \S+ "
                       r"ignores the names .* use `jax.checkpoint_policies.save_any_names_but_these"):
        sr(budget_mb=1, policies=[policy])


@pytest.mark.parametrize("verify", [True, False])
def test_infeasible_budget_states_minimum(verify):
    model = TutorialStack(3, 64, 512, jax.random.key(0))
    x = jnp.ones((32, 64))
    with pytest.raises(ValueError, match=r"`smartremat\(budget_mb=0\.001\)` is below the lowest peak .*: \d+\.\d+ MB .*Raise `budget_mb` to at least") as e:
        backward(sr(budget_mb=0.001, verify=verify)(model), x)
    floor = float(__import__("re").search(r"at least (\d+\.\d+)", str(e.value)).group(1))
    plan = smartremat.explain(sr(budget_mb=floor, verify=verify)(model), x)  # the minimum is reachable
    assert plan.predicted_peak_bytes <= plan.budget_bytes or plan.compiled_peak_bytes <= plan.budget_bytes
    with pytest.raises(ValueError, match="below the lowest peak"):
        smartremat.explain(sr(budget_mb=floor - 0.02, verify=verify)(model), x)


def test_explain_plain_module_needs_budget():
    with pytest.raises(ValueError, match=r"pass `budget_mb=\.\.\.`"):
        smartremat.explain(TutorialBlock(8, 8, jax.random.key(0)), jnp.ones((2, 8)))
    with pytest.raises(TypeError, match=r"`explain\(model=\.\.\.\)` should be an `eqx.Module`, not function"):
        smartremat.explain(lambda x: x, jnp.ones(2), budget_mb=1)


def test_budget_accepts_0d_arrays_and_refuses_bools_and_vectors():
    model = TutorialBlock(8, 16, jax.random.key(0))
    for good in (np.array(2.0), jnp.float32(2.0), jnp.array(2, jnp.int32)):
        assert sr(budget_mb=good)(model).config.budget_bytes == 2 * smartremat.MB
        assert smartremat.filter_jit(lambda m, x: m(x), budget_mb=good).config.budget_mb == 2.0
    for bad in (np.bool_(True), jnp.array(True), np.array([2.0]), jnp.float32(jnp.inf), jnp.float32(-1.0)):
        with pytest.raises(ValueError, match=r"`smartremat\(budget_mb=\.\.\.\)` should be a positive, finite number .*not "
                           + re.escape(repr(bad))):
            sr(budget_mb=bad)
        with pytest.raises(ValueError, match=r"`smartremat.filter_jit\(budget_mb=\.\.\.\)` should be a positive"):
            smartremat.filter_jit(lambda m, x: m(x), budget_mb=bad)


def test_scan_segments_accepts_numpy_integers():
    config = sr(budget_mb=1, scan_segments=np.int64(3))(TutorialBlock(8, 16, jax.random.key(0))).config
    assert config.scan_segments == 3 and type(config.scan_segments) is int
    assert smartremat.filter_jit(lambda m, x: m(x), budget_mb=1, scan_segments=np.int32(2)).config.scan_segments == 2
    for bad in (np.bool_(True), True, 2.0, np.int64(0)):
        with pytest.raises(ValueError, match=r"`smartremat\(scan_segments=\.\.\.\)` should be a positive int .*not "
                           + re.escape(repr(bad))):
            sr(budget_mb=1, scan_segments=bad)


def test_empty_policy_menu_is_blamed_not_the_budget():
    model = TutorialStack(2, 16, 64, jax.random.key(0))
    x = jnp.ones((8, 16))
    with pytest.raises(ValueError, match=r"`smartremat\(policies=\.\.\.\)` offers no checkpoint policy: .*`policies=\[\]`"
                       r".*no remat, whose peak, \d+\.\d+ MB, is above `budget_mb=0\.001`.*"
                       r"`policies=\[jax\.checkpoint_policies\.nothing_saveable\]`") as e:
        backward(sr(budget_mb=0.001, policies=[], verify=False, calibrate=False)(model), x)
    assert "below the lowest peak" not in str(e.value)
    plan = smartremat.explain(sr(budget_mb=100, policies=[], verify=False, calibrate=False)(model), x)
    assert set(plan.policies.values()) == {"none"}  # an empty menu under a generous budget is fine


def test_policy_that_raises_is_named_with_what_to_do():
    model = TutorialStack(2, 16, 64, jax.random.key(0))
    x = jnp.ones((8, 16))

    def broken(prim, *avals, **params):
        return 1 / 0

    with pytest.raises(ValueError, match=r"`smartremat\(policies=\.\.\.\)` holds the policy 'broken' \(<function .*broken.*\), "
                       r"which raised ZeroDivisionError: division by zero when JAX called it as `policy\(\w+, .*"
                       r"Fix the policy, or remove it from `policies=`") as e:
        backward(sr(budget_mb=1, policies=[broken], verify=False, calibrate=False)(model), x)
    assert isinstance(e.value.__cause__, ZeroDivisionError)
    with pytest.raises(ValueError, match=r"holds the policy '<lambda>' .*which raised TypeError"):
        backward(sr(budget_mb=1, policies=[lambda prim: True], verify=False, calibrate=False)(model), x)


def test_wrapping_a_planned_module_again_is_refused():
    model = TutorialStack(2, 16, 64, jax.random.key(0))
    wrapped = sr(budget_mb=1)(model)
    with pytest.raises(TypeError, match=r"applied to a `SmartRemat`, a module already wrapped by "
                       r"`smartremat\(budget_mb=1\)` \(around a TutorialStack\).*`smartremat\(budget_mb=\.\.\.\)\(wrapped\.module\)`"):
        sr(budget_mb=2)(wrapped)

    @sr(budget_mb=1)
    class Planned(TutorialStack):
        pass

    with pytest.raises(TypeError, match=r"applied to an instance of 'Planned', whose class is already decorated with "
                       r"`@smartremat\(budget_mb=1\)`.*would plan twice"):
        sr(budget_mb=2)(Planned(2, 16, 64, jax.random.key(0)))


_NO_FLAG = """
import jax, jax.numpy as jnp
from smartremat import smartremat as sr
from benchmarks.models import TutorialStack
from tests.helpers import backward
try:
    backward(sr(budget_mb=0.001, verify=False, calibrate=False)(TutorialStack(2, 16, 64, jax.random.key(0))), jnp.ones((8, 16)))
except ValueError as e:
    print(e)
"""


def test_infeasible_budget_without_the_cpu_flag_names_the_flag():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _NO_FLAG], env=env, capture_output=True, text=True, timeout=120)
    assert re.search(r"below the lowest peak .*XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander.* is not set in this process",
                     out.stdout, re.S), out.stdout + out.stderr


def test_a_step_whose_peak_no_plan_lowers_says_so():
    """The loss makes the step's peak (a product far larger than the model's activations, and a
    matmul XLA does not fuse away): every plan compiles to the plain temp, and the refusal says
    that no plan saves anything and why."""
    import equinox as eqx

    model = eqx.nn.Linear(8, 8, key=jax.random.key(0))
    wide = jnp.linspace(-1, 1, 8 * 4096).reshape(8, 4096)

    def step(model, x):
        def loss(m):
            return jnp.mean(jnp.tanh(jax.vmap(m)(x) @ wide))  # (64, 4096) floats
        return eqx.filter_grad(loss)(model)

    x = jnp.linspace(-1, 1, 64 * 8).reshape(64, 8)
    with pytest.raises(ValueError, match=r"no remat plan takes this step below its temp without remat "
                                         r"\(\d+\.\d+ MB\): its peak is set outside the module calls"):
        smartremat.filter_jit(step, budget_mb=1e-3)(model, x)


def _outer_loss_step(policy=None):
    import equinox as eqx

    def step(model, x):
        def loss(m):
            def call(m, xi):
                return m(xi)
            call = call if policy is None else jax.checkpoint(call, policy=policy)
            y = jax.vmap(call, in_axes=(None, 0))(m, x)
            return jnp.mean(jnp.tanh(y[:, :, None, None] * x[None, None, :, :]))  # (64, 8, 64, 8) floats
        return eqx.filter_grad(loss)(model)
    return step


def test_an_infeasible_budget_states_the_compilers_lowest_plan_the_model_rules_out():
    """The model charges every plan of this step the loss's outer product, but under remat XLA
    fuses it into the backward reduction: the stated floor is the lowest temp a plan compiles to
    (here each uniform plan, compiled by hand), not the plain step's."""
    import equinox as eqx

    model = eqx.nn.Linear(8, 8, key=jax.random.key(0))
    x = jnp.linspace(-1, 1, 64 * 8).reshape(64, 8)

    def temp(policy):
        compiled = eqx.filter_jit(_outer_loss_step(policy)).lower(model, x).compile()
        return getattr(compiled, "compiled", compiled).memory_analysis().temp_size_in_bytes

    policies = [jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                jax.checkpoint_policies.nothing_saveable]
    lowest = min([temp(None)] + [temp(p) for p in policies])
    assert lowest < temp(None)  # XLA fuses the product away under remat (else this tests nothing)
    with pytest.raises(ValueError, match=r"lowest temp memory of the remat plans smartremat compiled .*compiled temp bytes .*not compiled are ones") as e:
        smartremat.filter_jit(_outer_loss_step(), budget_mb=1e-3)(model, x)
    stated = float(re.search(r"on these arguments: (\d+\.\d+) MB", str(e.value)).group(1))
    assert stated == pytest.approx(lowest / 2**20, abs=1e-3), (stated, lowest)
