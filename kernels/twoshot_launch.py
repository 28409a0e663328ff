"""The two-shot's launch variants over one workspace (`symm_fused_twoshot`): the staged pipeline
(`symm_staged`, the default: per-chunk launches, a chunk's arrival one flag per rank) and the
persistent ring kernel (`symm_ring`). The workspace (`symm_protocol.buffer_bytes("twoshot")`)
holds both slot regions, the ring's first (it needs them at the sentinel; the staged pipeline never
clears its own), and one chunk base and set of release counters, so calls of either variant may
follow each other in any order on every rank (all ranks take the same variant for a call).

Measured at world size 1 on one H200 (benchmarks/ring_local.py, same run, K=8, local work against
our standalone finalize + add+RMSNorm): staged 1.35-1.56x, staged with R / G on a high-priority
stream 1.31-1.59x, the ring 1.61-1.79x (benchmarks/results/README.md).
"""

from __future__ import annotations

from typing import Optional

from . import symm_ring, symm_staged
from .symm_protocol import STAGED_CHUNK, SymmLayer, staged_region

VARIANTS = ("ring", "staged_prio")  # beside the default (the staged pipeline, two streams)
_STAGED = {
    None: symm_staged.StagedShape(chunk=STAGED_CHUNK, stream_mode="two"),
    "staged_prio": symm_staged.StagedShape(chunk=STAGED_CHUNK, stream_mode="two_prio"),
}


def variant_shape(variant: str, tokens: int, hidden: int, num_sms: int, world: int, quant: int):
    """The launch of a named variant (the strategy's `run` passes it back to `launch`)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
    return variant


def launch(layer: SymmLayer, *, shape: Optional[str] = None, **tensors) -> None:
    """One call (`tensors` as `symm_ring.launch` takes them). shape: None (the staged pipeline)
    or a VARIANTS name."""
    if shape == "ring":
        symm_ring.launch(layer, **tensors)
        return
    region = staged_region(layer.world, layer.hidden, tensors["residual"].element_size())[0]
    symm_staged.launch(layer, shape=_STAGED[shape], region=region, **tensors)
