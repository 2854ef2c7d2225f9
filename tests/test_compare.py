"""The rule that compares a planned step's outputs with the plain step's (`tests.helpers.tree_mismatches`,
issue 28, item 5): exact where the answer is exact, a real difference always reported, a rounding one never."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import tree_mismatches


def _ulps(x: np.ndarray, n: np.ndarray) -> np.ndarray:
    """`x` moved by `n` (an int array) float32 ulps, entry by entry."""
    out = x.copy()
    for _ in range(int(np.max(np.abs(n), initial=0))):
        step = np.abs(n) > 0
        out = np.where(step, np.nextafter(out, np.where(n > 0, np.inf, -np.inf)).astype(np.float32), out)
        n = n - np.sign(n)
    return out


def test_equal_trees_and_rounding_in_a_leaf_are_equal():
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    tree = {"w": jnp.asarray(w), "count": jnp.int32(3), "name": "adam"}
    assert tree_mismatches(tree, tree) == []
    moved = dict(tree, w=jnp.asarray(_ulps(w, np.full(w.shape, 3))))
    assert tree_mismatches(moved, tree) == []


def test_a_real_difference_is_reported_with_where_and_how_much():
    w = jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(3, 4)
    found = tree_mismatches({"w": w.at[1, 2].add(1e-4)}, {"w": w})
    assert len(found) == 1
    assert found[0].startswith("['w']: 1 of 12 entries differ") and "worst at (1, 2)" in found[0]


@pytest.mark.parametrize("actual, expected, match", [
    ({"a": jnp.zeros(2)}, {"b": jnp.zeros(2)}, "tree structure differs"),
    (jnp.zeros(2), jnp.zeros(3), r"float32\[2\] != float32\[3\]"),
    (jnp.zeros(2, jnp.bfloat16), jnp.zeros(2), r"bfloat16\[2\] != float32\[2\]"),
    (jnp.int32(3), jnp.int32(4), "differ \\(exact dtype int32\\)"),
    ((jnp.zeros(2), "x"), (jnp.zeros(2), "y"), "'x' != 'y'"),
    (jnp.array([1.0, np.nan]), jnp.array([1.0, 2.0]), "1 of 2 entries differ"),
])
def test_exact_parts_are_exact(actual, expected, match):
    found = tree_mismatches(actual, expected)
    assert len(found) == 1
    with pytest.raises(AssertionError, match=match):
        assert not found, found[0]


def test_half_precision_leaves_get_their_own_ulps():
    x = jnp.linspace(0.5, 1.0, 8, dtype=jnp.float32)
    for dtype in (jnp.bfloat16, jnp.float16):
        a = x.astype(dtype)
        one_ulp = jnp.nextafter(a, jnp.asarray(2, dtype))
        assert tree_mismatches(one_ulp, a) == []
        assert tree_mismatches(a * 1.25, a) != []


def _grads(noise: float) -> dict:
    """A gradient whose `b` is mathematically zero: entries are rounding noise of size `noise`."""
    return {"w": jnp.array([[0.5, -2.0], [1.0, 0.25]]), "b": jnp.array([noise, -noise])}


def test_entries_zero_up_to_rounding_are_equal_only_with_the_gradient_given():
    a, e = _grads(3e-8), _grads(-1e-8)  # b: a relative difference of order one within its leaf
    assert [m.split(":")[0] for m in tree_mismatches(a, e)] == ["['b']"]
    assert tree_mismatches(a, e, grads=(a, e)) == []


def test_a_real_difference_in_a_zero_leaf_is_reported():
    a, e = _grads(1e-3), _grads(-1e-8)  # 1e-3 of the gradient's scale is not rounding
    found = tree_mismatches(a, e, grads=(a, e))
    assert len(found) == 1 and found[0].startswith("['b']")


@pytest.fixture
def adam_step(standard_promotion):
    """One Adam step from the same parameters on a given gradient: (loss, params, opt_state)."""
    opt = optax.adam(1e-3)
    params = {"w": jnp.ones((2, 2)), "b": jnp.zeros(2)}

    def step(grads: dict) -> tuple:
        updates, state = opt.update(grads, opt.init(params), params)
        return jnp.float32(1.5), eqx.apply_updates(params, updates), state

    return step


def test_adam_updates_of_a_rounding_zero_gradient_are_exempt(adam_step):
    """Noise of opposite signs on a zero gradient entry moves Adam's parameters by +-lr: equal
    under the rule given the first moments, reported without them."""
    a, e = adam_step(_grads(3e-8)), adam_step(_grads(-1e-8))
    assert float(jnp.max(jnp.abs(a[1]["b"] - e[1]["b"]))) > 1e-3  # visible: 2 x lr
    assert tree_mismatches(a, e, grads=(a[2][0].mu, e[2][0].mu)) == []
    assert any(m.startswith("[1]['b']") for m in tree_mismatches(a, e))


def test_adam_after_a_real_gradient_difference_is_reported(adam_step):
    a, e = adam_step(_grads(1e-3)), adam_step(_grads(-1e-8))
    found = tree_mismatches(a, e, grads=(a[2][0].mu, e[2][0].mu))
    # nu squares it: 1e-3 of the gradient's scale is 1e-6 of nu's, rounding there; mu and the step show it
    assert {m.split(":")[0] for m in found} == {"[1]['b']", "[2][0].mu['b']"}


@settings(derandomize=True, max_examples=60, deadline=None, database=None)
@given(st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=20), st.integers(0, 2**31 - 1))
def test_rounding_is_never_reported_and_a_real_difference_always(values, seed):
    x = np.array(values, np.float32)
    rng = np.random.default_rng(seed)
    moved = _ulps(x, rng.integers(-4, 5, x.shape))  # within 4 ulps of each entry's own magnitude
    assert tree_mismatches(jnp.asarray(moved), jnp.asarray(x)) == []
    scale = float(np.max(np.abs(x)))
    if scale > 0:
        i = int(rng.integers(x.size))
        bumped = x.copy()
        bumped[i] += np.float32(1e-4 * scale)
        assert tree_mismatches(jnp.asarray(bumped), jnp.asarray(x)) != []


def test_float32_values_computed_in_bfloat16_get_bfloat16_ulps():
    x = jnp.linspace(0.5, 1.0, 8, dtype=jnp.float32)
    rounded = jnp.nextafter(x.astype(jnp.bfloat16), jnp.bfloat16(2)).astype(jnp.float32)  # 1 bf16 ulp
    assert tree_mismatches(rounded, x.astype(jnp.bfloat16).astype(jnp.float32)) != []
    assert tree_mismatches(rounded, x.astype(jnp.bfloat16).astype(jnp.float32), compute_dtype=jnp.bfloat16) == []


def test_rule_6_is_not_consulted_for_a_difference_that_is_not_of_float_values():
    """A structure, dtype, integer or NaN difference fails whatever the float64 answer says."""
    from tests.fuzz.check import Failed, _compare
    from tests.fuzz.grammar import Case

    w = jnp.linspace(-1, 1, 8, dtype=jnp.float32)
    case = Case(step="value_and_grad")
    for actual, expected in [((jnp.float32(0), {"w": w}, jnp.int32(2)), (jnp.float32(0), {"w": w}, jnp.int32(3))),
                             ((jnp.float32(0), {"w": w.astype(jnp.bfloat16)}), (jnp.float32(0), {"w": w})),
                             ((jnp.float32(0), {"w": w.at[0].set(jnp.nan)}), (jnp.float32(0), {"w": w}))]:
        with pytest.raises(Failed, match="rule 6 does not apply"):
            _compare(case, actual, expected, lambda: (expected, expected))  # float64 answers that agree
