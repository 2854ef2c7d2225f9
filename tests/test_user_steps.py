"""Steps written the way Equinox users write them (issue 28, items 1-2): the tutorial's
`filter_jit(eqx.filter_value_and_grad(loss))`, other gradient wrappers, bound methods, partials,
callable Modules as the step, and models trained through a method other than `__call__`."""

import functools
import os
import re
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import smartremat
from tests.helpers import tree_allclose


class Block(eqx.Module):
    l1: eqx.nn.Linear
    l2: eqx.nn.Linear

    def __init__(self, key):
        a, b = jax.random.split(key)
        self.l1, self.l2 = eqx.nn.Linear(32, 256, key=a), eqx.nn.Linear(256, 32, key=b)

    def __call__(self, x):
        return x + self.l2(jax.nn.gelu(self.l1(x)))


class Net(eqx.Module):
    layers: list

    def __call__(self, x):
        for layer in self.layers:
            x = jax.vmap(layer)(x)
        return x


class Flow(eqx.Module):
    """A model trained through a method, as flow-matching and diffusion code is written."""

    net: Net

    def loss(self, x, t):
        return jnp.mean((self.net(x * t) - x) ** 2)


def _net():
    return Net([Block(k) for k in jax.random.split(jax.random.key(0), 4)])


def loss(model, x):
    return jnp.mean((model(x) - jnp.tanh(x)) ** 2)


X = jnp.linspace(-1.0, 1.0, 256 * 32, dtype=jnp.float32).reshape(256, 32)
T = jnp.float32(0.5)


def _floor_mb(step, args):
    """The lowest temp memory the error for a too-low budget states."""
    with pytest.raises(ValueError, match="at least") as info:
        smartremat.filter_jit(step, budget_mb=1e-4)(*args)
    return float(re.search(r"at least ([0-9.]+)", str(info.value)).group(1))


def _check(step, args):
    """Planned at half the plain step's temp (above the floor of every step here: 11-26% of it):
    fits, and gives the plain step's answer."""
    plain = eqx.filter_jit(step).lower(*args).compile().compiled.memory_analysis().temp_size_in_bytes
    budget = plain / 2 / smartremat.MB
    planned = smartremat.filter_jit(step, budget_mb=budget)
    temp = planned.lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert temp <= budget * smartremat.MB < plain
    assert tree_allclose(planned(*args), eqx.filter_jit(step)(*args))
    return planned


@pytest.mark.parametrize("make, with_x", [
    (lambda: eqx.filter_value_and_grad(loss), True),
    (lambda: eqx.filter_grad(loss), True),
    (lambda: jax.value_and_grad(functools.partial(loss, x=X)), False),
], ids=["filter_value_and_grad", "filter_grad", "jax_value_and_grad_partial"])
def test_tutorial_step_forms(make, with_x):
    _check(make(), (_net(), X) if with_x else (_net(),))


def test_partial_and_bound_method_steps():
    net = _net()

    class Trainer(eqx.Module):
        scale: float = 1.0

        def step(self, model, x):
            return eqx.filter_value_and_grad(loss)(model, x * self.scale)

    _check(Trainer().step, (net, X))
    _check(functools.partial(eqx.filter_value_and_grad(loss), net), (X,))


def test_callable_module_step_holding_arrays_and_a_dict():
    """A step that is a Module with array and dict fields: its arrays are traced, as with
    `eqx.filter_jit`, and its dict does not need to hash."""

    class Step(eqx.Module):
        shift: jax.Array
        options: dict

        def __call__(self, model, x):
            return eqx.filter_value_and_grad(loss)(model, x + self.shift * self.options["gain"])

    step = Step(jnp.float32(0.1), {"gain": 2.0})
    _check(step, (_net(), X))
    planned = smartremat.filter_jit(step, budget_mb=100)
    other = Step(jnp.float32(0.3), {"gain": 2.0})  # the step's arrays are inputs, not constants
    assert tree_allclose(planned(_net(), X)[0], eqx.filter_jit(step)(_net(), X)[0])
    assert tree_allclose(planned.__wrapped__(_net(), X)[0], eqx.filter_jit(step)(_net(), X)[0])
    assert not tree_allclose(eqx.filter_jit(other)(_net(), X)[0], eqx.filter_jit(step)(_net(), X)[0])


def test_model_trained_through_a_method_is_planned():
    flow = Flow(_net())

    def step(model, x, t):
        return eqx.filter_value_and_grad(lambda m: m.loss(x, t))(model)

    planned = _check(step, (flow, X, T))
    rows = smartremat.explain(planned, flow, X, T)
    assert "layers[0" in str(rows)
    _check(eqx.filter_value_and_grad(Flow.loss), (flow, X, T))


class Stacked(eqx.Module):
    """Layers stacked with `eqx.filter_vmap` and run by `jax.lax.scan`."""

    layers: Block

    def __init__(self, key):
        self.layers = eqx.filter_vmap(Block)(jax.random.split(key, 6))

    def __call__(self, x):
        params, static = eqx.partition(self.layers, eqx.is_array)
        return jax.lax.scan(lambda h, p: (jax.vmap(eqx.combine(p, static))(h), None), x, params)[0]


class Classifier(eqx.Module):
    """A thin wrapper holding the network: its scanned layers are the blocks to plan."""

    backbone: Stacked
    head: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(self.head)(self.backbone(x))


def test_wrapper_around_a_scanned_stack_plans_its_layers():
    model = Classifier(Stacked(jax.random.key(0)), eqx.nn.Linear(32, 8, key=jax.random.key(1)))
    y = jnp.zeros((X.shape[0], 8), jnp.float32)

    def wrapped(m, x, y):
        return eqx.filter_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(m)

    def direct(net, x, y):  # the same network passed to the step itself
        return eqx.filter_value_and_grad(lambda n: jnp.mean((jax.vmap(model.head)(n(x)) - y) ** 2))(net)

    floor = _floor_mb(wrapped, (model, X, y))
    assert floor <= _floor_mb(direct, (model.backbone, X, y)) + 0.01  # was the no-remat temp: 9.82 against 1.04 MB
    _check(wrapped, (model, X, y))


def test_errors_name_a_partial_step_by_its_function_and_explain_labels_predicted_figures():
    """Issue 28 item 7: a `functools.partial` step is named by its function (not a repr with a
    memory address); explain's lowest peak is labelled as the model's, not as reachable."""
    step = functools.partial(eqx.filter_value_and_grad(loss), x=X)
    with pytest.raises(ValueError, match=r"for the step `loss` on these arguments") as info:
        smartremat.filter_jit(step, budget_mb=1e-4)(_net())
    assert " at 0x" not in str(info.value)
    text = str(smartremat.explain(smartremat.filter_jit(step, budget_mb=100), _net()))
    assert "reachable" not in text and "(the model's; the compiler decides fit)" in text


ON_SECOND_DEVICE = """
import os
os.environ["XLA_FLAGS"] = "--xla_disable_hlo_passes=cse_barrier_expander --xla_force_host_platform_device_count=2"
os.environ["SMARTREMAT_DISK_CACHE"] = "0"
import equinox as eqx, jax, jax.numpy as jnp, smartremat
net, x = eqx.nn.MLP(16, 16, 64, 2, key=jax.random.key(0)), jnp.ones((32, 16))
step = eqx.filter_value_and_grad(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2))
want = eqx.filter_jit(step)(net, x)
for device in jax.devices():
    arrays, rest = eqx.partition(net, eqx.is_array)
    placed = eqx.combine(jax.device_put(arrays, device), rest)
    got = smartremat.filter_jit(step, budget_mb=100)(placed, jax.device_put(x, device))
    assert jax.tree.leaves(got)[0].devices() == {device}, (device, jax.tree.leaves(got)[0].devices())
    assert float(got[0]) == float(want[0])
print("ok")
"""


def test_a_model_committed_to_another_device_runs_there():
    """As with `eqx.filter_jit`: arrays committed to a device other than the default one run the
    step there (this raised "Computation was compiled for input shardings that disagree")."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", ON_SECOND_DEVICE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
