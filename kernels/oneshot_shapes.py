"""Launch shapes of the one-shot kernel's family (pure host functions, no kernel): the exchange
kernel's per-T rule and the variants `tune` measures (world size >= 2), and the world-size-1 rule
(whole rows, or rows split over several programs while T is small).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import triton

from .quant import QUANT_NONE, QUANT_NVFP4, row_block

MAX_CHUNKS = 32  # chunks per row of the split kernel (one counter and word set per count)
SYNC_ROWS = 256  # rows the split kernel serves (T * chunks <= the SM count)
SYNC_WORDS = SYNC_ROWS * (MAX_CHUNKS + 1 + MAX_CHUNKS * (MAX_CHUNKS + 1) // 2)
MAX_POLLS = 1 << 22  # ~1 s of polls: a partner that never arrives shows as NaN, not a hang
PREFETCH_MAX_TOKENS = 1024  # world size 1: rows prefetched into L2 up to this T (guess, to measure)


class OneshotShape(NamedTuple):
    """A launch shape: BLOCK1 (finalize + publish chunk, compiled in), block2 (the columns a
    program stores in phase C, a multiple of 64), warps. World size 1: block1 is the columns a
    program owns (a whole row block: one program per row; less: the split kernel), block2 unused."""

    block1: int
    block2: int
    warps: int
    prefetch: int = 0  # world size 1: prefetch the row into L2 before its gathers (GPU only)
    persist: int = 0  # world size 1, whole rows: programs per SM walking the rows (0: one per row)


def local_warps(tokens: int, hidden: int, quant: int = QUANT_NONE) -> int:
    """Warps per row program at world size 1. Measured on one H200, H=7168, K=8, graph, rotated
    inputs (benchmarks/tp1_local.py --sweep, us, 8 / 16 / 32 warps): none T=16 6.39 / 6.01 / 5.84,
    T=64 7.15 / 6.74 / 6.52, T=1024 49.9 / 48.7 / 55.7, T=4096 173.9 / 170.0 / 198.2; fp8 T=64
    10.8 / 9.75 / 7.87, T=4096 220 / 201 / 234; nvfp4 T=16 9.50 / 8.54 / 8.05, T=4096 311 / 205 /
    259. Few rows: the most threads in flight per row; many rows: 16 warps (quant or not). Half as
    many for rows of half the width."""
    per_row = 32 if tokens <= 64 else 16
    return max(4, per_row * row_block(hidden) // 8192)


def local_shape(
    tokens: int, hidden: int, quant: int = QUANT_NONE, num_sms: int = 0
) -> OneshotShape:
    """World size 1. Split rows while T * chunks fits the SMs (num_sms; 0: never): T = 1 in
    512-column chunks (4 warps), else the smallest of 1024 / 2048 / 4096 columns that fits (8
    columns per thread), but two chunks only for NVFP4; whole rows otherwise (`local_warps`).
    Measured on one H200, H=7168, K=8, graph (benchmarks/tp1_sweep.py, us, none / fp8 / nvfp4):
    T=1 whole rows 5.03 / 6.42 / 7.10, split 512 3.37 / 3.57 / 3.74, 1024 3.44 / 3.79 / 3.72,
    4096 4.56 / 5.64 / 5.71; T=16 whole 5.94 / 7.26 / 8.24, 1024 4.77 / 5.29 / 5.20, 2048 4.92 /
    6.02 / 5.57; T=32 (none) whole 6.11, 2048 5.34; T=64 whole 6.70 / 7.97 / 9.15, two chunks of
    4096 6.80 / 8.08 / 8.17 (again, none: whole 6.67, split 7.05). The ticket-first kernel, none:
    T=1 512 3.10, 256 (1 or 2 warps) 3.04; T=16 1024 4.61."""
    rb = row_block(hidden)
    prefetch = int(tokens <= PREFETCH_MAX_TOKENS)
    for chunk in (512,) if tokens == 1 else (1024, 2048, 4096):
        warps = max(1, chunk // 256) if tokens > 1 else chunk // 128
        shape = OneshotShape(chunk, chunk, warps, prefetch)
        two = triton.cdiv(hidden, chunk) == 2
        if split_ok(shape, tokens, hidden, num_sms) and (quant == QUANT_NVFP4 or not two):
            return shape
    return OneshotShape(rb, rb, local_warps(tokens, hidden, quant), prefetch)


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
