PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test clean

$(BIN)/activate: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench,docs]'
	touch $(BIN)/activate

# The main job: plan, explain and train two models on the CPU under a budget, then the quick
# benchmark (smartremat against every fixed strategy; results/ holds its JSON, tables and plots).
demo: $(BIN)/activate
	XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander $(BIN)/python examples/demo.py
	$(BIN)/python benchmarks/run.py --quick --out results

# The whole test suite (tests/conftest.py sets the CPU barrier flag before JAX starts), then a
# strict build of the docs (broken links or API pages fail it).
test: $(BIN)/activate
	$(BIN)/python -m pytest -q tests
	$(BIN)/mkdocs build --strict --quiet -d .site

clean:
	rm -rf $(VENV)
