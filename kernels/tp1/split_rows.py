"""`fused_tp1`'s split-row kernel (`_tp1_split_kernel`, world size 1, few rows): a row's columns
are spread over `chunks` programs, so a row's K gathers run on several SMs at once instead of one
SM serially. A program finalizes and stores its chunk, publishes its chunk's sum of squares, waits
for the row's other chunks' sums (the exchange, inside the launch) and normalizes and quantizes its
own columns; per token (dynamic FP8, one scale per row) it then publishes its chunk's amax of the
normalized row and waits for the row's other chunks' amaxes (a second exchange, the same way) before
its codes. Its building blocks and the whole-row kernel: kernels/row_epilogue.py.

The split rows' exchange (no host state, so CUDA graphs replay it; no reset): per row and chunk
count a 64-bit arrival counter, to which each program of the row adds (relaxed, issued before its
gathers so the round trip overlaps them) 1, the first chunk's 2 * MAX_CHUNKS - chunks + 1: one call
adds exactly 2 * MAX_CHUNKS (a power of two), so epoch = ticket // (2 * MAX_CHUNKS) + 1 (a shift) is
the same for the row's programs and one more than the previous call's with this chunk count), and
one 64-bit word per chunk holding (epoch mod 2^32 << 32 | fp32 sum of squares). A word is written
with one naturally aligned 64-bit store (single-copy atomic), so a reader sees a whole word or the
old one; a word whose tag is not this call's epoch is "not yet": its previous writer is the previous
call with this chunk count, whose tag is one less, since every call with a count writes all of that
count's words of its rows. Zeroed words (tag 0) never match before every word was written: epochs
start at 1. Per token's amax words (the launcher allocates them after the sums for a per-token layer
only: configs.AMAX_WORDS) are laid out as the sums' words and tagged with the same epoch, (epoch <<
32 | the bits of the chunk's amax): every per-token call with a chunk count writes all of that
count's amax words of its rows too, so the same argument holds; a program publishes its amax before
it waits for any, and every partner is resident, so the second wait ends as the first. The row's
amax is the integer max of the chunks' bits (sign cleared: a NaN's bits lie above +inf's), exactly
the whole row's NaN-keeping amax, so every program of the row takes the same scale and the codes are
the whole-row kernel's for the same norm_out. One call's tickets are consecutive: launches on one
stream run one after the other, and under PDL the next call's programs may already be resident but
take no ticket before their grid-dependency wait, which returns only once this call has completed;
eager calls on several streams at once get a set of words per stream, and calls captured in CUDA
graphs share one set zeroed before any capture (the launcher keeps them). The grid is at most the SM
count, so every program waited on is resident; a wait is bounded (polls), and a row whose partners
never arrived is written NaN, not hung (per token: an amax that never arrived gives codes 0x7F and a
NaN scale), and sets the error word that the strategy's next call raises from.

Every program of a row sums the chunks' sums in chunk order with the same reduction, so they all use
the same rsqrt. A row whose sum overflows fp32 (|x| >~ 1.8e19) is rescaled as `rms_norm_row` does
(by a power of two from the row's largest magnitude): each program of the row recomputes the row's
chunks in order, for the largest magnitude and then the scaled sum (rare: no exchange of its own,
nothing more exchanged on the common path).

Under TRITON_INTERPRET=1 programs run one after another, so a program cannot wait for a later one:
the interpreter launches the split kernel twice (PHASES = publish, then wait + outputs),
the same body; per token three times (publish, then AMAX_PHASE: the wait for the sums and the
chunk amaxes published, then the waits and the outputs).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusion_bridge.kernels import quant_codes as QC
from fusion_bridge.kernels.add_rmsnorm import overflow_scale, rms_apply
from fusion_bridge.kernels.pdl import pdl_enter
from fusion_bridge.kernels.quant import quantize_span, sf_padding_item
from fusion_bridge.kernels.quant_dynamic import (
    chunk_amax_bits,
    quantize_chunk_fp8_per_token,
    quantize_span_fp8_dynamic,
    tma_padding_row,
)
from fusion_bridge.kernels.rounding import round_cast
from fusion_bridge.kernels.row_epilogue import prefetch_row, residual_plus_finalize
from fusion_bridge.kernels.tp1 import configs as S


@triton.jit
def _exchange_row_amax(
    y,
    c,
    chunks,
    hidden,
    amax_words,
    tag,
    failed,
    error_address_ptr,
    CHUNK: tl.constexpr,
    MAX_CHUNKS: tl.constexpr,
    MAX_POLLS: tl.constexpr,
    WAIT: tl.constexpr,
):
    """Per token's second exchange (see the module docstring): publish this chunk's amax of the
    normalized row y [CHUNK] (rounded, chunk c) in its tagged word of `amax_words` (this row's and
    chunk count's: (tag << 32 | the amax's bits), one 64-bit store), then (WAIT) wait for the
    row's `chunks` words of this call's `tag` and return the row's amax (fp32 scalar, the
    NaN-keeping max of the chunks'). `failed` (the sums' wait gave up: the row is NaN already)
    skips the wait; a wait that gives up sets the error word; either returns NaN (codes 0x7F and
    a NaN scale), not a hang. WAIT off (the interpreter's AMAX_PHASE launch): publish only."""
    bits = chunk_amax_bits(y, c * CHUNK, hidden)
    tl.store(amax_words + c, (tag << 32) | bits.to(tl.int64))
    amax = bits.to(tl.float32, bitcast=True)
    if WAIT:
        lane = tl.arange(0, MAX_CHUNKS)
        mine = lane < chunks
        w = tl.load(amax_words + lane, mask=mine, other=0, volatile=True)
        pending = tl.sum((mine & (((w >> 32) & 0xFFFFFFFF) != tag)).to(tl.int32))
        polls = 0
        while (pending > 0) & (polls < MAX_POLLS) & (failed == 0):
            w = tl.load(amax_words + lane, mask=mine, other=0, volatile=True)
            pending = tl.sum((mine & (((w >> 32) & 0xFFFFFFFF) != tag)).to(tl.int32))
            polls += 1
        if (pending > 0) & (failed == 0):  # a partner's amax never arrived: the caller is told
            tl.store(tl.load(error_address_ptr).to(tl.pointer_type(tl.int32)), 1)
        row_bits = tl.max(tl.where(mine, w & 0x7FFFFFFF, 0), axis=0).to(tl.int32)
        amax = row_bits.to(tl.float32, bitcast=True)
        amax = tl.where((pending > 0) | (failed != 0), float("nan"), amax)
    return amax


@triton.jit
def _tp1_split_kernel(
    src,
    out,
    sync,
    tokens,
    hidden,
    scalars,
    sf_rows,
    sf_cols,
    chunks,
    FORM: tl.constexpr,
    CHUNK: tl.constexpr,
    PREFETCH: tl.constexpr,
    RECIP: tl.constexpr,
    USE_PDL: tl.constexpr,
    MAX_POLLS: tl.constexpr,
    PHASES: tl.constexpr,
):
    """World size 1, split rows: program pid owns columns [c * CHUNK, (c + 1) * CHUNK) of row pid //
    chunks (c = pid % chunks); programs past T * chunks write swizzled scale padding. src: a
    `records.RowSource`, out: `records.RowOutputs`, scalars: `records.LayerScalars`, FORM:
    `records.RowForm`. sync (`configs.SplitSync`): words, int64 [SYNC_ROWS * (MAX_CHUNKS + 1)]
    counters, then [SYNC_ROWS * words] tagged sums, per token as many tagged chunk amaxes after them
    (see the module docstring); error_address, int64 [1], the address of an int32 word (pinned host
    memory on a GPU) set to 1 when a wait gives up. PHASES (`configs.PUBLISH_PHASE` |
    `configs.OUTPUT_PHASE`): both on a GPU; one at a time under the interpreter, with
    `configs.AMAX_PHASE` between them per token (the outputs' launch up to the chunk amaxes
    published: no wait for them, no codes). USE_PDL (programmatic dependent launch): every program
    waits for the grid before it first, before its ticket or any other memory access
    (kernels/pdl.py), so one call's tickets stay consecutive and a call never sees the words of one
    still running."""
    pdl_enter(USE_PDL, LAUNCH_DEPENDENTS=True)
    SYNC_ROWS: tl.constexpr = S.SYNC_ROWS
    MAX_CHUNKS: tl.constexpr = S.MAX_CHUNKS
    HW_CVT: tl.constexpr = FORM.HW_CVT
    sync_ptr, error_address_ptr = sync.words, sync.error_address
    dtype: tl.constexpr = out.residual_out.dtype.element_ty
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
        if PHASES & S.PUBLISH_PHASE:
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
            prefetch_row(src, row, c * CHUNK, hidden, CHUNK, FORM)
        x = residual_plus_finalize(src, row, cols, hidden, scalars, FORM, dtype)
        # gamma before the exchange: no memory access of its own after the wait
        g = tl.load(src.gamma + cols, mask=in_row, other=0.0).to(tl.float32) + scalars.weight_bias
        if PHASES & S.PUBLISH_PHASE:
            tl.store(
                out.residual_out + row * hidden + cols,
                round_cast(x, dtype, HW_CVT=HW_CVT),
                mask=in_row,
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
        if PHASES & (S.OUTPUT_PHASE | S.AMAX_PHASE):
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
            y = rms_apply(x, g, total, hidden, scalars.eps)
            if total == float("inf"):  # uniform over the row's programs: they read the same sums
                amax = 0.0
                sum_s = 0.0
                for scaled in tl.static_range(2):  # the row's largest magnitude, then its sum
                    j = 0
                    while j < chunks:  # the row's chunks in order, as every partner does (a
                        # while: the interpreter's range() cannot take a kernel argument)
                        x_j = residual_plus_finalize(
                            src,
                            row,
                            j * CHUNK + tl.arange(0, CHUNK),
                            hidden,
                            scalars,
                            FORM,
                            dtype,
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
                y = rms_apply(x * s, g, sum_s, hidden, scalars.eps * s * s)
            y = tl.where((cols * 0 + pending) != 0, float("nan"), y)  # a partner never arrived
            y = round_cast(y, dtype, HW_CVT=HW_CVT)
            tl.store(out.norm_out + row * hidden + cols, y, mask=in_row)
            if FORM.QUANT == QC.QUANT_FP8_TOKEN:
                # the row's one scale needs the row's amax: the second exchange, after the sums
                # (its words follow theirs, laid out as theirs: the launcher's AMAX_WORDS)
                amax = _exchange_row_amax(
                    y, c, chunks, hidden, words + SYNC_ROWS * (MAX_CHUNKS * (MAX_CHUNKS + 1) // 2),
                    tag, pending, error_address_ptr, CHUNK=CHUNK, MAX_CHUNKS=MAX_CHUNKS,
                    MAX_POLLS=MAX_POLLS, WAIT=PHASES & S.OUTPUT_PHASE,
                )  # fmt: skip
                if PHASES & S.OUTPUT_PHASE:
                    quantize_chunk_fp8_per_token(
                        y, row, c * CHUNK, hidden, out, amax, sf_cols, HW_CVT=HW_CVT
                    )  # fmt: skip
            elif FORM.QUANT == QC.QUANT_FP8_GROUP:
                # the chunk holds whole groups (CHUNK a multiple of GROUP: the launcher's rule);
                # sf_cols is the scales' stride
                quantize_span_fp8_dynamic(
                    y, row, c * CHUNK, c * CHUNK, c * CHUNK + CHUNK, tokens, hidden, out, sf_cols,
                    GROUP=FORM.GROUP, LAYOUT=FORM.SCALE_LAYOUT, HW_CVT=HW_CVT, WINDOW=False,
                )  # fmt: skip
            else:
                # (LEAN: y past H needs no zeroing for NVFP4.) WINDOW off: the window would be the
                # whole span (and row < T), and its masks cost whole-word stores (the codes went
                # out byte by byte)
                quantize_span(
                    y,
                    row,
                    c * CHUNK,
                    c * CHUNK,
                    c * CHUNK + CHUNK,
                    tokens,
                    hidden,
                    out,
                    scalars.quant_scale,
                    sf_cols,
                    QUANT=FORM.QUANT,
                    SWIZZLED=FORM.SWIZZLED,
                    HW_CVT=HW_CVT,
                    WINDOW=False,
                    RECIP=RECIP,
                    LEAN=True,
                )
    elif PHASES & S.OUTPUT_PHASE:
        if FORM.QUANT == QC.QUANT_FP8_GROUP:
            if FORM.SCALE_LAYOUT == QC.SCALE_COLUMN_MAJOR_TMA:  # one program per padding row
                tma_padding_row(
                    tokens + (pid - tokens * chunks), hidden, out, sf_cols, FORM.GROUP,
                    FORM.ROW_BLOCK,
                )  # fmt: skip
        if FORM.QUANT == QC.QUANT_NVFP4:
            if FORM.SWIZZLED:
                sf_padding_item(pid - tokens * chunks, out.sf, tokens, sf_rows, sf_cols)
