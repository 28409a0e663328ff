"""The two-shot's launch variants over one workspace (`symm_fused_twoshot`): the two-shot pipeline
(`symm_twoshot`) in its default shape (the row launches on a high-priority stream, each chunk's
finalize gated right after the row launches that free its slot), and "f_after_x": the row
launches on the caller's stream and F(c + 1) gated by X(c), after F(c) (`tune` measures it; at
world size 1 on one H200 it is slower from T=4096: docs/performance.md, "The current default").
Every variant uses the workspace's slots (`symm_protocol.TWOSHOT_SLOTS` x `TWOSHOT_CHUNK`), so
calls of either may follow each other in any order on every rank (all ranks take the same variant
for a call).
"""

from __future__ import annotations

from typing import Optional

from fusion_bridge.kernels.symm import twoshot as symm_twoshot
from fusion_bridge.kernels.symm.protocol import SymmLayer

VARIANTS = ("f_after_x",)  # beside the default shape
_TWOSHOT = {
    None: symm_twoshot.DEFAULT_SHAPE,
    "f_after_x": symm_twoshot.TwoshotShape(stream_mode="two", f_ahead=False),
}


def variant_shape(variant: str, tokens: int, hidden: int, num_sms: int, world: int, quant: int):
    """The launch of a named variant (the strategy's `run` passes it back to `launch`)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
    return variant


def launch(layer: SymmLayer, *, shape: Optional[str] = None, **tensors) -> None:
    """One call (`tensors` as `symm_twoshot.launch` takes them). shape: None (the default shape) or
    a VARIANTS name."""
    symm_twoshot.launch(layer, shape=_TWOSHOT[shape], **tensors)
