"""Launch configs of the one-shot exchange kernel (kernels/symm/oneshot.py; world size >= 2): the
per-T rule and the variants `tune` measures. Pure host functions, no kernel."""

from __future__ import annotations

from typing import NamedTuple, Optional

import triton

from fusion_bridge.kernels.quant import QUANT_NONE, row_block


class OneshotConfig(NamedTuple):
    """A launch config: BLOCK1 (finalize + publish chunk, compiled in), block2 (the columns a
    program stores in phase C, a multiple of 64), warps."""

    block1: int
    block2: int
    warps: int


def default_config(tokens: int, hidden: int, num_sms: int = 132) -> OneshotConfig:
    """BLOCK1 1024 while T * chunks stays within two waves of programs (T=1 spreads the K
    gathers of a row over 7 SMs at H=7168), else whole rows (more bytes in flight per program at
    large T); two values, so few compiles. block2: whole rows at T <= 2, else the row split over as
    many programs as one wave allows. Every program of a row reads the whole row's partials (local)
    for its sum of squares. The configs measured for it on 2x H200:
    docs/performance.md#tp2-our-one-shot-kernel-against-the-floor."""
    rb = row_block(hidden)
    block1 = 1024 if rb > 1024 and tokens * triton.cdiv(hidden, 1024) <= 2 * num_sms else rb
    per_row = max(1, num_sms // max(tokens, 1))
    block2 = rb if tokens <= 2 else min(rb, max(512, -(-triton.cdiv(hidden, per_row) // 64) * 64))
    return OneshotConfig(block1, block2, 8 if rb >= 4096 else 4)


# launch-config variants of the exchange kernel that `tune` measures per token bucket (its default
# stays `default_config` until the two-GPU run picks): "rows" = whole rows in both phases; "pub512"
# = 512-column publish chunks with whole-row stores (the best of the 2x H200 sweep at T=1);
# "pub1024" = 1024-column publish chunks with default_config's store split
CONFIG_VARIANTS = ("rows", "pub512", "pub1024")


def variant_config(
    variant: str, tokens: int, hidden: int, num_sms: int, world: int, quant: int = QUANT_NONE
) -> Optional[OneshotConfig]:
    """The launch config of a variant ("default": None, meaning default_config; or one of
    CONFIG_VARIANTS)."""
    if variant == "default":
        return None
    rb = row_block(hidden)
    base = default_config(tokens, hidden, num_sms)
    if variant == "rows":
        return OneshotConfig(rb, rb, base.warps)
    if variant == "pub512":
        return OneshotConfig(512, rb, base.warps)
    if variant == "pub1024":
        return OneshotConfig(1024, base.block2, base.warps)
    raise ValueError(
        f"symm_oneshot: unknown launch variant {variant!r} (default, {CONFIG_VARIANTS})"
    )
