"""Set the CPU barrier flag before JAX is imported (docs/facts.md, fact 1), and strict dtype promotion.

The disk plan cache is off for the suite (every test plans, and nothing is written to the user's
cache folder); tests/test_disk_cache.py turns it on in a temporary folder."""

import os
import sys

flag = "--xla_disable_hlo_passes=cse_barrier_expander"
if flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
assert "jax" not in sys.modules or flag in os.environ["XLA_FLAGS"]
os.environ["SMARTREMAT_DISK_CACHE"] = "0"


import jax  # noqa: E402
import pytest  # noqa: E402

# as Equinox's own tests do: mixing dtypes must be explicit, in the library and in the tests
jax.config.update("jax_numpy_dtype_promotion", "strict")

# XLA reads XLA_FLAGS once, when JAX starts its backend (docs/facts.md, fact 13): start it now, so
# that a test that empties XLA_FLAGS (to see the warning for a CPU without the flag) is never the
# first to use it in a worker, which left every later test of that worker without the flag
jax.devices()


@pytest.fixture(scope="session")
def fit_log():
    """Rows `(test, model, budget MB, compiled temp MB of the user's step, plan)` that fit tests
    append; with SMARTREMAT_FIT_LOG=path set, written there as a markdown table at the end, so
    the figures reported are exactly those the tests asserted on."""
    rows: list[tuple] = []
    yield rows
    path = os.environ.get("SMARTREMAT_FIT_LOG")
    if not path or not rows:
        return
    import jax

    lines = [f"Compiled temp bytes of the user's own step beside the budget (jax {jax.__version__}, "
             f"{jax.devices()[0].device_kind}, XLA_FLAGS=`{os.environ.get('XLA_FLAGS', '')}`), written by "
             "`SMARTREMAT_FIT_LOG=<path> python -m pytest tests/test_fit.py tests/test_step.py "
             "tests/test_losses.py`.", "",
             "| test | model | budget MB | compiled MB | fits | plan |", "|---|---|---|---|---|---|"]
    for test, model, budget, temp, plan in rows:
        lines.append(f"| {test} | {model} | {budget:.3f} | {temp:.3f} | {'yes' if temp <= budget else 'NO'} | {plan} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")



@pytest.fixture
def standard_promotion():
    """Standard dtype promotion for a test whose third-party code needs it under strict promotion:
    Equinox's `BatchNorm(mode="batch")` in inference (`momentum ** counter`, a Python float to an
    int32 power, Equinox 0.13.8) and optax's Adam bias correction (`decay ** count`, optax 0.2.8).
    Set globally, not by JAX's thread-local context manager, as smartremat profiles in worker
    threads."""
    import jax

    before = jax.config.jax_numpy_dtype_promotion
    jax.config.update("jax_numpy_dtype_promotion", "standard")
    yield
    jax.config.update("jax_numpy_dtype_promotion", before)
