PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
OLDEST := .venv-oldest
# The tests that reach JAX internals (_jax_private.py, _cost.py, tracing hooks), run again on the
# lowest versions pyproject.toml declares (requirements/oldest.txt).
OLDEST_TESTS := tests/test_api.py tests/test_profile.py tests/test_discover.py tests/test_robust.py tests/test_step_api.py tests/test_jax_config.py

.PHONY: demo test test-full test-oldest fuzz clean

# The dev environment: exact versions (requirements/dev.txt), the library's own bounds are lower bounds.
$(BIN)/activate: pyproject.toml requirements/dev.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile -c requirements/dev.txt -e '.[test,bench,docs,typecheck]'
	touch $(BIN)/activate

$(OLDEST)/bin/activate: pyproject.toml requirements/oldest.txt
	$(PY) -m venv $(OLDEST)
	$(OLDEST)/bin/pip install -q --upgrade pip
	$(OLDEST)/bin/pip install -q --no-compile -c requirements/oldest.txt -e '.[test]'
	touch $(OLDEST)/bin/activate

# The main job, about two minutes on 2 CPU cores: the tutorial block's gradient standard,
# checkpointed and through smartremat; the tutorial block stack planned, explained and trained under
# a budget (the module, then the whole training step); that stack against every fixed strategy, fit
# and step time (results/demo/ holds its JSON and plot). It ends with the command of the full
# benchmark: python benchmarks/run.py --quick (every model; about 13 minutes).
demo: $(BIN)/activate
	XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander $(BIN)/python examples/demo.py

# The whole test suite on the dev environment, two workers (tests/conftest.py sets the CPU barrier
# flag before JAX starts), the type check (pyright, pyproject.toml), a strict build of the docs
# (broken links or API pages fail it), and the tests that reach JAX internals on the oldest
# versions the package declares.
test: $(BIN)/activate test-oldest
	$(BIN)/python -m pytest -q -n 2 --durations=12 tests
	$(BIN)/pyright
	$(BIN)/mkdocs build --strict --quiet -d .site

# Every case of the suites that hold the same check on several heavy models (tests/helpers.py,
# `tier`): CI runs a subset of them that covers each model and idiom once.
test-full: $(BIN)/activate
	SMARTREMAT_FULL_TESTS=1 $(BIN)/python -m pytest -q -n 2 --durations=12 tests

test-oldest: $(OLDEST)/bin/activate
	$(OLDEST)/bin/python -m pytest -q -n 2 -p no:cacheprovider $(OLDEST_TESTS)

# The model fuzzer (tests/fuzz/): COUNT cases of Equinox idioms drawn from SEED (from the clock when
# empty), each held against the invariants (no undocumented error, the plain step's answer, compiled
# temp within budget, explain's figures reachable); each failure class is shrunk and written as a
# standalone reproducer into fuzz-failures/. CI runs a fixed subset (tests/test_fuzz.py). JOBS worker
# processes; START: the first case's index, to go on with a run cut short.
SEED ?=
COUNT ?= 2000
JOBS ?= 1
START ?= 0
fuzz: $(BIN)/activate
	XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander SMARTREMAT_DISK_CACHE=0 $(BIN)/python -m tests.fuzz.run $(if $(SEED),--seed $(SEED)) --count $(COUNT) --start $(START) --jobs $(JOBS)

clean:
	rm -rf $(VENV) $(OLDEST)
