"""Launch shapes of the one-shot kernel's family (pure host functions, no kernel): the exchange
kernel's per-T rule and the variants `tune` measures (world size >= 2), and the world-size-1 rule
(whole rows, or rows split over several programs while T is small).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import triton

from .quant import QUANT_NONE, row_block

MAX_CHUNKS = 32  # chunks per row of the split kernel (one counter and word set per count)
SYNC_ROWS = 256  # rows the split kernel serves (T * chunks <= the SM count)
SYNC_WORDS = SYNC_ROWS * (MAX_CHUNKS + 1 + MAX_CHUNKS * (MAX_CHUNKS + 1) // 2)
MAX_POLLS = 1 << 22  # ~1 s of polls: a partner that never arrives shows as NaN, not a hang


class OneshotShape(NamedTuple):
    """A launch shape: BLOCK1 (finalize + publish chunk, compiled in), block2 (the columns a
    program stores in phase C, a multiple of 64), warps. World size 1: block1 is the columns a
    program owns (a whole row block: one program per row; less: the split kernel), block2 unused."""

    block1: int
    block2: int
    warps: int
    prefetch: int = 0  # world size 1: prefetch the row into L2 before its gathers (GPU only)
    # world size 1: launch with programmatic dependent launch (sm_90+ only; kernels/pdl.py)
    pdl: int = 0


# world size 1: the shapes' default for `pdl` (honoured on sm_90+ only). Measured on one H200, K=8,
# graph, same run (benchmarks/tp1_local.py --pdl-ab, results/tp1_local_h200_pdl.csv, us off / on):
# calls back to back H=7168 none T=1 2.71 / 2.24, T=16 4.12 / 3.48, T=256 12.69 / 12.28, T=4096
# 165.9 / 165.2; H=4096 T=256 8.19 / 7.50; after a torch kernel (no early trigger) within -4.5% ..
# +1.7% (T=16 5.54 / 5.55): never slower beyond noise, faster where the kernel before is PDL-aware
LOCAL_PDL = 1


def local_warps(tokens: int, hidden: int, quant: int = QUANT_NONE) -> int:
    """Warps per whole-row program at world size 1: 16 per 8192 columns at every T (half as many
    for rows of half the width). Measured on one H200, H=7168, K=8, graph, rotated inputs
    (benchmarks/tp1_sweep.py, tp1_sweep_h200_lean.txt, us, 16 / 32 warps, none / fp8 / nvfp4): T=64
    5.70 / 7.09, 6.53 / 6.32, 7.83 / 7.91; T=256 12.57 / 13.07, 13.86 / 15.79, 17.66 / 18.16;
    T=1024 45.45 / 47.94, 49.67 / 56.62; T=4096 165.98 / 174.58, 177.56 / 202.93. (Before the
    leaner kernel, 32 warps won below T=64: its gathers then waited on each other at 16.)"""
    return max(4, 16 * row_block(hidden) // 8192)


def local_shape(
    tokens: int, hidden: int, quant: int = QUANT_NONE, num_sms: int = 0
) -> OneshotShape:
    """World size 1. Split rows while T * chunks programs are resident (num_sms; 0: never; see
    `split_ok`): T = 1 in 512-column chunks (4 warps) with the row prefetched into L2, else the
    smallest of 1024 / 2048 / 4096 columns that fits (8 columns per thread); whole rows otherwise
    (`local_warps`). Measured on one H200, H=7168, K=8, graph (benchmarks/tp1_sweep.py,
    tp1_sweep_h200_lean.txt, us): none T=1 512 prefetched 2.40, not 2.50, 256 (2 warps) 2.58; T=16
    1024 3.89 (prefetched 4.00), 512 (2 warps) 3.87, 2048 3.92; T=32 1024 4.32, 2048 4.41; T=64
    two chunks of 4096 5.76 / 6.20 / 7.33 (none / fp8 / nvfp4), whole rows 5.70 / 6.53 / 7.83.
    The prefetch costs from T=16 on (T=256: 15.75 against 12.57)."""
    rb = row_block(hidden)
    for chunk in (512,) if tokens == 1 else (1024, 2048, 4096):
        warps = max(1, chunk // 256) if tokens > 1 else chunk // 128
        shape = OneshotShape(chunk, chunk, warps, int(tokens == 1), LOCAL_PDL)
        if split_ok(shape, tokens, hidden, num_sms):
            return shape
    return OneshotShape(rb, rb, local_warps(tokens, hidden, quant), 0, LOCAL_PDL)


def programs_per_sm(warps: int) -> int:
    """Split-kernel programs that are always resident on one SM at once: two of at most 4 warps
    (128 threads x at most 255 registers is half an SM's register file), else one."""
    return 2 if warps <= 4 else 1


def split_ok(shape: OneshotShape, tokens: int, hidden: int, num_sms: int) -> bool:
    """The split kernel serves this call: chunks < whole rows, T * chunks programs resident."""
    rb = row_block(hidden)
    chunks = triton.cdiv(hidden, shape.block1)
    return (
        shape.block1 < rb
        and 1 < chunks <= MAX_CHUNKS
        and tokens <= SYNC_ROWS
        and tokens * chunks <= num_sms * programs_per_sm(shape.warps)
    )


def default_shape(
    tokens: int, hidden: int, num_sms: int = 132, world: int = 2, quant: int = QUANT_NONE
) -> OneshotShape:
    """World size 1: whole rows (the partial stays in registers), one program per row; only the
    warps vary (`local_warps`).

    Otherwise: BLOCK1 1024 while T * chunks stays within two waves of programs (T=1 spreads the K
    gathers of a row over 7 SMs at H=7168), else whole rows (more bytes in flight per program at
    large T); two values, so few compiles. block2: whole rows at T <= 2, else the row split over as
    many programs as one wave allows. Every program of a row reads the whole row's partials (local)
    for its sum of squares. Measured on 2x H200, H=7168 (us, graph): T=1 (512, 512) 6.35, (1024,
    512) 6.12, (512, row) 5.72; T=16 (512, 896) 8.70, (1024, 896) 7.82, (512, row) 8.97."""
    rb = row_block(hidden)
    if world == 1:
        return local_shape(tokens, hidden, quant)
    block1 = 1024 if rb > 1024 and tokens * triton.cdiv(hidden, 1024) <= 2 * num_sms else rb
    per_row = max(1, num_sms // max(tokens, 1))
    block2 = rb if tokens <= 2 else min(rb, max(512, -(-triton.cdiv(hidden, per_row) // 64) * 64))
    return OneshotShape(block1, block2, 8 if rb >= 4096 else 4)


# launch-shape variants of the exchange kernel that `tune` measures per token bucket (its default
# stays `default_shape` until the two-GPU run picks): "rows" = whole rows in both phases; "pub512"
# = 512-column publish chunks with whole-row stores (the best of the 2x H200 sweep at T=1);
# "pub1024" = 1024-column publish chunks with default_shape's store split
SHAPE_VARIANTS = ("rows", "pub512", "pub1024")


def variant_shape(
    variant: str, tokens: int, hidden: int, num_sms: int, world: int, quant: int = QUANT_NONE
) -> Optional[OneshotShape]:
    """The launch shape of a variant ("default" or one of SHAPE_VARIANTS; None = default_shape)."""
    if variant == "default":
        return None
    rb = row_block(hidden)
    base = default_shape(tokens, hidden, num_sms, world, quant)
    if variant == "rows":
        return OneshotShape(rb, rb, base.warps)
    if variant == "pub512":
        return OneshotShape(512, rb, base.warps)
    if variant == "pub1024":
        return OneshotShape(1024, base.block2, base.warps)
    raise ValueError(
        f"symm_oneshot: unknown launch variant {variant!r} (default, {SHAPE_VARIANTS})"
    )
