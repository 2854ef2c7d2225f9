import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import smartremat
from smartremat import smartremat as sr

from benchmarks.models import TutorialBlock, TutorialStack
from tests.helpers import tree_allclose
from tests.models import Transformer


class Branchy(eqx.Module):
    """Calls its sub-modules out of field order, one of them twice, and holds a dict."""

    seq: eqx.nn.Sequential
    named: dict
    last: eqx.nn.Linear
    unused: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 5)
        self.seq = eqx.nn.Sequential([eqx.nn.Linear(8, 8, key=k[0]), eqx.nn.Lambda(jax.nn.relu),
                                      eqx.nn.Linear(8, 8, key=k[1])])
        self.named = {"a": eqx.nn.Linear(8, 8, key=k[2])}
        self.last = eqx.nn.Linear(8, 8, key=k[3])
        self.unused = eqx.nn.Linear(8, 8, key=k[4])

    def __call__(self, x):
        x = self.named["a"](x)
        x = self.seq(x)
        return self.last(self.named["a"](x))


def test_blocks_found_in_call_order_through_containers():
    plan = smartremat.explain(Branchy(jax.random.key(0)), jnp.ones(8), budget_mb=1)
    # the parameter-free `seq.layers[1]` (a Lambda) is part of its neighbours' cost, not a block
    assert [b.path for b in plan.blocks] == ["named['a']", "seq.layers[0]", "seq.layers[2]", "last"]
    assert [b.calls for b in plan.blocks] == [2, 1, 1, 1]
    assert [b.type for b in plan.blocks] == ["Linear"] * 4


def test_blocks_argument_names_them():
    m = Branchy(jax.random.key(0))
    wrapped = sr(budget_mb=1, blocks=lambda m: [m.last, m.seq])(m)
    plan = smartremat.explain(wrapped, jnp.ones(8))
    assert [b.path for b in plan.blocks] == ["seq", "last"]  # as named, in call order
    wrapped = sr(budget_mb=1, blocks=lambda m: m.seq)(m)  # a Sequential alone: its layers
    assert [b.path for b in smartremat.explain(wrapped, jnp.ones(8)).blocks] == [
        "seq.layers[0]", "seq.layers[1]", "seq.layers[2]"]


def test_array_only_module_is_its_own_block():
    plan = smartremat.explain(TutorialBlock(16, 64, jax.random.key(0)), jnp.ones((4, 16)), budget_mb=1)
    (block,) = plan.blocks
    assert block.path == "<self>" and len(block.options) >= 2


class Scanned(eqx.Module):
    """The Equinox idiom for deep models: stacked layers run under `jax.lax.scan`."""

    layers: eqx.nn.Linear

    def __call__(self, x):
        params, static = eqx.partition(self.layers, eqx.is_array)

        def body(x, p):
            return eqx.combine(p, static)(x), None

        return jax.lax.scan(body, x, params)[0]


def test_block_under_scan_is_counted_per_iteration_not_once():
    layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(jax.random.split(jax.random.key(0), 6))
    plan = smartremat.explain(Scanned(layers), jnp.ones(8), budget_mb=1)
    assert [(b.type, b.calls) for b in plan.blocks] == [("Linear", 6)] and len(plan.stages) == 6


class ReadsWeights(eqx.Module):
    """Calls one sub-module and reads another's arrays directly (as GPT-style MLPs often do)."""

    inner: eqx.nn.Linear
    fc: eqx.nn.Linear

    def __call__(self, x):
        return self.inner(x) @ self.fc.weight.T + self.fc.bias


class Outer(eqx.Module):
    blocks: list

    def __call__(self, x):
        for b in self.blocks:
            x = jax.vmap(b)(x)
        return x


def test_attribute_reads_on_sub_modules_reach_them_through_probes_and_wrappers():
    keys = jax.random.split(jax.random.key(0), 6)
    model = Outer([ReadsWeights(eqx.nn.Linear(16, 16, key=a), eqx.nn.Linear(16, 16, key=b))
                   for a, b in zip(keys[:3], keys[3:])])
    plan = smartremat.explain(model, jnp.ones((8, 16)), budget_mb=1)
    assert [b.type for b in plan.blocks] == ["ReadsWeights"] * 3
    # each block's figures are measured through the probes: the same for the three equal blocks, and
    # without remat the block keeps at least `inner(x)` (8 x 16 float32), which `fc.weight`'s gradient needs
    assert len({tuple(b.options) for b in plan.blocks}) == 1
    none = {o.name: o for o in plan.blocks[0].options}["none"]
    assert none.saved_bytes >= 8 * 16 * 4


class ResBlock(eqx.Module):
    """The Equinox docs' U-Net idiom: the forward asks each sub-module what it is."""

    layers: list
    scale: float = 0.5

    def __init__(self, key):
        k = jax.random.split(key, 2)
        self.layers = [eqx.nn.MLP(8, 8, 64, 2, key=k[0]), eqx.nn.Dropout(0.1), eqx.nn.MLP(8, 8, 64, 2, key=k[1])]

    def __call__(self, x, *, key):
        h = x
        for layer in self.layers:
            assert type(layer).__module__.startswith("equinox"), type(layer)
            h = layer(h, key=key) if isinstance(layer, eqx.nn.Dropout) else layer(h)
            h = jnp.tanh(h) * self.layers[0].width_size / 64  # reads a sub-module's field
        return x + h


@pytest.mark.parametrize("lowest", [True, False])
def test_user_code_sees_its_own_sub_modules(lowest):
    """Discovery, profiling and the planned run never replace a sub-module by another object."""
    m = ResBlock(jax.random.key(0))
    x, key = jnp.linspace(-1, 1, 8), jax.random.key(1)
    plan = smartremat.explain(sr(budget_mb=1.0, verify=False, calibrate=False)(m), x, key=key)
    budget_mb = plan.min_peak_bytes / 2**20 if lowest else 1.0
    wrapped = sr(budget_mb=budget_mb, verify=False, calibrate=False)(m)
    if lowest:
        assert any(b.policy != "none" for b in smartremat.explain(wrapped, x, key=key).blocks)
    assert jnp.allclose(jax.jit(lambda x: wrapped(x, key=key))(x), m(x, key=key), rtol=1e-6)

    def loss(w, x):
        return jnp.mean((w(x, key=key) - 0.3) ** 2)

    grad = eqx.filter_jit(eqx.filter_grad(loss))(wrapped, x)
    assert tree_allclose(grad.module, eqx.filter_grad(loss)(m, x))


class WithDropout(eqx.Module):
    """A stack, then a dropout that passes its input through at inference (a layer without arrays)."""

    stack: TutorialStack
    dropout: eqx.nn.Dropout

    def __call__(self, x):
        return self.dropout(self.stack(x))


@pytest.mark.parametrize("make,ends", [
    (lambda k: TutorialStack(3, 8, 16, k), "layers[2]"),  # returns the last layer's output
    (lambda k: Transformer(2, 16, 2, k), None),  # a layer norm after the last layer
    (lambda k: TutorialBlock(8, 16, k), "<self>"),  # the module is its own block
    (lambda k: WithDropout(TutorialStack(3, 8, 16, k), eqx.nn.Dropout(0.1, inference=True)), "stack.layers[2]"),
], ids=["stack", "head", "lone", "pass_through_last"])
def test_discovery_marks_the_call_whose_outputs_the_module_returns(make, ends):
    from smartremat._discover import discover, expand_stacks, path_str
    from smartremat._spec import make_spec

    model = make(jax.random.key(0))
    x = jnp.ones((4, 8, 16)) if isinstance(model, Transformer) else jnp.ones((4, 8))
    spec = make_spec(model, (x,), {})
    calls = expand_stacks(discover(model, lambda m, *a: m(*a), spec, None))
    assert [path_str(c.path) for c in calls if c.ends] == ([] if ends is None else [ends])


def test_a_module_whose_sub_modules_are_read_not_called_keeps_jaxs_caches(monkeypatch):
    """Weight tying (`self.embed.weight` read, the embedding never called): no call of a sub-module
    is seen, and with no inner `jit` in the forward there is no cached trace to blame, so JAX's
    caches (every function the user compiled) are left alone."""

    class Tied(eqx.Module):
        embed: eqx.nn.Embedding

        def __call__(self, t):
            return self.embed.weight[t] @ self.embed.weight.T

    cleared = []
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(1))
    model, t = Tied(eqx.nn.Embedding(50, 16, key=jax.random.key(0))), jnp.arange(8) % 50
    step = eqx.filter_value_and_grad(lambda m, t: jnp.mean(jax.vmap(m)(t) ** 2))
    assert smartremat.filter_jit(step, budget_mb=100)(model, t)[0] == eqx.filter_jit(step)(model, t)[0]
    assert cleared == []
