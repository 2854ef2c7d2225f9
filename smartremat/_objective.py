"""What a plan costs the step's time: the FLOPs it recomputes and, in a scan on an accelerator,
the bytes it keeps (docs/facts.md, fact 22). A leaf: it imports nothing from the package.

On a TPU v5e, keeping a byte for the backward inside a `jax.lax.scan` costs time: each iteration's
residuals are copied into the stacked buffers the backward reads (`python studies/pressure.py`,
the accelerator check's GPT-2-medium shape, scanned, batch 8). Per iteration, by smartremat's own
figures for the block, full remat recomputes 172.8 GFLOP and keeps 16.8 MB (bfloat16),
`dots_with_no_batch_dims_saveable` 35.4 GFLOP and 151 MB, `dots_saveable` 1.2 GFLOP and 436 MB
(float32 keeps twice the bytes). Measured per iteration: full remat 0.35 ms slower than
`dots_with_no_batch_dims_saveable` in bfloat16 and 0.65 ms faster in float32, `dots_saveable`
1.41 ms slower in bfloat16. The first two give 7.45 ms per GB kept against 102 TFLOP/s
recomputed, 760 FLOPs per byte (the third then predicts 1.79 ms); a charge between 512 and 1024
FLOPs per byte orders all three as timed. It is 3 ridge points here (the chip's peak FLOP/s over
its memory bandwidth, 240 FLOPs per byte). The same step with 3-7 GB of the chip taken by an extra
argument ran within 0.3%: the cost is the bytes, not the pressure. A scan split into pieces
copies its slices of the scanned operands (`Stage.split_extra`): those bytes are charged alike.

Outside a scan a kept byte is charged nothing. The unrolled model at batch 4 (float32) stepped in
185.5 ms without remat, 218.4 ms under `dots_with_no_batch_dims_saveable` and 225.2 ms under full
remat, though no remat keeps 268 MB more per block than the second (half its batch-8 figures) for
17.7 GFLOP less: any charge above 66 FLOPs per byte (MB here are 2**20 bytes) would have chosen the
slower plan. At batch 8 (`python benchmarks/accelerator_check.py --budgets auto,9500`, uncharged),
two mixed plans of dots_nb, no remat and `nested(attn=dots_nb)` (dots_nb on the attention, nothing
on the rest: 16.4 MB more kept per block than dots_nb for 0.51 GFLOP less) stepped in 417.0 ms
(3 nested, 3 none) and 420.9 ms (8 nested, 1 none) against 419.6 ms for dots_nb on every block:
solved per block, the nested block 0.31 ms slower than dots_nb, no remat 1.17 ms faster. A charge of
0.2 ridge points (48 FLOPs per byte), which orders both pairs as timed by the model's figures, was
tried on the TPU: `"auto"` then chose dots_nb on every block (the fixed policy's program, 411.6 ms
back to back against its 411.1), dropping the blocks without remat that made the uncharged plan
faster (why is not established: the search ranks by XLA's compiled FLOPs, not the model's, and
the call's log did not name its candidates; `docs/results/accelerator_check_tpu_tpu_v5_lite_unrolled_float32_batch8_charged.md`).
So the charge outside a scan stays zero.
An H200 stepped alike with and without remat of the dots (fact 5).

Other accelerators are charged the same multiple of their own ridge point (their peak dense
FLOP/s over their memory bandwidth, from the vendors' figures; one not listed is taken to be a
v5e). On the CPU kept bytes are not charged: no static cost ranked the step times of remat plans
there (fact 17), and the plans of the CPU benchmark stay those of fewest FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

#: Measured on a TPU v5e (module docstring): FLOPs a kept byte costs, as multiples of the ridge point,
#: outside a scan and in a scan's body.
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
