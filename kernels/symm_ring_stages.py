"""The three stages of the ring two-shot kernel (`symm_ring`): finalize, reduce, gather of one
chunk, each a loop over this program's share of the chunk's items. The finalize of a row segment
and the norm + quant of a row are the building blocks every kernel uses
(`finalize_add.finalize_routed`, `add_rmsnorm.norm_quant_row`)."""

from __future__ import annotations

import triton
import triton.language as tl

from .add_rmsnorm import norm_quant_row
from .finalize_add import finalize_routed, finalize_row
from .symm_device import SENTINEL, payload_bits
from .symm_ring_rows import gather_row_streamed, reduce_row_streamed, row_norm_streamed
from .symm_ring_device import (
    _SLOTS,
    _UNIT,
    _fail,
    _release,
    _slot_base,
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
def _f_item(i, n_items, c, n_c, groups, chunk, perm_ptr, weight_ptr, WORLD: tl.constexpr,
            TOP_K: tl.constexpr, F_ROWS: tl.constexpr):  # fmt: skip
    """Finalize item i (clamped into range): (owner, owner rows [F_ROWS, 1], live rows, token rows
    [F_ROWS, 1] int64, column block, routing src int64 / weights fp32 [F_ROWS, KP])."""
    q, ii, live, row, cb = _f_place(i, n_items, c, n_c, groups, chunk, WORLD, F_ROWS)
    kk = tl.arange(0, triton.next_power_of_2(TOP_K))[None, :]
    src = tl.load(perm_ptr + row * TOP_K + kk, mask=kk < TOP_K, other=-1).to(tl.int64)
    w = tl.load(weight_ptr + row * TOP_K + kk, mask=kk < TOP_K, other=0.0).to(tl.float32)
    return q, ii, live, row, cb, src, w


@triton.jit
def _f_place(i, n_items, c, n_c, groups, chunk, WORLD: tl.constexpr, F_ROWS: tl.constexpr):
    """Finalize item i (clamped into range): (owner, owner rows [F_ROWS, 1], live rows, token rows
    [F_ROWS, 1] int64, column block)."""
    i = tl.minimum(i, n_items - 1)
    q = i % WORLD  # the owner
    rest = i // WORLD
    ii = (rest % groups) * F_ROWS + tl.arange(0, F_ROWS)[:, None]  # owner rows [F_ROWS, 1]
    j = q + WORLD * ii
    live = j < n_c
    # rows past the chunk read the chunk's last row (in bounds) and store nothing
    row = (c * chunk + tl.where(live, j, n_c - 1)).to(tl.int64)
    return q, ii, live, row, rest // groups


@triton.jit
def _stage_finalize(
    c, base, ptrs_ptr, abort_ptr, state_ptr, start, timeout, pid, nprog, gemm2_ptr, perm_ptr,
    weight_ptr, shared_ptr, tokens, hidden, chunk, rank, routed_scaling, dtype: tl.constexpr,
    WORLD: tl.constexpr, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, F_ROWS: tl.constexpr,
    F_COLS: tl.constexpr, EMU: tl.constexpr, EMU_ITEMS: tl.constexpr,
    F_PREFETCH: tl.constexpr = True, SLOT_WAIT: tl.constexpr = True, region=0,
):  # fmt: skip
    """Wait until every rank released the slot this chunk reuses; then rank `rank`'s partial of
    the chunk's rows (one rounding, -0.0 -> +0.0), items (owner, F_ROWS of its rows, column block),
    into each owner's reduce-scatter rows [rank][i]. Never waits for data. The next item's routing
    is loaded before this item's gathers: one memory latency per item, not two (measured on the
    H200, H=7168, T=4096, world size 1: 322 us against 347 us without it, at one program per SM).
    F_PREFETCH False: the routing is loaded in the item, as our standalone finalize does (the
    prefetched [F_ROWS, K] tiles and their per-k extraction cost registers; with several programs
    per SM the latency is hidden by the others). SLOT_WAIT False: the caller has already waited
    for the slot (`symm_staged`'s sync launch), so this program makes no system-scope access.
    region: int16 elements between the header and slot 0 (`symm_staged`'s own slots)."""
    seq = base + c
    slot = seq % _SLOTS
    n_c = _chunk_rows(c, tokens, chunk)
    groups = tl.cdiv(tl.cdiv(n_c, WORLD), F_ROWS)  # row groups per owner (may reach past n_c)
    n_items = WORLD * groups * tl.cdiv(hidden, F_COLS)
    first = _items(c, n_items, pid, nprog)
    if F_PREFETCH:
        nxt = _f_item(
            first, n_items, c, n_c, groups, chunk, perm_ptr, weight_ptr, WORLD, TOP_K, F_ROWS
        )
    if SLOT_WAIT:
        # the chunk that used this slot before (SLOTS chunks ago) is released by every program
        missing = _wait_slot_free(
            ptrs_ptr, slot, (seq // _SLOTS) * _UNIT, abort_ptr, start, timeout, WORLD, EMU
        )
        if missing != 0:
            _fail(missing, abort_ptr, ptrs_ptr, state_ptr, rank, WORLD)
    cw = tl.cdiv(chunk, WORLD)
    row_elems = tl.full([], 0, tl.int64) + hidden
    src_stride = cw.to(tl.int64) * row_elems
    for k in range(0, EMU_ITEMS if EMU else n_items, 1 if EMU else nprog):
        i = first + k * nprog if EMU else k + first
        if F_PREFETCH:
            q, ii, live, row, cb, src, w = nxt
            nxt = _f_item(
                i + nprog, n_items, c, n_c, groups, chunk, perm_ptr, weight_ptr, WORLD, TOP_K,
                F_ROWS,
            )  # fmt: skip
        else:
            q, ii, live, row, cb = _f_place(i, n_items, c, n_c, groups, chunk, WORLD, F_ROWS)
        if i < n_items:
            cols = cb * F_COLS + tl.arange(0, F_COLS)[None, :] + ii * 0  # [F_ROWS, F_COLS]
            if F_PREFETCH:
                acc = finalize_routed(
                    gemm2_ptr, src, w, shared_ptr, row, cols, hidden, routed_scaling, TOP_K,
                    HAS_SHARED,
                )  # fmt: skip
            else:  # the same sum in the same order
                acc = finalize_row(
                    gemm2_ptr, perm_ptr, weight_ptr, shared_ptr, row, cols, hidden,
                    routed_scaling, TOP_K, HAS_SHARED,
                )  # fmt: skip
            dst = _slot_base(ptrs_ptr, q, slot, hidden, chunk, WORLD) + region + rank * src_stride
            tl.store(
                dst + ii * row_elems + cols, payload_bits(acc, dtype), mask=live & (cols < hidden)
            )


@triton.jit
def _row_outputs(
    x, bad, t, cols, in_row, gamma_ptr, weight_bias, residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr,
    tokens, hidden, eps, quant_scale, sf_cols, QUANT: tl.constexpr, SWIZZLED: tl.constexpr,
    ROW_BLOCK: tl.constexpr, HW_CVT: tl.constexpr,
):  # fmt: skip
    """Row t's outputs from its residual_out value x (fp32, exact in the activation dtype; NaN
    where a wait failed): residual_out, norm_out and its FP8 / NVFP4 codes."""
    x = tl.where((cols * 0 + bad) != 0, float("nan"), x)
    xr = x.to(residual_out_ptr.dtype.element_ty)  # exact (or NaN)
    tl.store(residual_out_ptr + t * hidden + cols, xr, mask=in_row)
    # gamma reloaded per row (L2-hot): held across the loop it costs registers
    g = tl.load(gamma_ptr + cols, mask=in_row, other=0.0).to(tl.float32) + weight_bias
    norm_quant_row(
        tl.where(in_row, xr.to(tl.float32), 0.0), g, t, 0, ROW_BLOCK, tokens, norm_out_ptr, q_ptr,
        sf_ptr, hidden, eps, quant_scale, sf_cols, QUANT, SWIZZLED, ROW_BLOCK, HW_CVT,
        True,  # overflow-safe, as every norm of ours
    )  # fmt: skip


@triton.jit
def _stage_reduce(
    c, base, ptrs_ptr, abort_ptr, state_ptr, start, timeout, pid, nprog, residual_ptr, gamma_ptr,
    weight_bias, residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr, tokens, hidden, chunk, rank, eps,
    quant_scale, sf_cols, WORLD: tl.constexpr, QUANT: tl.constexpr, SWIZZLED: tl.constexpr,
    ROW_BLOCK: tl.constexpr, HW_CVT: tl.constexpr, EMU: tl.constexpr, EMU_ITEMS: tl.constexpr,
    R_COLS: tl.constexpr = 0,
):  # fmt: skip
    """The rows rank `rank` owns in the chunk (whole, or in chunks of R_COLS columns:
    `symm_ring_rows`): wait for the W partials, sum them in rank order in fp32, add the
    residual, round once (-0.0 -> +0.0), clear the partials, push the bits into every other
    rank's all-gather rows [rank][i], and (the owner needs no copy of its own) store this rank's
    outputs of the row right here."""
    dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
    slot = (base + c) % _SLOTS
    n_c = _chunk_rows(c, tokens, chunk)
    n_own = tl.where(n_c > rank, (n_c - rank + WORLD - 1) // WORLD, 0)
    cw = tl.cdiv(chunk, WORLD)
    row_elems = tl.full([], 0, tl.int64) + hidden
    src_stride = cw.to(tl.int64) * row_elems
    here = _slot_base(ptrs_ptr, rank, slot, hidden, chunk, WORLD)
    cols = tl.arange(0, ROW_BLOCK)
    in_row = cols < hidden
    first = _items(c, n_own, pid, nprog)
    for k in range(0, EMU_ITEMS if EMU else n_own, 1 if EMU else nprog):
        ii = first + k * nprog if EMU else k + first
        if ii < n_own:
            t = (c * chunk + rank + WORLD * ii).to(tl.int64)
            if R_COLS != 0:
                sum_sq = reduce_row_streamed(
                    t, ii, here, src_stride, slot, chunk, residual_ptr, residual_out_ptr,
                    abort_ptr, ptrs_ptr, state_ptr, start, timeout, rank, hidden, WORLD, R_COLS,
                    EMU,
                )  # fmt: skip
                row_norm_streamed(
                    t, sum_sq, gamma_ptr, weight_bias, residual_out_ptr, norm_out_ptr, q_ptr,
                    sf_ptr, tokens, hidden, eps, quant_scale, sf_cols, QUANT, SWIZZLED, R_COLS,
                    HW_CVT,
                )  # fmt: skip
            else:
                res = tl.load(residual_ptr + t * row_elems + cols, mask=in_row, other=0.0)
                row = ii * row_elems + cols[None, :]
                s = tl.zeros([ROW_BLOCK], dtype=tl.float32)
                bad = 0
                who = 0
                for q in range(WORLD):  # rank order (a loop, not unrolled: fewer live pointers)
                    v, b = _wait_tile(here + q * src_stride + row, in_row[None, :], abort_ptr,
                                      start, timeout, EMU)  # fmt: skip
                    s += tl.sum(v.to(dtype, bitcast=True).to(tl.float32), axis=0)  # [1, RB]: exact
                    bad = bad | b
                    who = who | (b << q)
                if bad != 0:
                    _fail(who, abort_ptr, ptrs_ptr, state_ptr, rank, WORLD)
                x = res.to(tl.float32) + s
                x = tl.where((cols * 0 + bad) != 0, float("nan"), x)
                bits = payload_bits(x, dtype)
                for q in range(WORLD):  # read above (the polls' block reductions): clear
                    tl.store(here + q * src_stride + row, tl.full(row.shape, SENTINEL, tl.int16),
                             mask=in_row[None, :])  # fmt: skip
                for q in range(WORLD):  # every other rank's all-gather region
                    if q != rank:
                        dst = _slot_base(ptrs_ptr, q, slot, hidden, chunk, WORLD)
                        tl.store(dst + (WORLD + rank) * src_stride + ii * row_elems + cols, bits,
                                 mask=in_row)  # fmt: skip
                _row_outputs(
                    bits.to(dtype, bitcast=True).to(tl.float32), bad, t, cols, in_row, gamma_ptr,
                    weight_bias, residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr, tokens, hidden, eps,
                    quant_scale, sf_cols, QUANT, SWIZZLED, ROW_BLOCK, HW_CVT,
                )  # fmt: skip


@triton.jit
def _stage_gather(
    c, base, ptrs_ptr, abort_ptr, state_ptr, start, timeout, pid, nprog, gamma_ptr, weight_bias,
    residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr, tokens, hidden, chunk, rank, eps, quant_scale,
    sf_cols, WORLD: tl.constexpr, QUANT: tl.constexpr, SWIZZLED: tl.constexpr,
    ROW_BLOCK: tl.constexpr, HW_CVT: tl.constexpr, EMU: tl.constexpr, EMU_ITEMS: tl.constexpr,
    R_COLS: tl.constexpr = 0,
):  # fmt: skip
    """The chunk's rows other ranks own (whole, or in chunks of R_COLS columns): wait for the
    owner's reduced bits, clear them, store them as residual_out and norm them (+ FP8 / NVFP4),
    with the code the owner ran on its own rows, so every output is bitwise identical on every
    rank. Then this program releases the slot."""
    dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
    slot = (base + c) % _SLOTS
    n_c = _chunk_rows(c, tokens, chunk)
    n_other = n_c - tl.where(n_c > rank, (n_c - rank + WORLD - 1) // WORLD, 0)
    cw = tl.cdiv(chunk, WORLD)
    row_elems = tl.full([], 0, tl.int64) + hidden
    src_stride = cw.to(tl.int64) * row_elems
    ag = _slot_base(ptrs_ptr, rank, slot, hidden, chunk, WORLD)
    ag += WORLD * src_stride
    cols = tl.arange(0, ROW_BLOCK)
    in_row = cols < hidden
    first = _items(c, n_other, pid, nprog)
    for k in range(0, EMU_ITEMS if EMU else n_other, 1 if EMU else nprog):
        m = first + k * nprog if EMU else k + first
        if m < n_other:
            # the m-th row of the chunk that another rank owns: rows come in groups of W, and
            # in each group the W - 1 rows of the other ranks, this rank's own row skipped
            per: tl.constexpr = WORLD - 1 + (WORLD == 1)
            p = m % per
            j = (m // per) * WORLD + p + (p >= rank).to(tl.int32)
            owner = j % WORLD
            if R_COLS != 0:
                t = (c * chunk + j).to(tl.int64)
                src = ag + owner * src_stride + (j // WORLD) * row_elems
                sum_sq = gather_row_streamed(
                    t, src, owner, residual_out_ptr, abort_ptr, ptrs_ptr, state_ptr, start,
                    timeout, rank, hidden, WORLD, R_COLS, EMU,
                )  # fmt: skip
                row_norm_streamed(
                    t, sum_sq, gamma_ptr, weight_bias, residual_out_ptr, norm_out_ptr, q_ptr,
                    sf_ptr, tokens, hidden, eps, quant_scale, sf_cols, QUANT, SWIZZLED, R_COLS,
                    HW_CVT,
                )  # fmt: skip
            else:
                row = ag + owner * src_stride + (j // WORLD) * row_elems + cols[None, :]
                v, bad = _wait_tile(row, in_row[None, :], abort_ptr, start, timeout, EMU)
                if bad != 0:
                    _fail(1 << owner, abort_ptr, ptrs_ptr, state_ptr, rank, WORLD)
                tl.store(row, tl.full(row.shape, SENTINEL, tl.int16), mask=in_row[None, :])
                x = tl.sum(
                    v.to(dtype, bitcast=True).to(tl.float32), axis=0
                )  # [1, RB] -> [RB], exact
                _row_outputs(
                    x, bad, (c * chunk + j).to(tl.int64), cols, in_row, gamma_ptr, weight_bias,
                    residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr, tokens, hidden, eps, quant_scale,
                    sf_cols, QUANT, SWIZZLED, ROW_BLOCK, HW_CVT,
                )  # fmt: skip
    _release(ptrs_ptr, rank, slot, pid, nprog)
