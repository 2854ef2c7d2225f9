"""A generative fuzzer of Equinox models and training steps for smartremat (issue 28).

`grammar` describes a case as plain data (`Case`) and builds its model and step; `check` holds
a case against the invariants; `run` is `make fuzz`. `tests/test_fuzz.py` runs a fixed subset in CI.
"""
