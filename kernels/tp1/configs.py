"""`fused_tp1`'s launch configs (pure host functions, no kernel): whole rows, or rows split over
several programs while T is small, and the split kernel's limits (its exchange words, its wait)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import triton

from fusion_bridge.kernels.quant import QUANT_NONE, QUANT_NVFP4, row_block
from fusion_bridge.kernels.quant_codes import QUANT_FP8_GROUP
from fusion_bridge.kernels.tp1.launch_table import TABLE

# the split kernel's limits (read by the kernel as attributes of this module, compile-time)
MAX_CHUNKS = 32  # chunks per row of the split kernel (one counter and word set per count)
SYNC_ROWS = 256  # rows the split kernel serves (T * chunks <= the SM count)
SYNC_WORDS = SYNC_ROWS * (MAX_CHUNKS + 1 + MAX_CHUNKS * (MAX_CHUNKS + 1) // 2)
# per token only: the tagged chunk amaxes of the normalized rows, laid out as the sums, after them
AMAX_WORDS = SYNC_ROWS * MAX_CHUNKS * (MAX_CHUNKS + 1) // 2
MAX_POLLS = 1 << 22  # ~1 s of polls: a partner that never arrives shows as NaN, not a hang
# the split kernel's PHASES bits: a GPU launch runs both; the interpreter, whose programs run one
# after another, launches the publish phase, then the wait and the outputs (per token: publish,
# then AMAX_PHASE, which publishes the chunk amaxes alone, then the outputs)
PUBLISH_PHASE, OUTPUT_PHASE, AMAX_PHASE = 1, 2, 4
BOTH_PHASES = PUBLISH_PHASE | OUTPUT_PHASE


class SplitSync(NamedTuple):
    """The split kernel's exchange (one record argument): words, int64 [SYNC_WORDS] (the counters,
    then the tagged sums; per token AMAX_WORDS more: the tagged chunk amaxes); error_address,
    int64 [1] holding the address of the int32 error word."""

    words: Any
    error_address: Any


class Tp1Config(NamedTuple):
    """A world-size-1 launch config: the columns a program owns (a whole row block: one program per
    row, the whole-row kernel; fewer: the split-row kernel), its warps, whether the row is
    prefetched into L2 before its gathers (GPU only), and whether it launches with programmatic
    dependent launch (sm_90+ only; kernels/pdl.py)."""

    columns: int
    warps: int
    prefetch: int = 0
    pdl: int = 0


# world size 1: the configs' default for `pdl` (honoured on sm_90+ only). Measured on one H200:
# never slower beyond noise, faster where the kernel before is PDL-aware
# (docs/performance.md#programmatic-dependent-launch-pdl)
TP1_PDL = 1


def whole_row_warps(tokens: int, hidden: int, quant: int = QUANT_NONE) -> int:
    """Warps per whole-row program at world size 1: 16 per 8192 columns at every T (half as many
    for rows of half the width), as measured on one H200 against 32 warps
    (docs/performance.md#world-size-1-fused_tp1)."""
    return max(4, 16 * row_block(hidden) // 8192)


def dynamic_splits(quant: int, group: int, columns: int) -> bool:
    """Whether split rows of `columns` columns may serve quant mode `quant`: per token group when
    a chunk holds whole groups (`columns` a multiple of the group size: chunks then start on group
    boundaries); every other mode always. Per token splits too: its one scale needs the whole
    row's amax, which a chunk's program gets from its partners in a second in-launch exchange
    after the sums of squares (kernels/tp1/split_rows.py)."""
    if quant == QUANT_FP8_GROUP:
        return columns % group == 0
    return True


def tp1_config(
    tokens: int,
    hidden: int,
    quant: int = QUANT_NONE,
    num_sms: int = 0,
    swizzled: bool = False,
    group: int = 0,
) -> Tp1Config:
    """World size 1: the measured launch table first (`launch_table.py`, one H200's sweep per
    output format, hidden size and T; `measured` says which entry a call reads), then the rule
    below where the table has no entry (rows narrower than 1024 columns, T below the smallest T
    swept, formats not swept).

    A table entry's fastest config is taken when it is whole rows, or split rows that serve this
    call (`split_ok` on this GPU's SM count, `dynamic_splits` for dynamic FP8); otherwise whole
    rows at the entry's fastest whole-row warps. Swizzled NVFP4 scales with H not a multiple of
    128 (an odd number of 4-scale column groups: H = 1344, 2496, 2880, ...) always take whole
    rows: the split kernel is much slower there (docs/performance.md#world-size-1-across-hidden-
    sizes).

    The rule without an entry: split rows while T * chunks programs are resident (num_sms; 0:
    never): T = 1 in 512-column chunks (4 warps) with the row prefetched into L2, else the
    smallest of 1024 / 2048 / 4096 columns that fits (8 columns per thread); whole rows otherwise
    (`whole_row_warps`). Dynamic FP8 (`group`: its group size): `dynamic_splits` (per token group
    only chunks of whole groups; per token as every other mode, its row amax exchanged between
    the chunks)."""
    rb = row_block(hidden)
    whole_only = swizzled and quant == QUANT_NVFP4 and hidden % 128 != 0
    entry = measured(tokens, hidden, table_format(quant, swizzled))
    if entry is not None:
        (columns, warps, prefetch), whole_warps = entry
        fastest = Tp1Config(columns, warps, prefetch, TP1_PDL)
        if columns >= rb:
            return fastest
        serves = split_ok(fastest, tokens, hidden, num_sms) and dynamic_splits(
            quant, group, columns
        )
        if serves and not whole_only:
            return fastest
        return Tp1Config(rb, whole_warps, 0, TP1_PDL)
    if whole_only:
        return Tp1Config(rb, whole_row_warps(tokens, hidden, quant), 0, TP1_PDL)
    for chunk in (512,) if tokens == 1 else (1024, 2048, 4096):
        warps = max(1, chunk // 256) if tokens > 1 else chunk // 128
        config = Tp1Config(chunk, warps, int(tokens == 1), TP1_PDL)
        if split_ok(config, tokens, hidden, num_sms) and dynamic_splits(quant, group, chunk):
            return config
    return Tp1Config(rb, whole_row_warps(tokens, hidden, quant), 0, TP1_PDL)


def table_format(quant: int, swizzled: bool) -> str:
    """The launch table's format of a quant mode: none, fp8 (static; dynamic FP8, not measured
    apart, reads it too), nvfp4 (swizzled scales) or nvfp4_linear."""
    if quant == QUANT_NVFP4:
        return "nvfp4" if swizzled else "nvfp4_linear"
    return "none" if quant == QUANT_NONE else "fp8"


def measured(tokens: int, hidden: int, fmt: str) -> Optional[tuple]:
    """The launch table's entry for a call: of `fmt`'s measured hidden sizes with H's row block,
    the nearest to H (the smaller on a tie); of its measured T, the nearest on a log scale (the
    smaller on a tie). None where the format or the row block has no measured H, or T is below
    the smallest T measured (the table starts where the sweep did: there the rule decides)."""
    by_hidden = TABLE.get(fmt, {})
    rb = row_block(hidden)
    near = [h for h in by_hidden if row_block(h) == rb]
    if not near:
        return None
    by_tokens = by_hidden[min(near, key=lambda m: (abs(m - hidden), m))]
    if tokens < min(by_tokens):
        return None
    t = min(by_tokens, key=lambda m: (abs(math.log2(m) - math.log2(tokens)), m))
    return by_tokens[t]


def programs_per_sm(warps: int) -> int:
    """Split-kernel programs that are always resident on one SM at once: two of at most 4 warps
    (128 threads x at most 255 registers is half an SM's register file), else one."""
    return 2 if warps <= 4 else 1


def split_ok(config: Tp1Config, tokens: int, hidden: int, num_sms: int) -> bool:
    """The split kernel serves this call: chunks < whole rows, T * chunks programs resident."""
    rb = row_block(hidden)
    chunks = triton.cdiv(hidden, config.columns)
    return (
        config.columns < rb
        and 1 < chunks <= MAX_CHUNKS
        and tokens <= SYNC_ROWS
        and tokens * chunks <= num_sms * programs_per_sm(config.warps)
    )
