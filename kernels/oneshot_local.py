"""The one-shot kernel's local work (kernels/symm_oneshot.py) with the exchange left out: the
world-size-1 kernels, and the row epilogue that the exchange kernel shares with them.

Two launch shapes, one launch each, from the same building blocks (finalize_add.finalize_row,
add_rmsnorm.rms_norm_row / rms_apply, quant.quantize_row / quantize_span) in their leaner forms
(SELECT_ONCE, LEAN, RECIP: the same bits in fewer instructions; rounding.round_cast) and, where a
launch shape asks for it, the row prefetched into L2 before its gathers (`prefetch_row`):

- whole rows (`_tp1_kernel`): one program per row keeps the row's top-k finalize in registers,
  rounds it once as a published partial would be, adds the residual, normalizes and quantizes.
- split rows (`_tp1_split_kernel`, few rows): a row's columns are spread over `chunks` programs,
  so a row's K gathers run on several SMs at once instead of one SM serially. A program finalizes
  and stores its chunk, publishes its chunk's sum of squares, waits for the row's other chunks'
  sums (the only exchange, inside the launch) and normalizes and quantizes its own columns.

The split rows' exchange (no host state, so CUDA graphs replay it; no reset): per row and chunk
count a 64-bit arrival counter, to which each program of the row adds (relaxed, issued before
its gathers so the round trip overlaps them) 1, the first chunk's 2 * MAX_CHUNKS - chunks + 1: one
call adds exactly 2 * MAX_CHUNKS (a power of two), so epoch = ticket // (2 * MAX_CHUNKS) + 1 (a
shift) is the same for the row's programs and one more than the previous call's with this chunk
count), and one 64-bit word per chunk holding (epoch mod 2^32 << 32 | fp32 sum of squares).
A word is written with one naturally aligned 64-bit store (single-copy atomic), so a reader sees a
whole word or the old one; a word whose tag is not this call's epoch is "not yet": its previous
writer is the previous call with this chunk count, whose tag is one less, since every call with a
count writes all of that count's words of its rows. Zeroed words (tag 0) never match before every
word was written: epochs start at 1. Launches on one stream do not overlap, so one call's tickets
are consecutive; eager calls on several streams at once get a set of words per stream, and calls
captured in CUDA graphs share one set zeroed before any capture (the launcher keeps them). The
grid is at most the SM count, so every program waited on is resident; a wait is bounded (polls),
and a row whose partners never arrived is written NaN, not hung, and sets the error word that the
strategy's next call raises from.

Every program of a row sums the chunks' sums in chunk order with the same reduction, so they all
use the same rsqrt. A row whose sum overflows fp32 (|x| >~ 1.8e19) is rescaled as
`rms_norm_row` does (by a power of two from the row's largest magnitude): each program of the row
recomputes the row's chunks in order, for the largest magnitude and then the scaled sum (rare: no
second exchange, nothing more exchanged on the common path).

Under TRITON_INTERPRET=1 programs run one after another, so a program cannot wait for a later one:
the interpreter launches the split kernel twice (PHASES = publish, then wait + outputs), the same
body.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .add_rmsnorm import norm_quant_row, overflow_scale, rms_apply, rms_norm_row
from .finalize_add import finalize_row
from .quant import quantize_row, quantize_span, sf_padding_item
from .rounding import round_cast, round_to


@triton.jit
def prefetch_l2(ptrs, mask):
    """Ask L2 for the 32-byte sector at each pointer where mask (GPU only: inline PTX). No register
    holds a result, so the compiler cannot postpone it to where the data is used, as it postpones
    a row's K gathers one behind the other to keep registers free."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "=r,l,r",
        [ptrs, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def prefetch_row(
    gemm2_ptr,
    perm_ptr,
    shared_ptr,
    residual_ptr,
    row,
    lo,
    hidden,
    SPAN: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
):
    KP: tl.constexpr = triton.next_power_of_2(TOP_K)
    """Prefetch into L2 what `_chunk_x` reads of columns [lo, lo + SPAN) of `row` (the K gathered
    rows, the shared output, the residual): one sector per 16 columns, so every DRAM request of
    the row is in flight at once and the gathers that follow, one behind the other, hit L2."""
    cols = lo + tl.arange(0, SPAN // 16)[None, :] * 16
    ok = cols < hidden
    slot = tl.arange(0, KP)[:, None]  # every slot's routing loaded at once, not one by one
    src = tl.load(perm_ptr + row * TOP_K + slot, mask=slot < TOP_K, other=-1).to(tl.int64)
    prefetch_l2(gemm2_ptr + src * hidden + cols, ok & (src >= 0))
    if HAS_SHARED:
        prefetch_l2(shared_ptr + row * hidden + cols, ok)
    prefetch_l2(residual_ptr + row * hidden + cols, ok)


@triton.jit
def row_outputs(
    s,
    row,
    lo,
    hi,
    bad,
    tokens,
    residual_ptr,
    gamma_ptr,
    residual_out_ptr,
    norm_out_ptr,
    q_ptr,
    sf_ptr,
    hidden,
    eps,
    weight_bias,
    quant_scale,
    sf_cols,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    HW_CVT: tl.constexpr,
    OVERFLOW_SAFE: tl.constexpr,
):
    """From the row's summed partials s (fp32 [ROW_BLOCK]): the whole row's x = residual + s and
    its norm (each program of the row computes them identically), stored for columns [lo, hi) only
    (multiples of 64, so the masks stay constant over whole 16-byte vectors). bad != 0 writes
    NaN."""
    dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
    cols = tl.arange(0, ROW_BLOCK)
    in_row = cols < hidden
    offs = row * hidden + cols
    x = tl.load(residual_ptr + offs, mask=in_row, other=0.0).to(tl.float32) + s
    x = tl.where((cols * 0 + bad) != 0, float("nan"), x)
    tl.store(residual_out_ptr + offs, round_to(x, dtype), mask=in_row & (cols >= lo) & (cols < hi))
    g = tl.load(gamma_ptr + cols, mask=in_row, other=0.0).to(tl.float32) + weight_bias
    norm_quant_row(
        x,
        g,
        row,
        lo,
        hi,
        tokens,
        norm_out_ptr,
        q_ptr,
        sf_ptr,
        hidden,
        eps,
        quant_scale,
        sf_cols,
        QUANT,
        SWIZZLED,
        ROW_BLOCK,
        HW_CVT,
        OVERFLOW_SAFE,
    )


@triton.jit
def _tp1_kernel(
    gemm2_ptr,
    perm_ptr,
    weight_ptr,
    shared_ptr,
    residual_ptr,
    gamma_ptr,
    residual_out_ptr,
    norm_out_ptr,
    q_ptr,
    sf_ptr,
    tokens,
    hidden,
    routed_scaling,
    eps,
    weight_bias,
    quant_scale,
    sf_cols,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    HW_CVT: tl.constexpr,
    PREFETCH: tl.constexpr,
    RECIP: tl.constexpr,
):
    """World size 1, whole rows: one program per row; the top-k finalize of the row stays in
    registers, rounded once as a published partial would be (so residual_out is the two-launch
    path's bit for bit), then residual, norm and quant from the same building blocks. Programs past
    T (swizzled NVFP4 only) write their scale row's padding (zeros), as the standalone norm kernel
    does. PREFETCH: the row's reads requested into L2 at once before its gathers (GPU only).
    RECIP: fp8 through one reciprocal (quant._div_by_scale). Roundings through the GPU's own
    conversion where HW_CVT (rounding.round_cast). Its source reaches no module-level value, which
    lets the cached launcher launch it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, ROW_BLOCK)
    if row < tokens:
        if PREFETCH:
            prefetch_row(
                gemm2_ptr,
                perm_ptr,
                shared_ptr,
                residual_ptr,
                row,
                0,
                hidden,
                ROW_BLOCK,
                TOP_K,
                HAS_SHARED,
            )
        acc = finalize_row(
            gemm2_ptr,
            perm_ptr,
            weight_ptr,
            shared_ptr,
            row,
            cols,
            hidden,
            routed_scaling,
            TOP_K,
            HAS_SHARED,
            True,  # SELECT_ONCE
            HW_CVT,  # GPU_MUL_RN: on a GPU
        )
        dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
        in_row = cols < hidden
        offs = row * hidden + cols
        x = tl.load(residual_ptr + offs, mask=in_row, other=0.0).to(tl.float32)
        x += round_cast(acc, dtype, HW_CVT).to(tl.float32)
        tl.store(residual_out_ptr + offs, round_cast(x, dtype, HW_CVT), mask=in_row)
        g = tl.load(gamma_ptr + cols, mask=in_row, other=0.0).to(tl.float32) + weight_bias
        # overflow-safe, as the two-launch path's norm kernel
        y = round_cast(rms_norm_row(x, g, hidden, eps, True), dtype, HW_CVT)
        tl.store(norm_out_ptr + offs, y, mask=in_row)
        if QUANT == 2:
            y = tl.where(in_row, y, 0.0)
        quantize_row(
            y,
            row,
            0,
            ROW_BLOCK,
            tokens,
            hidden,
            q_ptr,
            sf_ptr,
            quant_scale,
            sf_cols,
            QUANT,
            SWIZZLED,
            ROW_BLOCK,
            HW_CVT,
            False,
            RECIP,
            True,  # LEAN
        )
    else:
        quantize_row(
            tl.zeros([ROW_BLOCK], dtype=tl.float32),
            row,
            0,
            ROW_BLOCK,
            tokens,
            hidden,
            q_ptr,
            sf_ptr,
            quant_scale,
            sf_cols,
            QUANT,
            SWIZZLED,
            ROW_BLOCK,
            HW_CVT,
            False,
            False,
            True,  # LEAN
        )


@triton.jit
def _chunk_x(
    gemm2_ptr,
    perm_ptr,
    weight_ptr,
    shared_ptr,
    residual_ptr,
    row,
    cols,
    hidden,
    routed_scaling,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    dtype: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    """fp32 x = residual + round(finalize) on `cols` of `row` (0 past H): `_tp1_kernel`'s x."""
    acc = finalize_row(
        gemm2_ptr,
        perm_ptr,
        weight_ptr,
        shared_ptr,
        row,
        cols,
        hidden,
        routed_scaling,
        TOP_K,
        HAS_SHARED,
        True,  # SELECT_ONCE
        HW_CVT,  # GPU_MUL_RN: on a GPU
    )
    res = tl.load(residual_ptr + row * hidden + cols, mask=cols < hidden, other=0.0)
    return res.to(tl.float32) + round_cast(acc, dtype, HW_CVT).to(tl.float32)


@triton.jit
def _tp1_split_kernel(
    gemm2_ptr,
    perm_ptr,
    weight_ptr,
    shared_ptr,
    residual_ptr,
    gamma_ptr,
    residual_out_ptr,
    norm_out_ptr,
    q_ptr,
    sf_ptr,
    sync_ptr,
    error_address_ptr,
    tokens,
    hidden,
    routed_scaling,
    eps,
    weight_bias,
    quant_scale,
    sf_rows,
    sf_cols,
    chunks,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    CHUNK: tl.constexpr,
    HW_CVT: tl.constexpr,
    SYNC_ROWS: tl.constexpr,
    MAX_CHUNKS: tl.constexpr,
    PREFETCH: tl.constexpr,
    RECIP: tl.constexpr,
    MAX_POLLS: tl.constexpr,
    PHASES: tl.constexpr,
):
    """World size 1, split rows: program pid owns columns [c * CHUNK, (c + 1) * CHUNK) of row
    pid // chunks (c = pid % chunks); programs past T * chunks write swizzled scale padding.
    sync_ptr: int64 [SYNC_ROWS * (MAX_CHUNKS + 1)] counters, then [SYNC_ROWS * words] tagged
    sums (see the module docstring). error_address_ptr: int64 [1], the address of an int32 word
    (pinned host memory on a GPU) set to 1 when a wait gives up. PHASES: both on a GPU; one at a
    time under the interpreter."""
    dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    row = (pid // chunks).to(tl.int64)
    if row < tokens:
        c = pid % chunks
        cols = c * CHUNK + tl.arange(0, CHUNK)
        in_row = cols < hidden
        counter = sync_ptr + row * (MAX_CHUNKS + 1) + chunks
        words = (
            sync_ptr
            + SYNC_ROWS * (MAX_CHUNKS + 1)
            + row * (MAX_CHUNKS * (MAX_CHUNKS + 1) // 2)
            + chunks * (chunks - 1) // 2
        )
        lane = tl.arange(0, MAX_CHUNKS)
        if PHASES & 1:
            # the ticket first, so its round trip overlaps the gathers: one lane of a tensor
            # atomic laid out as the row data (no replicated lanes, so no broadcast through
            # shared memory and no barrier here); its result waits in a register until used
            first = tl.arange(0, CHUNK) == 0
            ticket = tl.atomic_add(
                counter + cols * 0,
                tl.where(first, tl.where(c == 0, 2 * MAX_CHUNKS - chunks + 1, 1), 0).to(tl.int64),
                mask=first,
                sem="relaxed",
                scope="gpu",
            )
        if PREFETCH:
            prefetch_row(
                gemm2_ptr,
                perm_ptr,
                shared_ptr,
                residual_ptr,
                row,
                c * CHUNK,
                hidden,
                CHUNK,
                TOP_K,
                HAS_SHARED,
            )
        x = _chunk_x(
            gemm2_ptr,
            perm_ptr,
            weight_ptr,
            shared_ptr,
            residual_ptr,
            row,
            cols,
            hidden,
            routed_scaling,
            TOP_K,
            HAS_SHARED,
            dtype,
            HW_CVT,
        )
        # gamma before the exchange: no memory access of its own after the wait
        g = tl.load(gamma_ptr + cols, mask=in_row, other=0.0).to(tl.float32) + weight_bias
        if PHASES & 1:
            tl.store(
                residual_out_ptr + row * hidden + cols, round_cast(x, dtype, HW_CVT), mask=in_row
            )
            sum_sq = tl.sum(x * x, axis=0)
            # the word is packed where the ticket landed (lane 0), with no reduction before the
            # store: partners wait for it; this program's own epoch is reduced after it
            tag = (ticket // (2 * MAX_CHUNKS) + 1) & 0xFFFFFFFF  # a shift: no division
            word = (tag << 32) | (sum_sq.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
            tl.store(words + c + cols * 0, word, mask=first)
            epoch = tl.sum(tl.where(first, ticket, 0), axis=0) // (2 * MAX_CHUNKS) + 1
        else:  # the interpreter's second launch: the publish launch advanced the counter
            epoch = tl.load(counter) // (2 * MAX_CHUNKS)
        if PHASES & 2:
            mine = lane < chunks
            w = tl.load(words + lane, mask=mine, other=0, volatile=True)
            tag = epoch & 0xFFFFFFFF
            pending = tl.sum((mine & (((w >> 32) & 0xFFFFFFFF) != tag)).to(tl.int32))
            polls = 0
            while (pending > 0) & (polls < MAX_POLLS):
                w = tl.load(words + lane, mask=mine, other=0, volatile=True)
                pending = tl.sum((mine & (((w >> 32) & 0xFFFFFFFF) != tag)).to(tl.int32))
                polls += 1
            if pending > 0:  # a partner never arrived: the row is NaN, and the caller is told
                tl.store(tl.load(error_address_ptr).to(tl.pointer_type(tl.int32)), 1)
            sums = tl.where(mine, (w & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
            total = tl.sum(sums, axis=0)
            y = rms_apply(x, g, total, hidden, eps)
            if total == float("inf"):  # uniform over the row's programs: they read the same sums
                amax = 0.0
                sum_s = 0.0
                for scaled in tl.static_range(2):  # the row's largest magnitude, then its sum
                    j = 0
                    while j < chunks:  # the row's chunks in order, as every partner does (a
                        # while: the interpreter's range() cannot take a kernel argument)
                        x_j = _chunk_x(
                            gemm2_ptr,
                            perm_ptr,
                            weight_ptr,
                            shared_ptr,
                            residual_ptr,
                            row,
                            j * CHUNK + tl.arange(0, CHUNK),
                            hidden,
                            routed_scaling,
                            TOP_K,
                            HAS_SHARED,
                            dtype,
                            HW_CVT,
                        )
                        if scaled:
                            x_j = x_j * overflow_scale(
                                (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
                            )
                            sum_s += tl.sum(x_j * x_j, axis=0)
                        else:
                            amax = tl.maximum(amax, tl.max(tl.abs(x_j), axis=0))
                        j += 1
                s = overflow_scale((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF)
                y = rms_apply(x * s, g, sum_s, hidden, eps * s * s)
            y = tl.where((cols * 0 + pending) != 0, float("nan"), y)  # a partner never arrived
            y = round_cast(y, dtype, HW_CVT)
            tl.store(norm_out_ptr + row * hidden + cols, y, mask=in_row)
            if QUANT == 2:
                y = tl.where(in_row, y, 0.0)
            quantize_span(
                y,
                row,
                c * CHUNK,
                c * CHUNK,
                c * CHUNK + CHUNK,
                tokens,
                hidden,
                q_ptr,
                sf_ptr,
                quant_scale,
                sf_cols,
                QUANT,
                SWIZZLED,
                CHUNK,
                HW_CVT,
                True,
                RECIP,
                True,  # LEAN
            )
    elif PHASES & 2:
        if QUANT == 2:
            if SWIZZLED:
                sf_padding_item(pid - tokens * chunks, sf_ptr, tokens, sf_rows, sf_cols)
