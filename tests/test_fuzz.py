"""The model fuzzer's CI subset (issue 28): a fixed set of generated Equinox models and training
steps (`tests/fuzz/grammar.py`), each held against smartremat's invariants (`tests/fuzz/check.py`).

`make fuzz` runs many more (`tests/fuzz/run.py`); this file runs `CI_CASES` cases drawn from
`CI_SEED`, chosen so that together they draw every value of every field of the grammar.
"""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings

from tests.fuzz.check import check_case
from tests.fuzz.grammar import CHOICES, Case, build, case_at, cases, covering, normalise

CI_SEED = 28
CI_CASES = 8  # the fewest that draw every value of every field (CI time: 24 cases took 8 minutes of the suite)
CI_INDEXES = covering(CI_SEED, CI_CASES)

def test_ci_subset_draws_every_idiom():
    drawn = {(k, getattr(case_at(CI_SEED, i), k)) for i in CI_INDEXES for k in CHOICES}
    assert {(k, v) for k, values in CHOICES.items() for v in values} - drawn == set()


@settings(derandomize=True, max_examples=30, deadline=None, database=None)
@given(cases())
def test_a_case_is_plain_data_and_builds_the_same_values_each_time(case):
    assert normalise(case) == case
    assert Case(**dataclasses.asdict(case)) == case
    assert eval(str(case), {"Case": Case}) == case  # printed, it reads back
    a, b = build(case), build(case)
    assert a.names == b.names and len(a.args) == len(a.names)
    leaves = lambda built: [x for x in jax.tree.leaves(built.args) if isinstance(x, jax.Array)]  # noqa: E731
    for x, y in zip(leaves(a), leaves(b), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("index", CI_INDEXES)
def test_generated_model_keeps_the_invariants(index):
    case = case_at(CI_SEED, index)
    outcome = check_case(case)
    assert outcome.ok, f"{case}\n{outcome.report()}"
