"""The large-T bandwidth path over symmetric memory: a chunked two-shot pipeline in one launch,
with a workspace of a fixed size whatever T is (a ring of chunk slots). Multicast is never used.

Rows are cut into chunks of C tokens; chunk c uses ring slot s = (base + c) % SLOTS, where `base`
(device state) counts the chunks of every earlier call. Inside a chunk, local row j belongs to rank
j % W (its owner), as the owner's row i = j // W. Every program of every rank walks the chunks with
three stages in flight, one chunk apart:

  finalize(c): tiles of [F_ROWS owner rows, F_COLS columns] of rank r's partial (fp32 sum of the K
               routed rows, routed scaling, shared add, ONE rounding, -0.0 -> +0.0), stored into the
               owner's reduce-scatter region [source r][row i] of slot s. Never waits for data.
  reduce(c-1): the owned rows' tiles: wait until the W sources are no longer the sentinel, sum them
               in rank order in fp32, add the residual, round once (-0.0 -> +0.0): residual_out's
               bits, pushed into every rank's all-gather region [owner r][row i]; the sources go
               back to the sentinel.
  gather(c-2): whole rows: wait for the owner's row, store it as residual_out, norm it (+ FP8 /
               NVFP4), put the row back to the sentinel; then the program releases slot s (a
               counter in its rank's header; the P programs' shares add up to one unit).

Before finalize(c) writes into slot s of any rank, the program waits until every rank's counter of
slot s shows that all programs released the chunk that used s before (SLOTS chunks earlier). All
ranks launch the same P programs with the same T, and every program is resident (P is capped by the
compiled kernel's occupancy), so every wait is for an earlier stage: no deadlock, by induction over
(chunk, stage). Waits are bounded (time, or the abort word a peer that timed out sets): a missing
peer gives NaN rows and the error word, never a hang.

Every rank norms every row from the same rounded residual_out bits with the same code, so every
output is bitwise identical on every rank. Error against the fp32 oracle: the partial's rounding,
residual_out's (the norm reads it) and norm_out's: 3 roundings.

Link bytes per rank: (W - 1) / W of the partial rows out and as many reduced rows: 2 (W - 1) / W *
T * H * elem, as a two-shot moves (at W = 8 a quarter of a one-shot's). The slots are small (at
C = 256: 29 MB at H = 7168, W any), so at W = 1 the partial round trip largely stays in L2.

Memory ordering: a reader uses an element only once it differs from the sentinel (2-byte elements
are single-copy atomic, so a late or torn arrival reads as "not yet"); a slot's consumer clears what
it read, then (block barrier, release at system scope) bumps its counter; a producer acquires the
counter (system scope) before it writes into that slot again, so its write comes after the clear.

Buffer per rank: a 256-byte header (int32 abort word at byte 0, int64 release counters [SLOTS] at
byte 64), then SLOTS slots of [W][CW][H] reduce-scatter rows and [W][CW][H] all-gather rows
(CW = ceil(C / W)), the sentinel at creation. Device state per rank: int64 [4] (chunk base, ticket,
error word, unused).

The CPU emulation (TRITON_INTERPRET=1, ranks as slices of one tensor) runs this same kernel body one
(stage, chunk, program) per launch in pipeline order; `EMU` swaps only the buffer pointers, the
timer (a poll count), the release atomic and the end-of-call ticket (the caller advances the base).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .quant import QUANT_NVFP4, row_block
from .symm_common import (
    HEADER_BYTES,
    SENTINEL,
    _gamma_row,
    _globaltimer,
    _norm_quant_row,
    _payload_bits,
    _poll_status,
    _report_timeout,
    _sf_padding_item,
    _timeout_word,
    sf_padding_items,
)

SLOTS = 4
FREED_BYTE = 64  # header byte offset of the int64 release counters
STATE_WORDS = 4  # int64: chunk base, ticket, error word, unused
_SLOTS = tl.constexpr(SLOTS)
_FREED_BYTE = tl.constexpr(FREED_BYTE)
_HEAD_ELEMS = tl.constexpr(HEADER_BYTES // 2)
# one chunk's releases add exactly this to its slot's counter, whatever the program count P (program
# 0 adds UNIT - P + 1, every other 1): calls with different launch shapes share one ring
_UNIT = tl.constexpr(1 << 20)
STAGE_FINALIZE, STAGE_REDUCE, STAGE_GATHER, STAGE_SF_PAD = 0, 1, 2, 3


def rows_per_source(world: int, chunk: int) -> int:
    return -(-chunk // world)


def slot_elems(world: int, chunk: int, hidden: int) -> int:
    """Elements of one slot: reduce-scatter [W][CW][H], then all-gather [W][CW][H]."""
    return 2 * world * rows_per_source(world, chunk) * hidden


def buffer_bytes(world: int, chunk: int, hidden: int, elem_size: int) -> int:
    return HEADER_BYTES + SLOTS * slot_elems(world, chunk, hidden) * elem_size


@triton.jit
def _rank_buf(ptrs_ptr, bufs_ptr, buf_elems, q, EMU: tl.constexpr):
    """Rank q's buffer base (int16 elements, header included)."""
    if EMU:
        return bufs_ptr + q * buf_elems
    else:
        return tl.multiple_of(tl.load(ptrs_ptr + q).to(tl.pointer_type(tl.int16)), 16)


@triton.jit
def _counter(ptrs_ptr, emu_freed_ptr, q, slot, EMU: tl.constexpr):
    if EMU:
        return emu_freed_ptr + q * _SLOTS + slot
    else:
        return (tl.load(ptrs_ptr + q) + _FREED_BYTE).to(tl.pointer_type(tl.int64)) + slot


@triton.jit
def _fence_sys():
    tl.inline_asm_elementwise(
        "fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _fail(who, abort_ptr, ptrs_ptr, state_ptr, rank, WORLD: tl.constexpr, EMU: tl.constexpr):
    if EMU:
        err, _ = _timeout_word(who, abort_ptr, rank)
        tl.store(state_ptr + 2, err.to(tl.int64))
    else:
        _report_timeout(who, ptrs_ptr, state_ptr, abort_ptr, rank, WORLD)


@triton.jit
def _wait_tile(ptrs, mask, abort_ptr, start, timeout, EMU: tl.constexpr):
    """Poll a 2-D tile of int16 bits until no element is the sentinel (or time / abort)."""
    v = tl.load(ptrs, mask=mask, other=0, volatile=True)
    polls = 1
    status = _poll_status(v, abort_ptr, start, timeout, polls, EMU)
    while status == 1:
        v = tl.load(ptrs, mask=mask, other=0, volatile=True)
        polls += 1
        status = _poll_status(v, abort_ptr, start, timeout, polls, EMU)
    return v, ((status & 5) != 0).to(tl.int32)


@triton.jit
def _read_counter(cnt, EMU: tl.constexpr):
    if EMU:
        return tl.load(cnt)
    else:
        lane = tl.arange(0, 32)
        got = tl.atomic_add(cnt + lane * 0, lane * 0, mask=lane == 0, sem="acquire", scope="sys")
        return tl.max(tl.where(lane == 0, got, -(1 << 62)), axis=0)


@triton.jit
def _wait_slot_free(
    ptrs_ptr, emu_freed_ptr, slot, need, abort_ptr, start, timeout, WORLD: tl.constexpr,
    EMU: tl.constexpr,
):  # fmt: skip
    """Until every rank's counter of `slot` reaches `need`; returns the ranks that never did."""
    missing = 0
    for q in tl.static_range(WORLD):
        cnt = _counter(ptrs_ptr, emu_freed_ptr, q, slot, EMU)
        seen = _read_counter(cnt, EMU)
        polls = 1
        waiting = ((seen - need) < 0).to(tl.int32)
        while waiting != 0:
            seen = _read_counter(cnt, EMU)
            polls += 1
            if EMU:
                late = polls >= timeout
            else:
                late = (_globaltimer() - start) > timeout
            ab = tl.load(abort_ptr, volatile=True)
            waiting = ((seen - need) < 0).to(tl.int32) * (1 - late.to(tl.int32))
            waiting = waiting * (ab == 0).to(tl.int32)
        missing = missing | tl.where((seen - need) >= 0, 0, 1 << q)
    if not EMU:
        # the acquire was one thread's: order the whole program's stores after it
        tl.debug_barrier()
    return missing


@triton.jit
def _release(ptrs_ptr, emu_freed_ptr, rank, slot, pid, nprog, EMU: tl.constexpr):
    """This program is done with `slot` (its reads and clears): its share of _UNIT on its rank's
    counter."""
    share = tl.where(pid == 0, _UNIT - nprog + 1, 1).to(tl.int64)
    if EMU:
        cnt = _counter(ptrs_ptr, emu_freed_ptr, rank, slot, EMU)
        tl.store(cnt, tl.load(cnt) + share)
    else:
        tl.debug_barrier()  # every thread's clears precede the release
        lane = tl.arange(0, 32)
        cnt = _counter(ptrs_ptr, emu_freed_ptr, rank, slot, EMU)
        tl.atomic_add(cnt + lane * 0, lane * 0 + share, mask=lane == 0, sem="release", scope="sys")


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


@triton.jit(do_not_specialize=["tokens", "rank", "timeout", "sf_rows", "sf_pad_items", "buf_elems"])
def _ring_kernel(
    ptrs_ptr,
    bufs_ptr,
    buf_elems,
    emu_abort_ptr,
    emu_freed_ptr,
    state_ptr,
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
    chunk,
    rank,
    routed_scaling,
    eps,
    weight_bias,
    quant_scale,
    sf_rows,
    sf_cols,
    sf_pad_items,
    timeout,
    WORLD: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    HW_CVT: tl.constexpr,
    F_ROWS: tl.constexpr,
    F_COLS: tl.constexpr,
    R_ROWS: tl.constexpr,
    R_COLS: tl.constexpr,
    EMU: tl.constexpr = False,
    EMU_PID: tl.constexpr = 0,
    EMU_NPROG: tl.constexpr = 1,
    EMU_STAGE: tl.constexpr = 0,
    EMU_CHUNK: tl.constexpr = 0,
    EMU_ITEMS: tl.constexpr = 0,
):
    if EMU:
        pid = EMU_PID
        nprog = EMU_NPROG
        start = 0
        timeout_ns = timeout
        abort_ptr = emu_abort_ptr + rank
    else:
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        start = _globaltimer()
        timeout_ns = timeout.to(tl.int64) * 1000
        abort_ptr = tl.load(ptrs_ptr + rank).to(tl.pointer_type(tl.int32))
    base = tl.load(state_ptr)  # chunks of every earlier call (int64)
    lane = tl.arange(0, 32)
    if not EMU:
        # the ticket: issued after the base load returned (its predicate depends on it)
        ticket = tl.atomic_add(
            state_ptr + 1 + lane * 0,
            lane * 0 + 1,
            mask=(lane == 0) & (base >= 0),
            sem="relaxed",
            scope="gpu",
        )
    nchunks = tl.cdiv(tokens, chunk)
    if EMU:
        if EMU_STAGE == 0:
            _stage_finalize(
                EMU_CHUNK, base, ptrs_ptr, bufs_ptr, buf_elems, emu_freed_ptr, abort_ptr,
                state_ptr, start, timeout_ns, pid, nprog, gemm2_ptr, perm_ptr, weight_ptr,
                shared_ptr, tokens, hidden, chunk, rank, routed_scaling,
                residual_out_ptr.dtype.element_ty, WORLD, TOP_K,
                HAS_SHARED, F_ROWS, F_COLS, EMU, EMU_ITEMS,
            )  # fmt: skip
        if EMU_STAGE == 1:
            _stage_reduce(
                EMU_CHUNK, base, ptrs_ptr, bufs_ptr, buf_elems, abort_ptr, state_ptr, start,
                timeout_ns, pid, nprog, residual_ptr, tokens, hidden, chunk, rank,
                residual_out_ptr.dtype.element_ty, WORLD, R_ROWS, R_COLS, EMU, EMU_ITEMS,
            )  # fmt: skip
        if EMU_STAGE == 2:
            _stage_gather(
                EMU_CHUNK, base, ptrs_ptr, bufs_ptr, buf_elems, emu_freed_ptr, abort_ptr,
                state_ptr, start, timeout_ns, pid, nprog, gamma_ptr, weight_bias,
                residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr, tokens, hidden, chunk, rank, eps,
                quant_scale, sf_cols, WORLD,
                QUANT, SWIZZLED, ROW_BLOCK, HW_CVT, EMU, EMU_ITEMS,
            )  # fmt: skip
        if EMU_STAGE == 3:
            if QUANT == 2:
                if SWIZZLED:
                    for item in range(EMU_PID, EMU_ITEMS, EMU_NPROG):
                        if item < sf_pad_items:
                            _sf_padding_item(item, sf_ptr, tokens, sf_rows, sf_cols)
    else:
        for it in range(0, nchunks + 2):
            if it < nchunks:
                _stage_finalize(
                    it, base, ptrs_ptr, bufs_ptr, buf_elems, emu_freed_ptr, abort_ptr,
                    state_ptr, start, timeout_ns, pid, nprog, gemm2_ptr, perm_ptr, weight_ptr,
                    shared_ptr, tokens, hidden, chunk, rank, routed_scaling,
                residual_out_ptr.dtype.element_ty, WORLD, TOP_K,
                    HAS_SHARED, F_ROWS, F_COLS, EMU, 0,
                )  # fmt: skip
            if (it >= 1) & (it <= nchunks):
                _stage_reduce(
                    it - 1, base, ptrs_ptr, bufs_ptr, buf_elems, abort_ptr, state_ptr, start,
                    timeout_ns, pid, nprog, residual_ptr, tokens, hidden, chunk, rank,
                    residual_out_ptr.dtype.element_ty, WORLD, R_ROWS, R_COLS, EMU, 0,
                )  # fmt: skip
            if it >= 2:
                _stage_gather(
                    it - 2, base, ptrs_ptr, bufs_ptr, buf_elems, emu_freed_ptr, abort_ptr,
                    state_ptr, start, timeout_ns, pid, nprog, gamma_ptr, weight_bias,
                    residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr, tokens, hidden, chunk, rank, eps,
                quant_scale, sf_cols, WORLD,
                    QUANT, SWIZZLED, ROW_BLOCK, HW_CVT, EMU, 0,
                )  # fmt: skip
        if QUANT == 2:
            if SWIZZLED:
                for item in range(pid, sf_pad_items, nprog):
                    _sf_padding_item(item, sf_ptr, tokens, sf_rows, sf_cols)
        # the last ticket advances the chunk base for the next call (every program read it first)
        done = (lane == 0) & (ticket == nprog - 1)
        tl.store(state_ptr + lane * 0, lane * 0 + base + nchunks, mask=done)
        tl.store(state_ptr + 1 + lane * 0, lane * 0, mask=done)


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


# ------------------------------------------------------------------------------------------------
# launch
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RingShape:
    """A launch variant: chunk tokens (fixed per workspace: it sizes the slots), programs per SM
    (capped by the compiled kernel's occupancy: every program must be resident), warps, and the
    finalize / reduce tiles [rows, columns]."""

    chunk: int = 256
    programs_per_sm: int = 2
    warps: int = 8
    f_rows: int = 2
    f_cols: int = 1024
    r_rows: int = 2
    r_cols: int = 1024

    def constexprs(self, hidden: int) -> dict:
        cap = triton.next_power_of_2(hidden)
        return dict(
            F_ROWS=self.f_rows,
            F_COLS=min(self.f_cols, cap),
            R_ROWS=self.r_rows,
            R_COLS=min(self.r_cols, cap),
        )


DEFAULT_SHAPE = RingShape()


def resident_per_sm(compiled, warps: int) -> int:
    """Programs of this compiled kernel one SM holds at once (registers, warps, shared memory)."""
    regs_per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256
    by_regs = 65536 // (regs_per_warp * warps)
    by_warps = 64 // warps
    shared = int(getattr(compiled.metadata, "shared", 0) or 0)
    by_smem = (227 * 1024) // (shared + 1024) if shared else 32
    return max(1, min(by_regs, by_warps, by_smem, 32))


_OCCUPANCY: dict = {}


def _args(ws, io: dict, quant: int, quant_scale: float, swizzled: bool) -> tuple[list, dict]:
    perm = io["perm"]
    tokens, top_k = perm.shape
    hidden = io["residual"].shape[1]
    sf = io["sf"]
    sf_rows, sf_cols = (sf.shape[0], sf.shape[1]) if quant == QUANT_NVFP4 else (tokens, 0)
    pad = sf_padding_items(tokens, sf_rows, sf_cols) if quant == QUANT_NVFP4 and swizzled else 0
    args = [
        io["ptrs"], io["bufs"], io["buf_elems"], io["emu_abort"], io["emu_freed"], io["state"],
        io["gemm2_out"], perm, io["weights"],
        io["shared"] if io["shared"] is not None else io["residual"],
        io["residual"], io["gamma"], io["residual_out"], io["norm_out"], io["q"], sf,
        tokens, hidden, io["chunk"], io["rank"], float(io["routed_scaling"]), float(io["eps"]),
        float(io["weight_bias"]), float(quant_scale), sf_rows, sf_cols, pad, io["timeout"],
    ]  # fmt: skip
    constexprs = dict(
        WORLD=io["world"],
        TOP_K=top_k,
        HAS_SHARED=io["shared"] is not None,
        QUANT=quant,
        SWIZZLED=bool(swizzled),
        ROW_BLOCK=row_block(hidden),
        HW_CVT=io["residual"].is_cuda,
    )
    return args, constexprs


def fused_into(
    ws,
    *,
    residual_out: torch.Tensor,
    norm_out: torch.Tensor,
    q: torch.Tensor,
    sf: torch.Tensor,
    gemm2_out: torch.Tensor,
    perm: torch.Tensor,
    weights: torch.Tensor,
    shared: Optional[torch.Tensor],
    residual: torch.Tensor,
    gamma: torch.Tensor,
    routed_scaling: float,
    eps: float,
    weight_bias: float,
    quant: int,
    quant_scale: float,
    swizzled: bool,
    shape: Optional[RingShape] = None,
) -> None:
    """One GPU launch. `ws`: ptrs (int64 [W + 1]: every rank's buffer, then the pinned error word),
    state (int64 [STATE_WORDS]), world, rank, chunk, num_sms (the same on every rank), timeout_ns.
    Any T (the ring is reused within the call); T == 0 launches nothing (on every rank).
    shape: a launch variant (its chunk must be the workspace's)."""
    tokens = perm.shape[0]
    if tokens == 0:
        return
    shape = shape or DEFAULT_SHAPE
    if shape.chunk != ws.chunk:
        raise ValueError(f"symm_ring: shape.chunk={shape.chunk} but the workspace's is {ws.chunk}")
    io = dict(
        ptrs=ws.ptrs, bufs=ws.state, buf_elems=0, emu_abort=ws.state, emu_freed=ws.state,
        state=ws.state, gemm2_out=gemm2_out, perm=perm, weights=weights, shared=shared,
        residual=residual, gamma=gamma, residual_out=residual_out, norm_out=norm_out, q=q, sf=sf,
        chunk=ws.chunk, rank=ws.rank, routed_scaling=routed_scaling, eps=eps,
        weight_bias=weight_bias, timeout=ws.timeout_ns // 1000, world=ws.world,
    )  # fmt: skip
    args, constexprs = _args(ws, io, quant, quant_scale, swizzled)
    constexprs.update(shape.constexprs(residual.shape[1]))
    key = (tuple(sorted(constexprs.items())), shape.warps, residual.dtype, residual.device)
    per_sm = _OCCUPANCY.get(key)
    if per_sm is None:
        compiled = _ring_kernel.warmup(*args, grid=(1,), num_warps=shape.warps, **constexprs)
        compiled._init_handles()  # loads it: n_regs is known from here on
        per_sm = _OCCUPANCY[key] = resident_per_sm(compiled, shape.warps)
    programs = ws.num_sms * min(shape.programs_per_sm, per_sm)
    _ring_kernel[(programs,)](*args, num_warps=shape.warps, **constexprs)
