"""JAX's configuration context managers (`with jax.enable_x64(True):`, `jax.default_matmul_precision`)
hold in the thread that entered them only. smartremat lowers and compiles in worker threads, which run
under the caller's settings (`_jax_private.carrying_config`): the step that runs is the step the user
would have lowered."""

import contextlib
from concurrent.futures import ThreadPoolExecutor

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import smartremat
from smartremat import MB, _jax_private
from smartremat import smartremat as sr

from benchmarks.models import TutorialStack
from tests.helpers import tree_allclose


def grads(model, x, y):
    return eqx.filter_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)


def _setup(dtype=jnp.float32):
    model = TutorialStack(3, 64, 512, jax.random.key(0))
    model = jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, model)
    x = jax.random.normal(jax.random.key(1), (64, 64), dtype)
    return model, x, jnp.tanh(x)


def _temp(lowered) -> int:
    return getattr(lowered, "lowered", lowered).compile().memory_analysis().temp_size_in_bytes


def test_a_step_under_enable_x64_is_planned_and_run_in_float64():
    """Its candidates were once lowered in float32 by worker threads, and the call then failed on its
    float64 arguments."""
    smartremat.clear_caches()
    with jax.enable_x64(True):
        args = _setup(jnp.float64)
        want = eqx.filter_jit(grads)(*args)
        budget = 0.6 * _temp(eqx.filter_jit(grads).lower(*args)) / MB
        planned = smartremat.filter_jit(grads, budget_mb=budget)
        got = planned(*args)
        plan = planned.plan(*args)
    assert {x.dtype for x in jax.tree.leaves(got)} == {jnp.dtype("float64")}
    assert tree_allclose(got, want)
    assert plan.compiled_peak_bytes <= budget * MB and set(plan.policies.values()) != {"none"}


def test_the_step_lowers_under_the_callers_matmul_precision():
    """Planned under `"highest"`, the step that runs (a candidate lowered in a worker thread) carries it."""
    smartremat.clear_caches()
    args = _setup()
    planned = smartremat.filter_jit(grads, budget_mb=0.6 * _temp(eqx.filter_jit(grads).lower(*args)) / MB)
    with jax.default_matmul_precision("highest"):
        want = eqx.filter_jit(grads).lower(*args).as_text().count("HIGHEST")
        highest = planned.lower(*args).as_text().count("HIGHEST")
    assert want > 0 and highest == want


def test_a_decorated_module_is_profiled_in_its_callers_dtype():
    """Profiles and candidates compiled in worker threads see `enable_x64`: float64 activations take
    twice float32's bytes."""
    smartremat.clear_caches()
    model, x, _ = _setup()
    f32 = smartremat.explain(sr(budget_mb=1000)(model), x)
    with jax.enable_x64(True):
        model, x, _ = _setup(jnp.float64)
        f64 = smartremat.explain(sr(budget_mb=1000)(model), x)
    assert f64.predicted_peak_bytes > 1.5 * f32.predicted_peak_bytes > 0  # the model's, from the profiles
    assert f64.compiled_peak_bytes > 1.5 * f32.compiled_peak_bytes > 0


@pytest.mark.parametrize("private", [True, False], ids=["private", "public-fallback"])
def test_worker_threads_carry_the_callers_settings(monkeypatch, private):
    if not private:
        monkeypatch.setattr(_jax_private, "_STATES", None)

    def read():
        return jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision, jax.sharding.get_abstract_mesh()

    outside = read()
    settings = [jax.enable_x64(True), jax.default_matmul_precision("highest")]
    if private:  # a mesh is a context, not an option: the public fallback knows none
        settings.append(jax.set_mesh(jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])))
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(1) as pool:
        for setting in settings:
            stack.enter_context(setting)
        inside = read()
        carried = pool.submit(_jax_private.carrying_config(read)).result()
        bare = pool.submit(read).result()
    assert carried == inside != outside and bare == outside
