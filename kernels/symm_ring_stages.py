"""The three stages of the ring two-shot kernel (`symm_ring`), each a loop over small tiles so that
the whole kernel needs few registers and many programs fit on an SM (the stages are latency chains:
routing -> gathers -> store; poll -> sum -> push; poll -> norm -> store, so what sets the bandwidth
is how many chains are in flight per SM). The finalize and reduce loops load the next tile's routing
/ residual before they work on the current one.

Tiles always hold rows of ONE owner (local chunk rows j = q + W * i, i in a group), so their slot
rows are contiguous and their peer pointer is a scalar.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .quant import _e2m1_codes, _e4m3_rne_satfinite
from .symm_common import SENTINEL, _payload_bits, _round
from .symm_ring_protocol import fail, slot_base, wait_tile


@triton.jit
def _items(c, n_items, pid, nprog):
    """(this program's first item, its item count) of a stage with n_items in chunk c: item i goes
    to program (c * n + i) % P, so the programs that get one item fewer change from chunk to
    chunk."""
    first = (pid + nprog - (c * n_items) % nprog) % nprog
    return first, (n_items - first + nprog - 1) // nprog


@triton.jit
def _routing(perm_ptr, weight_ptr, t, ok, TOP_K: tl.constexpr, KP: tl.constexpr):
    """([R, KP] int64 rows (-1: skip), [R, KP] fp32 weights) of rows t; one load each."""
    k = tl.arange(0, KP)[None, :]
    m = ok[:, None] & (k < TOP_K)
    src = tl.load(perm_ptr + t[:, None] * TOP_K + k, mask=m, other=-1).to(tl.int64)
    w = tl.load(weight_ptr + t[:, None] * TOP_K + k, mask=m, other=0.0).to(tl.float32)
    return src, w


@triton.jit
def _finalize_tile(
    gemm2_ptr, src, w, shared_ptr, t, ok, cols, hidden, routed_scaling, TOP_K: tl.constexpr,
    KP: tl.constexpr, HAS_SHARED: tl.constexpr,
):  # fmt: skip
    """fp32 [R, B]: routed_scaling * sum_k w * gemm2_out[src] (+ shared); slots with src == -1 are
    never read and their weight never used (it may be garbage)."""
    in_row = cols[None, :] < hidden
    kk = tl.arange(0, KP)[None, :]
    acc = tl.zeros([t.shape[0], cols.shape[0]], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        s_k = tl.sum(tl.where(kk == k, src, 0), axis=1)
        w_k = tl.sum(tl.where(kk == k, w, 0.0), axis=1)
        valid = (s_k >= 0)[:, None]
        x = tl.load(
            gemm2_ptr + s_k[:, None] * hidden + cols[None, :], mask=valid & in_row, other=0.0
        )
        acc += tl.where(valid, x.to(tl.float32) * w_k[:, None], 0.0)
    acc = acc * routed_scaling
    if HAS_SHARED:
        acc += tl.load(
            shared_ptr + t[:, None] * hidden + cols[None, :], mask=ok[:, None] & in_row, other=0.0
        ).to(tl.float32)
    return acc


@triton.jit
def _owner_tile(i, n_c, c, chunk, groups, ROWS: tl.constexpr, WORLD: tl.constexpr):
    """Item i of a stage whose items are (owner, group of ROWS owner rows, column block), owner
    fastest: (owner q, owner rows ii [ROWS], valid [ROWS], token rows t [ROWS] int64, col block)."""
    q = i % WORLD
    rest = i // WORLD
    ii = (rest % groups) * ROWS + tl.arange(0, ROWS)
    j = q + WORLD * ii
    return q, ii, j < n_c, (c * chunk + j).to(tl.int64), rest // groups


@triton.jit
def stage_finalize(
    c, n_c, chunk, pid, nprog, rank, hidden, slot, ptrs_ptr, bufs_ptr, buf_elems, gemm2_ptr,
    perm_ptr, weight_ptr, shared_ptr, routed_scaling, dtype: tl.constexpr, WORLD: tl.constexpr,
    TOP_K: tl.constexpr, KP: tl.constexpr, HAS_SHARED: tl.constexpr, F_ROWS: tl.constexpr,
    F_COLS: tl.constexpr, EMU: tl.constexpr, EMU_ITEMS: tl.constexpr,
):  # fmt: skip
    """Rank `rank`'s partial of chunk c's rows (one rounding, -0.0 -> +0.0), into each owner's
    reduce-scatter rows [rank][i] of `slot`. Never waits."""
    groups = tl.cdiv(tl.cdiv(n_c, WORLD), F_ROWS)
    n_items = WORLD * groups * tl.cdiv(hidden, F_COLS)
    first, mine = _items(c, n_items, pid, nprog)
    row_elems = tl.full([], 0, tl.int64) + hidden
    _, _, ok_n, t_n, _ = _owner_tile(first, n_c, c, chunk, groups, F_ROWS, WORLD)
    src_n, w_n = _routing(perm_ptr, weight_ptr, t_n, ok_n & (mine > 0), TOP_K, KP)
    for k in range(0, EMU_ITEMS if EMU else mine):
        if k < mine:
            i = first + k * nprog
            q, ii, ok, t, cb = _owner_tile(i, n_c, c, chunk, groups, F_ROWS, WORLD)
            src, w = src_n, w_n
            _, _, ok_n, t_n, _ = _owner_tile(i + nprog, n_c, c, chunk, groups, F_ROWS, WORLD)
            src_n, w_n = _routing(perm_ptr, weight_ptr, t_n, ok_n & (k + 1 < mine), TOP_K, KP)
            cols = cb * F_COLS + tl.arange(0, F_COLS)
            acc = _finalize_tile(
                gemm2_ptr, src, w, shared_ptr, t, ok, cols, hidden, routed_scaling, TOP_K, KP,
                HAS_SHARED,
            )  # fmt: skip
            dst = slot_base(ptrs_ptr, bufs_ptr, buf_elems, q, slot, hidden, chunk, WORLD, EMU)
            dst += rank * (tl.cdiv(chunk, WORLD).to(tl.int64) * row_elems)
            tl.store(
                dst + ii[:, None] * row_elems + cols[None, :],
                _payload_bits(acc, dtype),
                mask=ok[:, None] & (cols[None, :] < hidden),
            )


@triton.jit
def stage_reduce(
    c, n_c, chunk, pid, nprog, rank, hidden, slot, ptrs_ptr, bufs_ptr, buf_elems, abort_ptr,
    state_ptr, start, timeout, residual_ptr, dtype: tl.constexpr, WORLD: tl.constexpr,
    R_ROWS: tl.constexpr, R_COLS: tl.constexpr, EMU: tl.constexpr, EMU_ITEMS: tl.constexpr,
):  # fmt: skip
    """The rows rank `rank` owns in chunk c: wait for the W partials, sum them in rank order in
    fp32, add the residual, round once (-0.0 -> +0.0), clear the partials, push the bits into every
    rank's all-gather rows [rank][i] (this rank's own included)."""
    n_own = tl.where(n_c > rank, (n_c - rank + WORLD - 1) // WORLD, 0)
    groups = tl.maximum(tl.cdiv(n_own, R_ROWS), 1)  # >= 1 for the index math; no items if 0 own
    n_items = tl.where(n_own > 0, groups * tl.cdiv(hidden, R_COLS), 0)
    first, mine = _items(c, n_items, pid, nprog)
    row_elems = tl.full([], 0, tl.int64) + hidden
    src_stride = tl.cdiv(chunk, WORLD).to(tl.int64) * row_elems
    here = slot_base(ptrs_ptr, bufs_ptr, buf_elems, rank, slot, hidden, chunk, WORLD, EMU)
    ii_n = (first % groups) * R_ROWS + tl.arange(0, R_ROWS)
    cols_n = (first // groups) * R_COLS + tl.arange(0, R_COLS)
    t_n = (c * chunk + rank + WORLD * ii_n).to(tl.int64)
    m_n = ((ii_n < n_own) & (mine > 0))[:, None] & (cols_n[None, :] < hidden)
    res_n = tl.load(residual_ptr + t_n[:, None] * row_elems + cols_n[None, :], mask=m_n, other=0.0)
    for k in range(0, EMU_ITEMS if EMU else mine):
        if k < mine:
            i = first + k * nprog
            ii = (i % groups) * R_ROWS + tl.arange(0, R_ROWS)
            cols = (i // groups) * R_COLS + tl.arange(0, R_COLS)
            mask = (ii < n_own)[:, None] & (cols[None, :] < hidden)
            res = res_n
            nx = i + nprog  # the next tile's residual, loaded before this tile's waits
            ii_n = (nx % groups) * R_ROWS + tl.arange(0, R_ROWS)
            cols_n = (nx // groups) * R_COLS + tl.arange(0, R_COLS)
            t_n = (c * chunk + rank + WORLD * ii_n).to(tl.int64)
            m_n = ((ii_n < n_own) & (k + 1 < mine))[:, None] & (cols_n[None, :] < hidden)
            res_n = tl.load(
                residual_ptr + t_n[:, None] * row_elems + cols_n[None, :], mask=m_n, other=0.0
            )
            tile = ii[:, None] * row_elems + cols[None, :]
            s = tl.zeros([R_ROWS, R_COLS], dtype=tl.float32)
            bad = 0
            who = 0
            for q in tl.static_range(WORLD):  # rank order
                v, b = wait_tile(here + q * src_stride + tile, mask, abort_ptr, start, timeout, EMU)
                s += v.to(dtype, bitcast=True).to(tl.float32)
                bad = bad | b
                who = who | (b << q)
            if bad != 0:
                fail(who, abort_ptr, ptrs_ptr, state_ptr, rank, WORLD, EMU)
            x = res.to(tl.float32) + s
            x = tl.where((tl.zeros_like(s).to(tl.int32) + bad) != 0, float("nan"), x)
            bits = _payload_bits(x, dtype)
            for q in tl.static_range(WORLD):  # read (the polls' block reductions): clear
                tl.store(
                    here + q * src_stride + tile, tl.full(tile.shape, SENTINEL, tl.int16), mask=mask
                )
            for q in tl.static_range(WORLD):
                dst = slot_base(ptrs_ptr, bufs_ptr, buf_elems, q, slot, hidden, chunk, WORLD, EMU)
                tl.store(dst + (WORLD + rank) * src_stride + tile, bits, mask=mask)


@triton.jit
def _quant_tile(
    y, t, ok, cols, hidden, q_ptr, sf_ptr, quant_scale, sf_cols, QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr, HW_CVT: tl.constexpr,
):  # fmt: skip
    """FP8 / NVFP4 codes of a [R, B] tile of norm_out (y: its rounded values as fp32, 0 outside the
    row), rows t, columns `cols` (a block of B, a multiple of 64, starting at a multiple of B):
    quant.quantize_row's math on a tile; scale columns past H/16 (swizzled padding) get 0."""
    rows = t[:, None]
    if QUANT == 1:
        v = tl.math.div_rn(y, quant_scale)
        if HW_CVT:
            code = tl.minimum(tl.maximum(v, -448.0), 448.0).to(tl.float8e4nv)
            code = code.to(tl.uint8, bitcast=True)
        else:
            code, _ = _e4m3_rne_satfinite(v)
        tl.store(
            q_ptr + rows * hidden + cols[None, :],
            code.to(tl.uint8),
            mask=ok[:, None] & (cols[None, :] < hidden),
        )
    if QUANT == 2:
        R: tl.constexpr = y.shape[0]
        B: tl.constexpr = y.shape[1]
        yb = tl.reshape(y, [R, B // 16, 16])
        amax = tl.max(tl.abs(yb), axis=2)
        sf_code, sf = _e4m3_rne_satfinite(tl.math.div_rn(quant_scale * amax, 6.0))
        scaled = yb * quant_scale
        codes = _e2m1_codes(tl.abs(scaled), sf[:, :, None]) | ((scaled < 0).to(tl.int32) << 3)
        lo4, hi4 = tl.split(tl.reshape(codes, [R, B // 2, 2]))
        col0 = tl.min(cols, axis=0)
        packed = col0 // 2 + tl.arange(0, B // 2)[None, :]
        tl.store(
            q_ptr + rows * (hidden // 2) + packed,
            (lo4 | (hi4 << 4)).to(tl.uint8),
            mask=ok[:, None] & (packed < hidden // 2),
        )
        kb = col0 // 16 + tl.arange(0, B // 16)[None, :]
        sf_byte = tl.where(kb < hidden // 16, sf_code, 0).to(tl.uint8)
        if SWIZZLED:
            off = (
                (rows // 128) * (sf_cols * 128)
                + (kb // 4) * 512
                + (rows % 32) * 16
                + ((rows % 128) // 32) * 4
                + (kb % 4)
            )
            tl.store(sf_ptr + off, sf_byte, mask=ok[:, None] & (kb < sf_cols))
        else:
            tl.store(
                sf_ptr + rows * (hidden // 16) + kb, sf_byte, mask=ok[:, None] & (kb < hidden // 16)
            )


@triton.jit
def stage_gather(
    c, n_c, chunk, pid, nprog, rank, hidden, slot, ptrs_ptr, bufs_ptr, buf_elems, abort_ptr,
    state_ptr, start, timeout, gamma_ptr, weight_bias, residual_out_ptr, norm_out_ptr, q_ptr,
    sf_ptr, eps, quant_scale, sf_cols, WORLD: tl.constexpr, QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr, HW_CVT: tl.constexpr, G_ROWS: tl.constexpr, G_COLS: tl.constexpr,
    G_TILES: tl.constexpr, EMU: tl.constexpr, EMU_ITEMS: tl.constexpr,
):  # fmt: skip
    """Every row of chunk c, in tiles of G_ROWS rows of one owner: pass 1 waits for the owner's
    reduced bits column tile by column tile and sums their squares (and their largest magnitude);
    pass 2 stores them as residual_out, norms them (+ FP8 / NVFP4) and clears them. Every rank runs
    this code on every row: bitwise-identical outputs. RMSNorm is overflow-safe as add_rmsnorm's: a
    row whose fp32 sum of squares overflows is scaled by a power of two first (exact)."""
    dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
    groups = tl.cdiv(tl.cdiv(n_c, WORLD), G_ROWS)
    n_items = WORLD * groups
    first, mine = _items(c, n_items, pid, nprog)
    row_elems = tl.full([], 0, tl.int64) + hidden
    src_stride = tl.cdiv(chunk, WORLD).to(tl.int64) * row_elems
    ag = slot_base(ptrs_ptr, bufs_ptr, buf_elems, rank, slot, hidden, chunk, WORLD, EMU)
    ag += WORLD * src_stride
    for k in range(0, EMU_ITEMS if EMU else mine):
        if k < mine:
            q, ii, ok, t, _ = _owner_tile(first + k * nprog, n_c, c, chunk, groups, G_ROWS, WORLD)
            rows = ag + q * src_stride + ii[:, None] * row_elems
            sum_sq = tl.zeros([G_ROWS], dtype=tl.float32)
            amax = tl.zeros([G_ROWS], dtype=tl.float32)
            bad = 0
            for cb in range(0, G_TILES):
                cols = cb * G_COLS + tl.arange(0, G_COLS)
                m = ok[:, None] & (cols[None, :] < hidden)
                v, b = wait_tile(rows + cols[None, :], m, abort_ptr, start, timeout, EMU)
                x = v.to(dtype, bitcast=True).to(tl.float32)
                sum_sq += tl.sum(x * x, axis=1)
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
                bad = bad | b
            if bad != 0:
                fail(1 << q, abort_ptr, ptrs_ptr, state_ptr, rank, WORLD, EMU)
            overflow = sum_sq == float("inf")
            amax_exp = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
            power = ((tl.minimum(tl.maximum(285 - amax_exp, 1), 254)) << 23).to(
                tl.float32, bitcast=True
            )
            scale = tl.where(overflow, power, 1.0)
            if tl.max(overflow.to(tl.int32), axis=0) != 0:  # rare: a third pass, scaled
                scaled_sq = tl.zeros([G_ROWS], dtype=tl.float32)
                for cb in range(0, G_TILES):
                    cols = cb * G_COLS + tl.arange(0, G_COLS)
                    m = ok[:, None] & (cols[None, :] < hidden)
                    v = tl.load(rows + cols[None, :], mask=m, other=0, volatile=True)
                    xs = v.to(dtype, bitcast=True).to(tl.float32) * scale[:, None]
                    scaled_sq += tl.sum(xs * xs, axis=1)
                sum_sq = tl.where(overflow, scaled_sq, sum_sq)
            inv_rms = tl.rsqrt(sum_sq / hidden + eps * scale * scale)
            factor = (scale * inv_rms)[:, None]
            for cb in range(0, G_TILES):
                cols = cb * G_COLS + tl.arange(0, G_COLS)
                in_row = cols[None, :] < hidden
                m = ok[:, None] & in_row
                v = tl.load(rows + cols[None, :], mask=m, other=0, volatile=True)
                tl.store(rows + cols[None, :], tl.full(v.shape, SENTINEL, tl.int16), mask=m)
                x = v.to(dtype, bitcast=True).to(tl.float32)
                x = tl.where((tl.zeros_like(x).to(tl.int32) + bad) != 0, float("nan"), x)
                out = t[:, None] * row_elems + cols[None, :]
                tl.store(residual_out_ptr + out, x.to(dtype), mask=m)  # exact (or NaN)
                g = tl.load(gamma_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
                y = _round(x * factor * (g + weight_bias)[None, :], norm_out_ptr.dtype.element_ty)
                tl.store(norm_out_ptr + out, y, mask=m)
                if QUANT != 0:
                    _quant_tile(
                        tl.where(in_row, y.to(tl.float32), 0.0), t, ok, cols, hidden, q_ptr,
                        sf_ptr, quant_scale, sf_cols, QUANT, SWIZZLED, HW_CVT,
                    )  # fmt: skip
