"""The three stages of the ring two-shot kernel (`symm_ring`): finalize, reduce, gather of one
chunk, each a loop over this program's share of the chunk's tiles."""

from __future__ import annotations

import triton
import triton.language as tl

from .symm_common import SENTINEL, _gamma_row, _norm_quant_row, _payload_bits
from .symm_ring_protocol import (
    _HEAD_ELEMS,
    _SLOTS,
    _UNIT,
    _fail,
    _rank_buf,
    _release,
    _wait_slot_free,
    _wait_tile,
)


@triton.jit
def _finalize_tile(
    gemm2_ptr,
    perm_ptr,
    weight_ptr,
    shared_ptr,
    t,
    ok,
    cols,
    hidden,
    routed_scaling,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
):
    """fp32 [R, B]: routed_scaling * sum_k w * gemm2_out[perm] (+ shared) for rows t [R] (int64);
    slots with perm == -1 are never read and their weight never used."""
    in_row = cols[None, :] < hidden
    acc = tl.zeros([t.shape[0], cols.shape[0]], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        src = tl.load(perm_ptr + t * TOP_K + k, mask=ok, other=-1).to(tl.int64)
        w = tl.load(weight_ptr + t * TOP_K + k, mask=ok, other=0.0).to(tl.float32)
        valid = (src >= 0)[:, None]
        x = tl.load(
            gemm2_ptr + src[:, None] * hidden + cols[None, :], mask=valid & in_row, other=0.0
        ).to(tl.float32)
        acc += tl.where(valid, x * w[:, None], 0.0)
    acc = acc * routed_scaling
    if HAS_SHARED:
        acc += tl.load(
            shared_ptr + t[:, None] * hidden + cols[None, :], mask=ok[:, None] & in_row, other=0.0
        ).to(tl.float32)
    return acc


@triton.jit
def _items(c, n_items, pid, nprog):
    """This program's first item of a stage in chunk c: item i goes to program (c * n + i) % P, so
    the programs that get one item fewer change from chunk to chunk."""
    return (pid + nprog - (c * n_items) % nprog) % nprog


@triton.jit
def _chunk_rows(c, tokens, chunk):
    return tl.minimum(chunk, tokens - c * chunk)


@triton.jit
def _slot_base(ptrs_ptr, bufs_ptr, buf_elems, q, slot, hidden, chunk, WORLD: tl.constexpr, EMU):
    """Rank q's slot `slot`: (its reduce-scatter region, [source][CW][H] rows apart; int16)."""
    cw = tl.cdiv(chunk, WORLD)
    src_stride = cw.to(tl.int64) * hidden
    return (
        _rank_buf(ptrs_ptr, bufs_ptr, buf_elems, q, EMU)
        + _HEAD_ELEMS
        + slot * 2 * WORLD * src_stride
    )


@triton.jit
def _stage_finalize(
    c, base, ptrs_ptr, bufs_ptr, buf_elems, emu_freed_ptr, abort_ptr, state_ptr, start, timeout,
    pid, nprog, gemm2_ptr, perm_ptr, weight_ptr, shared_ptr, tokens, hidden, chunk, rank,
    routed_scaling, dtype: tl.constexpr, WORLD: tl.constexpr, TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr, F_ROWS: tl.constexpr, F_COLS: tl.constexpr, EMU: tl.constexpr,
    EMU_ITEMS: tl.constexpr,
):  # fmt: skip
    seq = base + c
    slot = seq % _SLOTS
    # the chunk that used this slot before (SLOTS chunks ago) is released by every program
    missing = _wait_slot_free(
        ptrs_ptr, emu_freed_ptr, slot, (seq // _SLOTS) * _UNIT, abort_ptr, start, timeout, WORLD,
        EMU,
    )  # fmt: skip
    if missing != 0:
        _fail(missing, abort_ptr, ptrs_ptr, state_ptr, rank, WORLD, EMU)
    n_c = _chunk_rows(c, tokens, chunk)
    groups = tl.cdiv(tl.cdiv(n_c, WORLD), F_ROWS)
    col_blocks = tl.cdiv(hidden, F_COLS)
    n_items = WORLD * groups * col_blocks
    cw = tl.cdiv(chunk, WORLD)
    row_elems = tl.full([], 0, tl.int64) + hidden
    src_stride = cw.to(tl.int64) * row_elems
    first = _items(c, n_items, pid, nprog)
    for k in range(0, EMU_ITEMS if EMU else n_items, 1 if EMU else nprog):
        i = first + k * nprog if EMU else k + first
        if i < n_items:
            q = i % WORLD  # the owner: the tile's rows all go to one rank
            rest = i // WORLD
            grp = rest % groups
            cb = rest // groups
            ii = grp * F_ROWS + tl.arange(0, F_ROWS)
            j = q + WORLD * ii
            ok = j < n_c
            t = (c * chunk + j).to(tl.int64)
            cols = cb * F_COLS + tl.arange(0, F_COLS)
            acc = _finalize_tile(
                gemm2_ptr, perm_ptr, weight_ptr, shared_ptr, t, ok, cols, hidden, routed_scaling,
                TOP_K, HAS_SHARED,
            )  # fmt: skip
            dst = _slot_base(ptrs_ptr, bufs_ptr, buf_elems, q, slot, hidden, chunk, WORLD, EMU)
            dst += rank * src_stride
            tl.store(
                dst + ii[:, None] * row_elems + cols[None, :],
                _payload_bits(acc, dtype),
                mask=ok[:, None] & (cols[None, :] < hidden),
            )


@triton.jit
def _stage_reduce(
    c, base, ptrs_ptr, bufs_ptr, buf_elems, abort_ptr, state_ptr, start, timeout, pid, nprog,
    residual_ptr, tokens, hidden, chunk, rank, dtype: tl.constexpr, WORLD: tl.constexpr,
    R_ROWS: tl.constexpr, R_COLS: tl.constexpr, EMU: tl.constexpr, EMU_ITEMS: tl.constexpr,
):  # fmt: skip
    slot = (base + c) % _SLOTS
    n_c = _chunk_rows(c, tokens, chunk)
    n_own = tl.where(n_c > rank, (n_c - rank + WORLD - 1) // WORLD, 0)
    groups = tl.cdiv(n_own, R_ROWS)
    n_items = groups * tl.cdiv(hidden, R_COLS)
    cw = tl.cdiv(chunk, WORLD)
    row_elems = tl.full([], 0, tl.int64) + hidden
    src_stride = cw.to(tl.int64) * row_elems
    here = _slot_base(ptrs_ptr, bufs_ptr, buf_elems, rank, slot, hidden, chunk, WORLD, EMU)
    first = _items(c, n_items, pid, nprog)
    for k in range(0, EMU_ITEMS if EMU else n_items, 1 if EMU else nprog):
        i = first + k * nprog if EMU else k + first
        if i < n_items:
            grp = i % groups
            cb = i // groups
            ii = grp * R_ROWS + tl.arange(0, R_ROWS)
            ok = ii < n_own
            t = (c * chunk + rank + WORLD * ii).to(tl.int64)
            cols = cb * R_COLS + tl.arange(0, R_COLS)
            mask = ok[:, None] & (cols[None, :] < hidden)
            res = tl.load(
                residual_ptr + t[:, None] * row_elems + cols[None, :], mask=mask, other=0.0
            )
            tile = ii[:, None] * row_elems + cols[None, :]
            s = tl.zeros([R_ROWS, R_COLS], dtype=tl.float32)
            bad = 0
            who = 0
            for q in tl.static_range(WORLD):  # rank order
                v, b = _wait_tile(
                    here + q * src_stride + tile, mask, abort_ptr, start, timeout, EMU
                )
                s += v.to(dtype, bitcast=True).to(tl.float32)
                bad = bad | b
                who = who | (b << q)
            if bad != 0:
                _fail(who, abort_ptr, ptrs_ptr, state_ptr, rank, WORLD, EMU)
            x = res.to(tl.float32) + s
            x = tl.where((tl.zeros_like(s).to(tl.int32) + bad) != 0, float("nan"), x)
            bits = _payload_bits(x, dtype)
            for q in tl.static_range(WORLD):  # read above (the polls' block reductions): clear
                tl.store(
                    here + q * src_stride + tile, tl.full(tile.shape, SENTINEL, tl.int16), mask=mask
                )
            for q in tl.static_range(WORLD):  # every rank's all-gather region, this one's included
                dst = _slot_base(ptrs_ptr, bufs_ptr, buf_elems, q, slot, hidden, chunk, WORLD, EMU)
                tl.store(dst + (WORLD + rank) * src_stride + tile, bits, mask=mask)


@triton.jit
def _stage_gather(
    c, base, ptrs_ptr, bufs_ptr, buf_elems, emu_freed_ptr, abort_ptr, state_ptr, start, timeout,
    pid, nprog, gamma_ptr, weight_bias, residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr, tokens,
    hidden, chunk, rank, eps, quant_scale, sf_cols, WORLD: tl.constexpr, QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    ROW_BLOCK: tl.constexpr, HW_CVT: tl.constexpr, EMU: tl.constexpr, EMU_ITEMS: tl.constexpr,
):  # fmt: skip
    dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
    slot = (base + c) % _SLOTS
    n_c = _chunk_rows(c, tokens, chunk)
    cw = tl.cdiv(chunk, WORLD)
    row_elems = tl.full([], 0, tl.int64) + hidden
    src_stride = cw.to(tl.int64) * row_elems
    ag = _slot_base(ptrs_ptr, bufs_ptr, buf_elems, rank, slot, hidden, chunk, WORLD, EMU)
    ag += WORLD * src_stride
    cols = tl.arange(0, ROW_BLOCK)
    in_row = cols < hidden
    first = _items(c, n_c, pid, nprog)
    for k in range(0, EMU_ITEMS if EMU else n_c, 1 if EMU else nprog):
        j = first + k * nprog if EMU else k + first
        if j < n_c:
            owner = j % WORLD
            row = ag + owner * src_stride + (j // WORLD) * row_elems + cols[None, :]
            v, bad = _wait_tile(row, in_row[None, :], abort_ptr, start, timeout, EMU)
            if bad != 0:
                _fail(1 << owner, abort_ptr, ptrs_ptr, state_ptr, rank, WORLD, EMU)
            tl.store(row, tl.full(row.shape, SENTINEL, tl.int16), mask=in_row[None, :])
            x = tl.sum(v.to(dtype, bitcast=True).to(tl.float32), axis=0)  # [1, RB] -> [RB], exact
            x = tl.where((cols * 0 + bad) != 0, float("nan"), x)
            xr = x.to(dtype)  # exact (or NaN)
            t = (c * chunk + j).to(tl.int64)
            tl.store(residual_out_ptr + t * hidden + cols, xr, mask=in_row)
            g = _gamma_row(gamma_ptr, hidden, weight_bias, ROW_BLOCK)  # L2-hot; fewer registers
            _norm_quant_row(
                tl.where(in_row, xr.to(tl.float32), 0.0), g, t, 0, ROW_BLOCK, norm_out_ptr, q_ptr,
                sf_ptr, hidden, eps, quant_scale, sf_cols, QUANT, SWIZZLED, ROW_BLOCK, HW_CVT,
            )  # fmt: skip
    _release(ptrs_ptr, emu_freed_ptr, rank, slot, pid, nprog, EMU)
