"""Pieces shared by our symmetric-memory epilogue kernels (`symm_oneshot`, `symm_twoshot`).

Both move partials between ranks with the data as its own arrival flag (Lamport-style): a slot
element
holds the sentinel -0.0 (bits 0x8000 in bf16 and fp16) until a peer writes it, a published value
never
holds -0.0 (it is mapped to +0.0), and a reader polls the data itself. Each kernel's module
docstring
carries its memory-ordering argument; this module holds the arithmetic (finalize, roundings, norm
and
quant of a row), the bounded poll, the timeout report and the few GPU-only pieces (inline PTX, peer
pointers). Every @triton.jit helper here also runs under TRITON_INTERPRET=1, except those marked GPU
only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant import _e2m1_codes, _e4m3_rne_satfinite
from .quant import row_block  # noqa: F401  (re-exported: the power-of-two block that holds one row)
from .rounding import round_to

HEADER_BYTES = 256
SLOTS = 3
SENTINEL_BITS = -32768  # int16 view of -0.0 in bf16 and fp16 (0x8000)
SENTINEL = tl.constexpr(SENTINEL_BITS)
ERR_TIMEOUT = tl.constexpr(
    1 << 16
)  # error word: bit 16 = this rank timed out; bits 0-15 = ranks missed
ERR_ABORTED = tl.constexpr(
    1 << 17
)  # a peer timed out earlier (bits 20-27: that rank; 0-15: whom it missed)


@triton.jit
def _finalize_chunk(
    gemm2_ptr,
    perm_ptr,
    weight_ptr,
    shared_ptr,
    row,
    cols,
    hidden,
    routed_scaling,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
):
    """fp32 [BLOCK]: routed_scaling * sum_k w * gemm2_out[perm] (+ shared) for row `row` (int64),
    `cols`.
    Slots with perm == -1 are never read (a skipped slot's weight may be garbage)."""
    in_row = cols < hidden
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        src = tl.load(perm_ptr + row * TOP_K + k).to(tl.int64)
        weight = tl.load(weight_ptr + row * TOP_K + k).to(tl.float32)
        valid = (cols * 0 + src) >= 0  # vector form: the interpreter rejects a scalar-bool mask
        x = tl.load(gemm2_ptr + src * hidden + cols, mask=in_row & valid, other=0.0).to(tl.float32)
        acc += tl.where(valid, x * weight, 0.0)
    acc = acc * routed_scaling
    if HAS_SHARED:
        acc += tl.load(shared_ptr + row * hidden + cols, mask=in_row, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _round(x, dtype: tl.constexpr):
    """round_to, NaN kept NaN: the GPU's canonical NaN (0x7FFFFFFF) would carry into the sign bit of
    the
    integer rounding and come out as -0.0 (measured: a NaN norm_out read as -0.0)."""
    return tl.where(x != x, x.to(dtype), round_to(x, dtype))


@triton.jit
def _payload_bits(acc, dtype: tl.constexpr):
    """fp32 -> the partial's int16 bits: one RNE rounding to `dtype`; -0.0 (the sentinel) ->
    +0.0."""
    bits = _round(acc, dtype).to(tl.int16, bitcast=True)
    return tl.where(bits == SENTINEL, 0, bits).to(tl.int16)


@triton.jit
def _poll_status(v, abort_ptr, start, timeout, polls, EMU: tl.constexpr):
    """One int32, the same in every thread of the program (a block reduction): bit 0 some value is
    still
    the sentinel, bit 1 the time (EMU: the poll count) ran out, bit 2 the abort word is set."""
    if EMU:
        late = polls >= timeout
    else:
        late = (_globaltimer() - start) > timeout
    ab = tl.load(abort_ptr, volatile=True)
    flags = (v == SENTINEL).to(tl.int32) | (late.to(tl.int32) << 1) | ((ab != 0).to(tl.int32) << 2)
    return tl.max(
        tl.max(flags, axis=0), axis=0
    )  # sources first: they sit in each thread's registers


@triton.jit
def _wait_row(
    src_ptr,
    src_stride,
    row,
    hidden,
    abort_ptr,
    start,
    timeout,
    only_q,
    skip_q,
    WORLD: tl.constexpr,
    WP: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    EMU: tl.constexpr,
    WAIT: tl.constexpr,
):
    """Poll row `row` of the WORLD sources (int16 bits [WP, ROW_BLOCK], source q at src_ptr +
    q*src_stride)
    until no value is the sentinel, the time runs out or the abort word is set. only_q >= 0: only
    that
    source (benchmark ablation); skip_q: a source never read (a rank's own partial, kept in
    registers;
    -1 for none). Skipped sources read as 0. Returns (bits, status)."""
    q = tl.arange(0, WP)[:, None]
    cols = tl.arange(0, ROW_BLOCK)[None, :]
    mask = (q < WORLD) & (cols < hidden) & ((only_q < 0) | (q == only_q)) & (q != skip_q)
    ptrs = src_ptr + q.to(tl.int64) * src_stride + row * hidden + cols
    v = tl.load(ptrs, mask=mask, other=0, volatile=True)
    polls = 1
    status = _poll_status(v, abort_ptr, start, timeout, polls, EMU)
    if WAIT:
        while status == 1:
            v = tl.load(ptrs, mask=mask, other=0, volatile=True)
            polls += 1
            status = _poll_status(v, abort_ptr, start, timeout, polls, EMU)
    return v, status


@triton.jit
def _missing_ranks(v, WORLD: tl.constexpr, WP: tl.constexpr):
    """Bit q set when source q still holds a sentinel."""
    pending = tl.max((v == SENTINEL).to(tl.int32), axis=1)  # [WP]
    qs = tl.arange(0, WP)
    return tl.sum(tl.where(qs < WORLD, pending << qs, 0), axis=0)


@triton.jit
def _gamma_row(gamma_ptr, hidden, weight_bias, ROW_BLOCK: tl.constexpr):
    """fp32 [ROW_BLOCK]: gamma + weight_bias (0 past H); a persistent program loads it once."""
    cols = tl.arange(0, ROW_BLOCK)
    return tl.load(gamma_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32) + weight_bias


@triton.jit
def _norm_quant_row(
    x,
    g,
    row,
    lo,
    hi,
    norm_out_ptr,
    q_ptr,
    sf_ptr,
    hidden,
    eps,
    quant_scale,
    sf_cols,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    """x: fp32 [ROW_BLOCK], the whole row (0 past H); g: gamma + weight_bias (`_gamma_row`). Stores
    norm_out = round(x * rsqrt(mean(x^2) + eps) * g) and its FP8 / NVFP4 codes for columns [lo, hi)
    (multiples of 64)."""
    cols = tl.arange(0, ROW_BLOCK)
    in_row = cols < hidden
    offs = row * hidden + cols
    mine = in_row & (cols >= lo) & (cols < hi)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    y = _round(x * inv_rms * g, norm_out_ptr.dtype.element_ty)
    tl.store(norm_out_ptr + offs, y, mask=mine)
    if QUANT == 1:
        v8 = tl.math.div_rn(y.to(tl.float32), quant_scale)
        if HW_CVT:
            code = (
                tl.minimum(tl.maximum(v8, -448.0), 448.0)
                .to(tl.float8e4nv)
                .to(tl.uint8, bitcast=True)
            )
        else:
            code, _ = _e4m3_rne_satfinite(v8)
        tl.store(q_ptr + offs, code.to(tl.uint8), mask=mine)
    if QUANT == 2:
        _nvfp4_row(
            tl.where(in_row, y, 0.0),
            row,
            lo,
            hi,
            hidden,
            q_ptr,
            sf_ptr,
            quant_scale,
            sf_cols,
            SWIZZLED,
            ROW_BLOCK,
        )


@triton.jit
def _timeout_word(who, abort_ptr, rank):
    """The error word of a wait that failed: this rank timed out waiting for ranks `who` (a bit
    mask), or
    a peer (or a sibling program of this rank: then it is this rank's own timeout) set the abort
    word."""
    ab = tl.load(abort_ptr, volatile=True)
    own = ((ab >> 20) & 0xFF) == rank
    return tl.where(ab == 0, ERR_TIMEOUT | who, tl.where(own, ERR_TIMEOUT | (ab & 0xFFFF), ab)), ab


@triton.jit
def _report_timeout(who, ptrs_ptr, state_ptr, abort_ptr, rank, WORLD: tl.constexpr):
    """GPU only. A wait failed: write the error word into the pinned host word (ptrs[WORLD]) and
    state[2]
    and, if no abort is under way, tell every rank (itself included) to stop waiting from now on."""
    err, ab = _timeout_word(who, abort_ptr, rank)
    tl.store(tl.load(ptrs_ptr + WORLD).to(tl.pointer_type(tl.int32)), err)
    tl.store(state_ptr + 2, err)
    if ab == 0:
        for q in tl.static_range(WORLD):
            tl.atomic_xchg(
                tl.load(ptrs_ptr + q).to(tl.pointer_type(tl.int32)),
                ERR_ABORTED | (rank << 20) | who,
                sem="relaxed",
                scope="sys",
            )


@triton.jit
def _nvfp4_row(
    y,
    row,
    lo,
    hi,
    hidden,
    q_ptr,
    sf_ptr,
    global_scale,
    sf_cols,
    SWIZZLED: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
):
    """NVFP4 of a whole row (y rounded, 0 past H), stored for columns [lo, hi) only (lo, hi
    multiples of
    64, so the chunks together cover the swizzled padding columns too, written 0)."""
    yb = tl.reshape(y.to(tl.float32), [ROW_BLOCK // 16, 16])
    amax = tl.max(tl.abs(yb), axis=1)
    sf_code, sf = _e4m3_rne_satfinite(tl.math.div_rn(global_scale * amax, 6.0))
    scaled = yb * global_scale
    codes = _e2m1_codes(tl.abs(scaled), sf[:, None]) | ((scaled < 0).to(tl.int32) << 3)
    lo4, hi4 = tl.split(tl.reshape(codes, [ROW_BLOCK // 2, 2]))
    packed = tl.arange(0, ROW_BLOCK // 2)
    keep = (packed * 2 >= lo) & (packed * 2 < hi)
    tl.store(
        q_ptr + row * (hidden // 2) + packed,
        (lo4 | (hi4 << 4)).to(tl.uint8),
        mask=(packed < hidden // 2) & keep,
    )
    kb = tl.arange(0, ROW_BLOCK // 16)
    keep_sf = (kb * 16 >= lo) & (kb * 16 < hi)
    sf_byte = tl.where(kb < hidden // 16, sf_code, 0).to(tl.uint8)
    if SWIZZLED:
        off = (
            (row // 128) * (sf_cols * 128)
            + (kb // 4) * 512
            + (row % 32) * 16
            + ((row % 128) // 32) * 4
            + (kb % 4)
        )
        tl.store(sf_ptr + off, sf_byte, mask=(kb < sf_cols) & keep_sf)
    else:
        tl.store(sf_ptr + row * (hidden // 16) + kb, sf_byte, mask=(kb < hidden // 16) & keep_sf)


def sf_padding_items(tokens: int, sf_rows: int, sf_cols: int) -> int:
    return triton.cdiv(max(sf_rows - tokens, 0), 32) * triton.cdiv(sf_cols, 128)


@triton.jit
def _sf_padding_item(item, sf_ptr, tokens, sf_rows, sf_cols):
    """Swizzled scale padding rows T .. round_up(T, 128) -> 0; item = (32 padding rows, 128 scale
    columns): few items, so T=1 (127 padding rows) costs a store or two per program, not a loop."""
    kchunks = tl.cdiv(sf_cols, 128)
    row = tokens + (item // kchunks) * 32 + tl.arange(0, 32)[:, None]
    kb = (item % kchunks) * 128 + tl.arange(0, 128)[None, :]
    off = (
        (row // 128) * (sf_cols * 128)
        + (kb // 4) * 512
        + (row % 32) * 16
        + ((row % 128) // 32) * 4
        + (kb % 4)
    )
    tl.store(
        sf_ptr + off, tl.zeros([32, 128], dtype=tl.uint8), mask=(kb < sf_cols) & (row < sf_rows)
    )


@triton.jit
def _clear_item(item, slot_ptr, hidden, CLEAR_BLOCK: tl.constexpr):
    """Item (source-row r of a [W * rows, H] slot block, column chunk) -> the sentinel."""
    chunks = tl.cdiv(hidden, CLEAR_BLOCK)
    r = (item // chunks).to(tl.int64)
    cols = (item % chunks) * CLEAR_BLOCK + tl.arange(0, CLEAR_BLOCK)
    tl.store(
        slot_ptr + r * hidden + cols, tl.full([CLEAR_BLOCK], SENTINEL, tl.int16), mask=cols < hidden
    )


# ------------------------------------------------------------------------------------------------
# GPU only: inline PTX and peer pointers
# ------------------------------------------------------------------------------------------------
@triton.jit
def _peer_ptr(ptrs_ptr, q, dtype: tl.constexpr):
    """Rank q's buffer as a `dtype` pointer. Buffers are 256-byte aligned: saying so lets the slot
    loads and stores vectorize (the compiler knows nothing about an integer cast to a pointer)."""
    return tl.multiple_of(tl.load(ptrs_ptr + q).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _fence_acq_rel_gpu_if(pred):
    """fence.acq_rel.gpu in the lanes where pred != 0; returns 0 (make later stores depend on
    it)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $1, 0; @p fence.acq_rel.gpu; mov.u32 $0, 0; }",
        "=r,r",
        [pred],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def _tl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def fill_sentinel(t: torch.Tensor) -> None:
    """Every element of a bf16/fp16 tensor -> the sentinel (-0.0)."""
    t.view(torch.int16).fill_(SENTINEL_BITS)
