"""When XLA reads `XLA_FLAGS`: the CPU barrier flag (docs/facts.md, fact 1) set before `import jax`,
then emptied, either before JAX's backend starts or after; an 8-layer remat MLP's compiled temp
bytes show which flags its compile ran under (about 1 MB with the flag, 4.5 MB without).

    python studies/xla_flags.py

Each case runs in its own process, since the flags are read once per process.
"""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = """
import os, sys
import jax, jax.numpy as jnp
if sys.argv[1] == "backend started":
    jax.devices()
os.environ["XLA_FLAGS"] = ""

def loss(ws, x):
    for w in ws:
        x = jax.checkpoint(lambda w, x: jnp.tanh(x @ w))(w, x)
    return jnp.mean(x ** 2)

ws = [jax.ShapeDtypeStruct((512, 512), jnp.float32)] * 8
x = jax.ShapeDtypeStruct((256, 512), jnp.float32)
temp = jax.jit(jax.grad(loss)).lower(ws, x).compile().memory_analysis().temp_size_in_bytes
print(f"{jax.__version__} {jax.default_backend()}: XLA_FLAGS emptied {'after the backend started' if sys.argv[1] == 'backend started' else sys.argv[1]}: temp {temp / 2**20:.3f} MB")
"""


def main() -> None:
    env = {**os.environ, "XLA_FLAGS": "--xla_disable_hlo_passes=cse_barrier_expander", "JAX_PLATFORMS": "cpu"}
    for case in ("before the backend started", "backend started"):
        out = subprocess.run([sys.executable, "-c", CHILD, case], env=env, capture_output=True, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
