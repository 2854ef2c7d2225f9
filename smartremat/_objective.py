"""What a plan costs the step's time: the FLOPs it recomputes and, on an accelerator, the bytes it
keeps (docs/facts.md, fact 22). A leaf: it imports nothing from the package.

On a TPU v5e keeping a byte for the backward costs time as well as memory, and inside a
`jax.lax.scan` several times more than outside one: each iteration's residuals are copied into
the stacked buffers the backward reads (`python studies/pressure.py`, GPT-2-medium shape, batch
8). Moving one scan iteration from `dots_with_no_batch_dims_saveable` to `dots_saveable` kept
272 MB more and recomputed 34 GFLOP less, and added 1.4 ms; full remat against
`dots_with_no_batch_dims_saveable` kept 128 MB (bfloat16) or 256 MB (float32) less per iteration
and recomputed about 206 GFLOP more, and was 0.35 ms slower per iteration in bfloat16 and 0.65 ms
faster in float32. Those three figures agree on 6.0-7.5 ms per GB kept against recomputing at
163 TFLOP/s: about 1,100 FLOPs per byte in a scan, 4.6 times the chip's ridge point (its peak
FLOP/s over its memory bandwidth, 240). Outside a scan (the same model unrolled, float32), no
remat on 3 blocks instead of `dots_with_no_batch_dims_saveable` kept 1.54 GB more for 106 GFLOP
less and took 2.0 ms more: about 280 FLOPs per byte, 1.15 times the ridge. No pressure effect was
seen: the same program with 3-7 GB of the chip taken by an extra argument ran within 0.3%.

Other accelerators are charged the same multiples of their own ridge point (their peak dense
FLOP/s over their memory bandwidth, from the vendors' figures; one not listed is taken to be a
v5e). On the CPU kept bytes are not charged: no static cost ranked the step times of remat plans
there (fact 17), and the plans of the CPU benchmark stay those of fewest FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

#: Measured on a TPU v5e (module docstring): FLOPs a kept byte costs, as multiples of the ridge point.
UNROLLED_RIDGES = 0.0
SCANNED_RIDGES = 3.0

#: `(peak dense bfloat16 FLOP/s, memory bytes/s)` of accelerators, by a part of their `device_kind`.
ROOFLINES = {
    "TPU v5 lite": (197e12, 819e9), "TPU v5e": (197e12, 819e9), "TPU v5p": (459e12, 2765e9),
    "TPU v5": (459e12, 2765e9), "TPU v4": (275e12, 1228e9), "TPU v6 lite": (918e12, 1640e9),
    "TPU v6e": (918e12, 1640e9), "H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12),
    "A100": (312e12, 2.0e12), "MI300X": (1307e12, 5.3e12),
}
#: The ridge point of an accelerator not in `ROOFLINES`: a TPU v5e's.
DEFAULT_RIDGE = 197e12 / 819e9


@dataclass(frozen=True)
class KeptCharge:
    """FLOPs charged per byte a block keeps for the backward: outside a scan, and in a scan's body."""

    unrolled: float = 0.0
    scanned: float = 0.0


def kept_charge(device_kind: str) -> KeptCharge:
    """The charge per kept byte on a device of `device_kind` (as `jax.Device.device_kind` spells
    it: `"cpu"` for the CPU, whose charge is zero)."""
    if device_kind.lower() == "cpu":
        return KeptCharge()
    found = [k for k in ROOFLINES if k.lower() in device_kind.lower()]
    flops, bandwidth = ROOFLINES[max(found, key=len)] if found else (DEFAULT_RIDGE, 1.0)
    ridge = flops / bandwidth
    return KeptCharge(UNROLLED_RIDGES * ridge, SCANNED_RIDGES * ridge)


def device_charge() -> KeptCharge:
    """`kept_charge` of this process's first device of the default backend."""
    return kept_charge(jax.local_devices()[0].device_kind)
