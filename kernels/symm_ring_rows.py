"""The ring's row stages (reduce, gather) streamed in column chunks: a row is never held whole in
registers, so the kernel's register count is set by its finalize tile, not by H, and several
programs fit on an SM (`RingShape.row_cols`; 0 keeps the whole-row code in `symm_ring_stages`).

Pass 1 walks the row in chunks of R_COLS columns: wait for the chunk's sources, sum, round,
(owner: clear and push to the peers), store residual_out and add its squares to the row's sum.
Pass 2 re-reads the row's residual_out chunks this program just stored (L2-hot) and stores
norm_out and its FP8 / NVFP4 codes. The norm reads the rounded residual_out, as the whole-row code
does, so the arithmetic is the same but the order of the fp32 sum of squares (chunk partials,
then one block sum). FP8 scales are per tensor and NVFP4 blocks (16 columns) never straddle a
chunk (R_COLS is a power of two >= 64), so the quantization needs nothing but the row's norm.
Every rank runs this same code for a row's outputs (owner and gatherers), so every output is
bitwise identical on every rank. A wait that fails turns the row's residual_out NaN from the
chunk where it failed on, and the whole norm_out (its sum of squares is NaN)."""

from __future__ import annotations

import triton
import triton.language as tl

from .add_rmsnorm import overflow_scale, rms_apply
from .quant import quantize_span
from .rounding import round_to
from .symm_device import SENTINEL, payload_bits
from .symm_ring_device import _fail, _slot_base, _wait_tile


@triton.jit
def _store_chunk(x, bad, t, cols, in_row, residual_out_ptr, hidden, sum_sq):
    """Store chunk `cols` of row t's residual_out (x fp32, exact in the activation dtype; NaN
    where a wait failed); returns sum_sq [R_COLS] plus its squares."""
    x = tl.where((cols * 0 + bad) != 0, float("nan"), x)
    tl.store(residual_out_ptr + t * hidden + cols, x.to(residual_out_ptr.dtype.element_ty),
             mask=in_row)  # fmt: skip
    x = tl.where(in_row, x, 0.0)
    return sum_sq + x * x


@triton.jit
def row_norm_streamed(
    t, sum_sq, gamma_ptr, weight_bias, residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr, tokens,
    hidden, eps, quant_scale, sf_cols, QUANT: tl.constexpr, SWIZZLED: tl.constexpr,
    R_COLS: tl.constexpr, HW_CVT: tl.constexpr,
):  # fmt: skip
    """Pass 2 of row t: sum_sq [R_COLS] are the squares of its residual_out, stored by this
    program. A finite row whose squares overflow fp32 is rescaled by a power of two first, as
    `add_rmsnorm.rms_norm_row` does (two more passes, taken only then)."""
    tl.debug_barrier()  # residual_out's chunks were stored by other threads of this program
    ssq = tl.sum(sum_sq, axis=0)
    s = tl.full([], 1.0, tl.float32)
    base = residual_out_ptr + t * hidden
    if ssq == float("inf"):
        amax = tl.full([], 0.0, tl.float32)
        for c0 in range(0, hidden, R_COLS):
            cols = c0 + tl.arange(0, R_COLS)
            x = tl.load(base + cols, mask=cols < hidden, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
        s = overflow_scale((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF)
        ssq = tl.full([], 0.0, tl.float32)
        for c0 in range(0, hidden, R_COLS):
            cols = c0 + tl.arange(0, R_COLS)
            x = tl.load(base + cols, mask=cols < hidden, other=0.0).to(tl.float32) * s
            ssq += tl.sum(x * x, axis=0)
    for c0 in range(0, hidden, R_COLS):
        cols = c0 + tl.arange(0, R_COLS)
        in_row = cols < hidden
        x = tl.load(base + cols, mask=in_row, other=0.0).to(tl.float32)
        g = tl.load(gamma_ptr + cols, mask=in_row, other=0.0).to(tl.float32) + weight_bias
        # s = 1 and eps * 1 * 1 on every row but an overflowing one: the plain formula's bits
        y = round_to(rms_apply(x * s, g, ssq, hidden, eps * s * s), norm_out_ptr.dtype.element_ty)
        tl.store(norm_out_ptr + t * hidden + cols, y, mask=in_row)
        if QUANT != 0:
            y = tl.where(in_row, y, 0.0)  # a NaN row (failed wait) stays NaN only inside the row
            quantize_span(
                y, t, c0, 0, c0 + R_COLS, tokens, hidden, q_ptr, sf_ptr, quant_scale, sf_cols,
                QUANT, SWIZZLED, R_COLS, HW_CVT, True,
            )  # fmt: skip


@triton.jit
def reduce_row_streamed(
    t, ii, here, src_stride, slot, chunk, residual_ptr, residual_out_ptr, abort_ptr, ptrs_ptr,
    state_ptr, start, timeout, rank, hidden, WORLD: tl.constexpr, R_COLS: tl.constexpr,
    EMU: tl.constexpr,
):  # fmt: skip
    """Pass 1 of owner row t (this rank's row ii of the slot): per chunk, wait for the W partials,
    sum them in rank order in fp32, add the residual, round once (-0.0 -> +0.0), clear the
    partials, push the bits to every other rank's all-gather row [rank][ii] of the slot and store
    residual_out. Returns
    the squares of residual_out [R_COLS] for pass 2."""
    dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
    row_elems = tl.full([], 0, tl.int64) + hidden
    sum_sq = tl.zeros([R_COLS], dtype=tl.float32)
    for c0 in range(0, hidden, R_COLS):
        cols = c0 + tl.arange(0, R_COLS)
        in_row = cols < hidden
        res = tl.load(residual_ptr + t * row_elems + cols, mask=in_row, other=0.0)
        row = ii * row_elems + cols[None, :]
        acc = tl.zeros([R_COLS], dtype=tl.float32)
        bad = 0
        who = 0
        for q in range(WORLD):  # rank order
            v, b = _wait_tile(here + q * src_stride + row, in_row[None, :], abort_ptr, start,
                              timeout, EMU)  # fmt: skip
            acc += tl.sum(v.to(dtype, bitcast=True).to(tl.float32), axis=0)  # [1, RC]: exact
            bad = bad | b
            who = who | (b << q)
        if bad != 0:
            _fail(who, abort_ptr, ptrs_ptr, state_ptr, rank, WORLD)
        x = res.to(tl.float32) + acc
        x = tl.where((cols * 0 + bad) != 0, float("nan"), x)
        bits = payload_bits(x, dtype)
        for q in range(WORLD):  # read above (the polls' block reductions): clear
            tl.store(here + q * src_stride + row, tl.full(row.shape, SENTINEL, tl.int16),
                     mask=in_row[None, :])  # fmt: skip
        for q in range(WORLD):
            if q != rank:
                dst = _slot_base(ptrs_ptr, q, slot, hidden, chunk, WORLD)
                tl.store(dst + (WORLD + rank) * src_stride + ii * row_elems + cols, bits,
                         mask=in_row)  # fmt: skip
        sum_sq = _store_chunk(bits.to(dtype, bitcast=True).to(tl.float32), bad, t, cols, in_row,
                              residual_out_ptr, hidden, sum_sq)  # fmt: skip
    return sum_sq


@triton.jit
def gather_row_streamed(
    t, src, owner, residual_out_ptr, abort_ptr, ptrs_ptr, state_ptr, start, timeout, rank, hidden,
    WORLD: tl.constexpr, R_COLS: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """Pass 1 of row t, owned by rank `owner`, whose reduced bits arrive at src (int16, this
    rank's all-gather row): per chunk, wait, clear, store residual_out. Returns the squares of
    residual_out [R_COLS] for pass 2."""
    dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
    sum_sq = tl.zeros([R_COLS], dtype=tl.float32)
    for c0 in range(0, hidden, R_COLS):
        cols = c0 + tl.arange(0, R_COLS)
        in_row = cols < hidden
        ptrs = src + cols[None, :]
        v, bad = _wait_tile(ptrs, in_row[None, :], abort_ptr, start, timeout, EMU)
        if bad != 0:
            _fail(1 << owner, abort_ptr, ptrs_ptr, state_ptr, rank, WORLD)
        tl.store(ptrs, tl.full(ptrs.shape, SENTINEL, tl.int16), mask=in_row[None, :])
        x = tl.sum(v.to(dtype, bitcast=True).to(tl.float32), axis=0)  # [1, RC] -> [RC], exact
        sum_sq = _store_chunk(x, bad, t, cols, in_row, residual_out_ptr, hidden, sum_sq)
    return sum_sq
