"""Set the CPU barrier flag before JAX is imported (design.md fact 1)."""

import os
import sys

flag = "--xla_disable_hlo_passes=cse_barrier_expander"
if flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # benchmarks/
assert "jax" not in sys.modules or flag in os.environ["XLA_FLAGS"]
