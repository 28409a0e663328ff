"""The three stages of the ring two-shot kernel (`symm_ring`): finalize, reduce, gather of one
chunk, each a loop over this program's share of the chunk's items. The finalize of a row segment
and the norm + quant of a row are the building blocks every kernel uses
(`finalize_add.finalize_row`, `add_rmsnorm.norm_quant_row`)."""

from __future__ import annotations

import triton
import triton.language as tl

from .add_rmsnorm import norm_quant_row
from .finalize_add import finalize_row
from .symm_device import SENTINEL, payload_bits
from .symm_ring_device import (
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
def _items(c, n_items, pid, nprog):
    """This program's first item of a stage in chunk c: item i goes to program (c * n + i) % P, so
    the programs that get one item fewer change from chunk to chunk."""
    return (pid + nprog - (c * n_items) % nprog) % nprog


@triton.jit
def _chunk_rows(c, tokens, chunk):
    return tl.minimum(chunk, tokens - c * chunk)


@triton.jit
def _slot_base(ptrs_ptr, q, slot, hidden, chunk, WORLD: tl.constexpr):
    """Rank q's slot `slot`: (its reduce-scatter region, [source][CW][H] rows apart; int16)."""
    cw = tl.cdiv(chunk, WORLD)
    src_stride = cw.to(tl.int64) * hidden
    return _rank_buf(ptrs_ptr, q) + _HEAD_ELEMS + slot * 2 * WORLD * src_stride


@triton.jit
def _stage_finalize(
    c, base, ptrs_ptr, abort_ptr, state_ptr, start, timeout, pid, nprog, gemm2_ptr, perm_ptr,
    weight_ptr, shared_ptr, tokens, hidden, chunk, rank, routed_scaling, dtype: tl.constexpr,
    WORLD: tl.constexpr, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, F_ROWS: tl.constexpr,
    F_COLS: tl.constexpr, EMU: tl.constexpr, EMU_ITEMS: tl.constexpr,
):  # fmt: skip
    """Wait until every rank released the slot this chunk reuses; then rank `rank`'s partial of
    the chunk's rows (one rounding, -0.0 -> +0.0), items (owner, F_ROWS of its rows, column block),
    into each owner's reduce-scatter rows [rank][i]. Never waits for data. Several rows per item:
    their routing loads and gathers are independent, so they are in flight together."""
    seq = base + c
    slot = seq % _SLOTS
    # the chunk that used this slot before (SLOTS chunks ago) is released by every program
    missing = _wait_slot_free(
        ptrs_ptr, slot, (seq // _SLOTS) * _UNIT, abort_ptr, start, timeout, WORLD, EMU
    )
    if missing != 0:
        _fail(missing, abort_ptr, ptrs_ptr, state_ptr, rank, WORLD)
    n_c = _chunk_rows(c, tokens, chunk)
    groups = tl.cdiv(tl.cdiv(n_c, WORLD), F_ROWS)  # row groups per owner (may reach past n_c)
    col_blocks = tl.cdiv(hidden, F_COLS)
    n_items = WORLD * groups * col_blocks
    cw = tl.cdiv(chunk, WORLD)
    row_elems = tl.full([], 0, tl.int64) + hidden
    src_stride = cw.to(tl.int64) * row_elems
    first = _items(c, n_items, pid, nprog)
    for k in range(0, EMU_ITEMS if EMU else n_items, 1 if EMU else nprog):
        i = first + k * nprog if EMU else k + first
        if i < n_items:
            q = i % WORLD  # the owner
            rest = i // WORLD
            ii = (rest % groups) * F_ROWS + tl.arange(0, F_ROWS)[:, None]  # owner rows [F_ROWS, 1]
            j = q + WORLD * ii
            live = j < n_c
            cols = (rest // groups) * F_COLS + tl.arange(0, F_COLS)[None, :] + ii * 0  # 2-D
            # rows past the chunk read the chunk's last row (in bounds) and store nothing
            row = c * chunk + tl.where(live, j, n_c - 1)
            acc = finalize_row(
                gemm2_ptr, perm_ptr, weight_ptr, shared_ptr, row.to(tl.int64), cols, hidden,
                routed_scaling, TOP_K, HAS_SHARED,
            )  # fmt: skip
            dst = _slot_base(ptrs_ptr, q, slot, hidden, chunk, WORLD) + rank * src_stride
            tl.store(
                dst + ii * row_elems + cols, payload_bits(acc, dtype), mask=live & (cols < hidden)
            )


@triton.jit
def _stage_reduce(
    c, base, ptrs_ptr, abort_ptr, state_ptr, start, timeout, pid, nprog,
    residual_ptr, tokens, hidden, chunk, rank, dtype: tl.constexpr, WORLD: tl.constexpr,
    R_ROWS: tl.constexpr, R_COLS: tl.constexpr, EMU: tl.constexpr, EMU_ITEMS: tl.constexpr,
):  # fmt: skip
    """The rows rank `rank` owns in the chunk, in tiles [R_ROWS, R_COLS]: wait for the W partials,
    sum them in rank order in fp32, add the residual, round once (-0.0 -> +0.0), clear the
    partials, push the bits into every rank's all-gather rows [rank][i] (its own included)."""
    slot = (base + c) % _SLOTS
    n_c = _chunk_rows(c, tokens, chunk)
    n_own = tl.where(n_c > rank, (n_c - rank + WORLD - 1) // WORLD, 0)
    groups = tl.cdiv(n_own, R_ROWS)
    n_items = groups * tl.cdiv(hidden, R_COLS)
    cw = tl.cdiv(chunk, WORLD)
    row_elems = tl.full([], 0, tl.int64) + hidden
    src_stride = cw.to(tl.int64) * row_elems
    here = _slot_base(ptrs_ptr, rank, slot, hidden, chunk, WORLD)
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
                _fail(who, abort_ptr, ptrs_ptr, state_ptr, rank, WORLD)
            x = res.to(tl.float32) + s
            x = tl.where((tl.zeros_like(s).to(tl.int32) + bad) != 0, float("nan"), x)
            bits = payload_bits(x, dtype)
            for q in tl.static_range(WORLD):  # read above (the polls' block reductions): clear
                tl.store(
                    here + q * src_stride + tile, tl.full(tile.shape, SENTINEL, tl.int16), mask=mask
                )
            for q in tl.static_range(WORLD):  # every rank's all-gather region, this one's included
                dst = _slot_base(ptrs_ptr, q, slot, hidden, chunk, WORLD)
                tl.store(dst + (WORLD + rank) * src_stride + tile, bits, mask=mask)


@triton.jit
def _stage_gather(
    c, base, ptrs_ptr, abort_ptr, state_ptr, start, timeout, pid, nprog, gamma_ptr, weight_bias,
    residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr, tokens, hidden, chunk, rank, eps, quant_scale,
    sf_cols, WORLD: tl.constexpr, QUANT: tl.constexpr, SWIZZLED: tl.constexpr,
    ROW_BLOCK: tl.constexpr, HW_CVT: tl.constexpr, EMU: tl.constexpr, EMU_ITEMS: tl.constexpr,
):  # fmt: skip
    """Every row of the chunk, whole: wait for its owner's reduced bits, clear them, store them as
    residual_out and norm them (+ FP8 / NVFP4). Every rank runs this code on every row, so the
    outputs are bitwise identical on every rank. Then this program releases the slot."""
    dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
    slot = (base + c) % _SLOTS
    n_c = _chunk_rows(c, tokens, chunk)
    cw = tl.cdiv(chunk, WORLD)
    row_elems = tl.full([], 0, tl.int64) + hidden
    src_stride = cw.to(tl.int64) * row_elems
    ag = _slot_base(ptrs_ptr, rank, slot, hidden, chunk, WORLD)
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
                _fail(1 << owner, abort_ptr, ptrs_ptr, state_ptr, rank, WORLD)
            tl.store(row, tl.full(row.shape, SENTINEL, tl.int16), mask=in_row[None, :])
            x = tl.sum(v.to(dtype, bitcast=True).to(tl.float32), axis=0)  # [1, RB] -> [RB], exact
            x = tl.where((cols * 0 + bad) != 0, float("nan"), x)
            xr = x.to(dtype)  # exact (or NaN)
            t = (c * chunk + j).to(tl.int64)
            tl.store(residual_out_ptr + t * hidden + cols, xr, mask=in_row)
            # gamma reloaded per row (L2-hot): held across the loop it costs registers, programs
            g = tl.load(gamma_ptr + cols, mask=in_row, other=0.0).to(tl.float32) + weight_bias
            norm_quant_row(
                tl.where(in_row, xr.to(tl.float32), 0.0), g, t, 0, ROW_BLOCK, tokens,
                norm_out_ptr, q_ptr, sf_ptr, hidden, eps, quant_scale, sf_cols, QUANT, SWIZZLED,
                ROW_BLOCK, HW_CVT, True,  # overflow-safe, as every norm of ours
            )  # fmt: skip
    _release(ptrs_ptr, rank, slot, pid, nprog)
