"""One-launch MoE epilogue over symmetric memory for large T (the bandwidth path): finalize + shared
add,
reduce-scatter by token, residual add, all-gather of the reduced rows, RMSNorm (+ FP8 / NVFP4), on
one
node, with NVLink multicast never used.

Rows are dealt to ranks in blocks of W: row t = b * W + q belongs to rank q (its owner), block b.
Per
call, on every rank r (all ranks launch the same grid with the same T), epoch e, slot s = e % 3,
each
program walks its blocks b = pid, pid + nprog, ... and for each:
  clear: the previous call's slot (s + 2) % 3 goes back to the sentinel, for the rows that call
  used.
  push:  finalizes each row of block b that r does not own (fp32 accumulate, routed scaling, shared
         add, ONE rounding to the activation dtype, -0.0 -> +0.0) and stores it into the owner's
         reduce-scatter region, row [r][b] (plain stores; never waits).
  reduce: finalizes its own row t = b * W + r the same way (kept in registers), waits until the W -
  1
         peers' partials of that row are no longer the sentinel, sums the W rounded partials in rank
         order in fp32, adds the residual, rounds once (-0.0 -> +0.0): that is residual_out, and it
         is
         pushed into every rank's all-gather region, row t (its own included).
  gather: (one block behind, so the owner's push has time to land) for each row of the previous
  block,
         waits for the owner's row, stores it as residual_out and computes norm_out (+ quant) from
         it.
         Every rank runs this one piece of code on every row: norm_out is computed from the ROUNDED
         residual_out, from the same values, with the same reduction order (which follows the
         compiler's
         layout of the row: an owner norming its row where it reduced it measured different bits).
Every output row is therefore bitwise identical on all ranks. Error against the fp32 oracle: the
partial's rounding, residual_out's rounding (the norm reads it) and norm_out's: 3 roundings.

Link bytes per rank: (W - 1) / W of the rows out in the reduce-scatter and as many in the all-gather
(a rank's own rows go to its own buffer),
2 (W - 1) / W * T * H * elem in all (at W = 2 the same as a one-shot's, at W = 8 four times less).
The gathered rows are the rounded residual_out (one array); gathering the outputs instead would move
residual_out + norm_out (+ quant): twice the bytes.

Why it cannot deadlock (the grid is at most the SM count and the same on every rank, so every
program
is resident and block b is handled by program b % nprog on every rank): push never waits; reduce(b)
waits only for the peers' push(b), which each peer's program does before its own reduce(b);
gather(b)
waits only for the owners' reduce(b), which needs only pushes(b), and each program does push(b) and
reduce(b) before it waits in gather(b). By induction over b, every awaited step is reached.

Memory ordering (the data is the flag; see `symm_oneshot` for the longer argument, which carries
over):
a reader uses an element only once it differs from the sentinel (2-byte elements, single-copy
atomic,
so a late or torn arrival reads as "not yet"); slot s of rank r is written by peers in call e, read
by r
in call e, cleared by r in call e + 1, and written again only in call e + 3, which a peer can start
only after every rank started call e + 2 (a rank finishes a call only with data every peer produced
in
that call), so after r's call e + 1 with its clear completed. Three slots, each cleared one call
behind.
The epoch (slot) and each slot's row count live in device state (graph replays need no host).

Buffer layout per rank: a 256-byte header (int32 abort word at 0), then 3 slots, each
[W][cap_blocks][H] (reduce-scatter rows: source, block) followed by [cap][H] (all-gather rows), of
the
activation dtype, all the sentinel at creation.

The fused GPU launch and the CPU emulation (TRITON_INTERPRET=1, ranks as slices of one tensor, one
phase per launch, the timer a poll count) run the same kernel body: `EMU` swaps only the peer
pointers,
the timer and the end-of-call ticket.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .quant import QUANT_NVFP4
from .symm_common import (
    HEADER_BYTES,
    SENTINEL,
    SENTINEL_BITS,
    SLOTS,
    _fence_acq_rel_gpu_if,
    _finalize_chunk,
    _gamma_row,
    _globaltimer,
    _missing_ranks,
    _norm_quant_row,
    _payload_bits,
    _peer_ptr,
    _report_timeout,
    _sf_padding_item,
    _timeout_word,
    _wait_row,
    row_block,
    sf_padding_items,
)

STATE_WORDS = (
    8  # slot (epoch mod 3), ticket counter, error word, unused, rows of slot 0, 1, 2, unused
)
PUSH, REDUCE, GATHER, CLEAR = 1, 2, 4, 8
ALL_PHASES = PUSH | REDUCE | GATHER | CLEAR


def cap_blocks(world: int, cap: int) -> int:
    return -(-cap // world)


def slot_elems(world: int, cap: int, hidden: int) -> int:
    """Elements of one slot: the reduce-scatter rows [W][cap_blocks][H], then the all-gather rows
    [cap][H]."""
    return (world * cap_blocks(world, cap) + cap) * hidden


def buffer_bytes(world: int, cap: int, hidden: int, elem_size: int) -> int:
    return HEADER_BYTES + SLOTS * slot_elems(world, cap, hidden) * elem_size


@triton.jit
def _rank_buf(ptrs_ptr, bufs_ptr, buf_elems, q, EMU: tl.constexpr):
    """Rank q's buffer (int16 elements): GPU, the symmetric address from the table; EMU, a slice."""
    if EMU:
        return bufs_ptr + q * buf_elems
    else:
        return _peer_ptr(ptrs_ptr, q, tl.int16)


@triton.jit
def _partial_bits(
    gemm2_ptr,
    perm_ptr,
    weight_ptr,
    shared_ptr,
    t,
    hidden,
    routed_scaling,
    dtype: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
):
    cols = tl.arange(0, ROW_BLOCK)
    return _payload_bits(
        _finalize_chunk(
            gemm2_ptr,
            perm_ptr,
            weight_ptr,
            shared_ptr,
            t,
            cols,
            hidden,
            routed_scaling,
            TOP_K,
            HAS_SHARED,
        ),
        dtype,
    )


@triton.jit
def _clear_row(ptr, hidden, ROW_BLOCK: tl.constexpr):
    cols = tl.arange(0, ROW_BLOCK)
    tl.store(ptr + cols, tl.full([ROW_BLOCK], SENTINEL, tl.int16), mask=cols < hidden)


@triton.jit(
    do_not_specialize=[
        "tokens",
        "sf_rows",
        "rank",
        "timeout",
        "cap",
        "capb",
        "buf_elems",
        "emu_slot",
        "emu_prev_rows",
        "sf_pad_items",
    ]
)
def _twoshot_kernel(
    ptrs_ptr,
    bufs_ptr,
    buf_elems,
    emu_abort_ptr,
    emu_slot,
    emu_prev_rows,
    sf_pad_items,
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
    cap,
    capb,
    data_off,
    rank,
    routed_scaling,
    eps,
    weight_bias,
    quant_scale,
    sf_rows,
    sf_cols,
    timeout,
    WORLD: tl.constexpr,
    WP: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    HW_CVT: tl.constexpr,
    PHASES: tl.constexpr,
    EMU: tl.constexpr,
    EMU_PID: tl.constexpr = 0,
    EMU_NPROG: tl.constexpr = 1,
    EMU_BLOCKS: tl.constexpr = 0,
    EMU_PAD: tl.constexpr = 0,
):
    dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
    # the interpreter holds a runtime scalar as a 1-element array, which `range` rejects (numpy >=
    # 2.4):
    # emulated loops take their bounds from constexprs (EMU_*)
    if EMU:
        pid = EMU_PID
        nprog = EMU_NPROG
        slot = emu_slot
        prev_rows = emu_prev_rows
        blocks_to_walk = EMU_BLOCKS
        pad_items = EMU_PAD
    else:
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        slot = tl.load(state_ptr)  # this call's slot, 0..2
        prev_rows = tl.load(state_ptr + 4 + (slot + 2) % 3)
        blocks_to_walk = tl.maximum(tl.cdiv(tokens, WORLD), tl.cdiv(prev_rows, WORLD))
        pad_items = sf_pad_items
    prev = (slot + 2) % 3
    lane = tl.arange(0, 32)
    if not EMU:
        # the ticket (see symm_oneshot): relaxed, issued after both state loads returned (its
        # predicate
        # depends on them); the result is used only at the end
        ticket = tl.atomic_add(
            state_ptr + 1 + lane * 0,
            lane * 0 + 1,
            mask=(lane == 0) & (slot >= 0) & (prev_rows >= 0),
            sem="relaxed",
            scope="gpu",
        )
        start = _globaltimer()
        timeout_ns = timeout.to(tl.int64) * 1000
        abort_ptr = tl.load(ptrs_ptr + rank).to(tl.pointer_type(tl.int32))
    else:
        start = 0
        timeout_ns = timeout
        abort_ptr = emu_abort_ptr
    cols = tl.arange(0, ROW_BLOCK)
    in_row = cols < hidden
    zero64 = tl.full([], 0, tl.int64)
    row_elems = zero64 + hidden  # int64; keeps hidden's divisibility (vector stores)
    slot_len = (WORLD * capb + cap).to(tl.int64) * row_elems
    rs_stride = capb.to(tl.int64) * row_elems  # one source's reduce-scatter rows
    local = _rank_buf(ptrs_ptr, bufs_ptr, buf_elems, rank, EMU) + data_off
    rs_here = local + slot * slot_len
    ag_here = rs_here + WORLD * rs_stride
    nblocks = tl.cdiv(tokens, WORLD)
    prev_blocks = tl.cdiv(prev_rows, WORLD)
    qi = tl.arange(0, WP)[:, None]
    g = _gamma_row(gamma_ptr, hidden, weight_bias, ROW_BLOCK)  # once per program, not once per row

    last = -1
    for b in range(
        EMU_PID if EMU else pid, EMU_BLOCKS if EMU else blocks_to_walk, EMU_NPROG if EMU else nprog
    ):
        if PHASES & 4:  # past this call's blocks only clears remain: finish the last gather first
            if (b >= nblocks) & (last >= 0):
                _gather_block(
                    last,
                    ag_here,
                    rank,
                    tokens,
                    hidden,
                    abort_ptr,
                    start,
                    timeout_ns,
                    ptrs_ptr,
                    state_ptr,
                    g,
                    residual_out_ptr,
                    norm_out_ptr,
                    q_ptr,
                    sf_ptr,
                    eps,
                    quant_scale,
                    sf_cols,
                    WORLD,
                    QUANT,
                    SWIZZLED,
                    ROW_BLOCK,
                    HW_CVT,
                    EMU,
                )
                last = -1
        if PHASES & 8:  # clear what the previous call wrote into this rank's previous slot, block b
            if b < prev_blocks:
                old = local + prev * slot_len
                for q in tl.static_range(WORLD):
                    if q != rank:
                        if b * WORLD + rank < prev_rows:
                            _clear_row(old + q * rs_stride + b * row_elems, hidden, ROW_BLOCK)
                    if b * WORLD + q < prev_rows:  # every row of the block, its own included
                        _clear_row(
                            old + WORLD * rs_stride + (b * WORLD + q) * row_elems, hidden, ROW_BLOCK
                        )
        if b < nblocks:
            if PHASES & 1:  # push the partials of block b's rows owned by peers
                for q in tl.static_range(WORLD):
                    t = zero64 + b * WORLD + q
                    if (q != rank) & (t < tokens):
                        bits = _partial_bits(
                            gemm2_ptr,
                            perm_ptr,
                            weight_ptr,
                            shared_ptr,
                            t,
                            hidden,
                            routed_scaling,
                            dtype,
                            TOP_K,
                            HAS_SHARED,
                            ROW_BLOCK,
                        )
                        dst = (
                            _rank_buf(ptrs_ptr, bufs_ptr, buf_elems, q, EMU)
                            + data_off
                            + slot * slot_len
                        )
                        tl.store(dst + rank * rs_stride + b * row_elems + cols, bits, mask=in_row)
            if PHASES & 2:  # reduce the owned row of block b, push it to every peer, norm it
                t = zero64 + b * WORLD + rank
                if t < tokens:
                    own = (
                        _partial_bits(
                            gemm2_ptr,
                            perm_ptr,
                            weight_ptr,
                            shared_ptr,
                            t,
                            hidden,
                            routed_scaling,
                            dtype,
                            TOP_K,
                            HAS_SHARED,
                            ROW_BLOCK,
                        )
                        .to(dtype, bitcast=True)
                        .to(tl.float32)
                    )
                    res = tl.load(
                        residual_ptr + t * row_elems + cols, mask=in_row, other=0.0
                    )  # before the wait
                    v, status = _wait_row(
                        rs_here,
                        rs_stride,
                        b,
                        hidden,
                        abort_ptr,
                        start,
                        timeout_ns,
                        -1,
                        rank,
                        WORLD,
                        WP,
                        ROW_BLOCK,
                        EMU,
                        True,
                    )
                    bad = ((status & 5) != 0).to(tl.int32)
                    if bad != 0:  # uniform over the program
                        if EMU:
                            err, _ = _timeout_word(_missing_ranks(v, WORLD, WP), abort_ptr, rank)
                            tl.store(state_ptr + 2, err)
                        else:
                            _report_timeout(
                                _missing_ranks(v, WORLD, WP),
                                ptrs_ptr,
                                state_ptr,
                                abort_ptr,
                                rank,
                                WORLD,
                            )
                    vf = v.to(dtype, bitcast=True).to(tl.float32)
                    s = tl.where(rank == 0, own, tl.sum(tl.where(qi == 0, vf, 0.0), axis=0))
                    for q in tl.static_range(1, WORLD):  # rank order, the own partial in its place
                        s += tl.where(rank == q, own, tl.sum(tl.where(qi == q, vf, 0.0), axis=0))
                    x = res.to(tl.float32) + s
                    x = tl.where((cols * 0 + bad) != 0, float("nan"), x)
                    xbits = _payload_bits(x, dtype)
                    for q in tl.static_range(
                        WORLD
                    ):  # its own buffer too: every rank norms every row alike
                        dst = (
                            _rank_buf(ptrs_ptr, bufs_ptr, buf_elems, q, EMU)
                            + data_off
                            + slot * slot_len
                        )
                        tl.store(dst + WORLD * rs_stride + t * row_elems + cols, xbits, mask=in_row)
            if PHASES & 4:
                if last >= 0:
                    _gather_block(
                        last,
                        ag_here,
                        rank,
                        tokens,
                        hidden,
                        abort_ptr,
                        start,
                        timeout_ns,
                        ptrs_ptr,
                        state_ptr,
                        g,
                        residual_out_ptr,
                        norm_out_ptr,
                        q_ptr,
                        sf_ptr,
                        eps,
                        quant_scale,
                        sf_cols,
                        WORLD,
                        QUANT,
                        SWIZZLED,
                        ROW_BLOCK,
                        HW_CVT,
                        EMU,
                    )
            last = b
    if PHASES & 4:
        if last >= 0:
            _gather_block(
                last,
                ag_here,
                rank,
                tokens,
                hidden,
                abort_ptr,
                start,
                timeout_ns,
                ptrs_ptr,
                state_ptr,
                g,
                residual_out_ptr,
                norm_out_ptr,
                q_ptr,
                sf_ptr,
                eps,
                quant_scale,
                sf_cols,
                WORLD,
                QUANT,
                SWIZZLED,
                ROW_BLOCK,
                HW_CVT,
                EMU,
            )
        if QUANT == 2:
            if SWIZZLED:
                for item in range(
                    EMU_PID if EMU else pid,
                    EMU_PAD if EMU else pad_items,
                    EMU_NPROG if EMU else nprog,
                ):
                    _sf_padding_item(item, sf_ptr, tokens, sf_rows, sf_cols)

    if (
        not EMU
    ):  # the last ticket advances the epoch and records this slot's rows for the next call's clear
        done = (lane == 0) & (ticket == nprog - 1)
        done = done & (_fence_acq_rel_gpu_if(done.to(tl.int32)) == 0)
        tl.store(state_ptr + 4 + slot + lane * 0, lane * 0 + tokens, mask=done)
        tl.store(state_ptr + 1 + lane * 0, lane * 0, mask=done)
        tl.store(state_ptr + lane * 0, lane * 0 + (slot + 1) % 3, mask=done)


@triton.jit
def _gather_block(
    b,
    ag_here,
    rank,
    tokens,
    hidden,
    abort_ptr,
    start,
    timeout_ns,
    ptrs_ptr,
    state_ptr,
    g,
    residual_out_ptr,
    norm_out_ptr,
    q_ptr,
    sf_ptr,
    eps,
    quant_scale,
    sf_cols,
    WORLD: tl.constexpr,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    HW_CVT: tl.constexpr,
    EMU: tl.constexpr,
):
    """Block b's rows, this rank's own included: wait for the owner's reduced row, store it as
    residual_out,
    norm it. Every rank runs this same code on every row, so norm_out's reduction order (which
    follows the
    compiler's layout of the row) is the same everywhere: bitwise-identical outputs."""
    dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
    cols = tl.arange(0, ROW_BLOCK)
    in_row = cols < hidden
    for q in tl.static_range(WORLD):
        t = tl.full([], 0, tl.int64) + b * WORLD + q
        if t < tokens:
            v, status = _wait_row(
                ag_here,
                0,
                t,
                hidden,
                abort_ptr,
                start,
                timeout_ns,
                -1,
                -1,
                1,
                1,
                ROW_BLOCK,
                EMU,
                True,
            )
            bad = ((status & 5) != 0).to(tl.int32)
            if bad != 0:
                if EMU:
                    err, _ = _timeout_word(1 << q, abort_ptr, rank)
                    tl.store(state_ptr + 2, err)
                else:
                    _report_timeout(1 << q, ptrs_ptr, state_ptr, abort_ptr, rank, WORLD)
            x = tl.sum(v.to(dtype, bitcast=True).to(tl.float32), axis=0)  # [1, RB] -> [RB], exact
            x = tl.where((cols * 0 + bad) != 0, float("nan"), x)
            xr = x.to(dtype)  # exact (or NaN)
            tl.store(residual_out_ptr + t * hidden + cols, xr, mask=in_row)
            _norm_quant_row(
                tl.where(in_row, xr.to(tl.float32), 0.0),
                g,
                t,
                0,
                ROW_BLOCK,
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
            )


def default_warps(hidden: int) -> int:
    """Measured on one H200, world 1 (benchmarks/twoshot_local.py): at H=4096 16 warps beat 8 by
    19-23%; at
    H=7168 they tie, and 8 leave more registers per thread for the W partials of a wider world."""
    rb = row_block(hidden)
    return 16 if rb == 4096 else 8 if rb > 4096 else 4


def _launch(
    grid,
    ptrs,
    bufs,
    buf_elems,
    emu_abort,
    emu,
    state,
    world,
    rank,
    cap,
    data_off,
    timeout,
    residual_out,
    norm_out,
    q,
    sf,
    gemm2_out,
    perm,
    weights,
    shared,
    residual,
    gamma,
    routed_scaling,
    eps,
    weight_bias,
    quant,
    quant_scale,
    swizzled,
    phases,
    warps,
):
    """emu None: one GPU launch of `grid` programs. emu (slot, previous call's rows, blocks to
    walk): one
    interpreter launch per emulated program, in program order."""
    tokens, top_k = perm.shape
    hidden = residual.shape[1]
    sf_rows, sf_cols = (sf.shape[0], sf.shape[1]) if quant == QUANT_NVFP4 else (tokens, 0)
    pad_items = (
        sf_padding_items(tokens, sf_rows, sf_cols) if quant == QUANT_NVFP4 and swizzled else 0
    )
    runs = (
        [(grid, 0, 0, {})]
        if emu is None
        else [
            (
                1,
                emu[0],
                emu[1],
                dict(EMU_PID=pid, EMU_NPROG=grid, EMU_BLOCKS=emu[2], EMU_PAD=pad_items),
            )
            for pid in range(grid)
        ]
    )
    for programs, emu_slot, emu_prev_rows, emu_constants in runs:
        _twoshot_kernel[(programs,)](
            ptrs,
            bufs,
            buf_elems,
            emu_abort,
            emu_slot,
            emu_prev_rows,
            pad_items,
            state,
            gemm2_out,
            perm,
            weights,
            shared if shared is not None else residual,
            residual,
            gamma,
            residual_out,
            norm_out,
            q,
            sf,
            tokens,
            hidden,
            cap,
            cap_blocks(world, cap),
            data_off,
            rank,
            float(routed_scaling),
            float(eps),
            float(weight_bias),
            float(quant_scale),
            sf_rows,
            sf_cols,
            timeout,
            WORLD=world,
            WP=triton.next_power_of_2(world),
            TOP_K=top_k,
            HAS_SHARED=shared is not None,
            QUANT=quant,
            SWIZZLED=swizzled,
            ROW_BLOCK=row_block(hidden),
            HW_CVT=emu is None or residual.is_cuda,
            PHASES=phases,
            EMU=emu is not None,
            num_warps=warps,
            **emu_constants,
        )


def fused_into(
    ws,
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
    warps: Optional[int] = None,
    programs: Optional[int] = None,
    phases: int = ALL_PHASES,
) -> None:
    """One launch on the GPU. `ws` as for symm_oneshot (ptrs, state, world, rank, cap, data_off,
    num_sms
    (the same on every rank), timeout_ns). T == 0 launches nothing (on every rank); T must be <=
    ws.cap.
    programs / warps: launch variants (the grid is capped at the SM count: every program must be
    resident).
    phases: a subset of ALL_PHASES for benchmark ablations only (the results are then wrong)."""
    tokens = perm.shape[0]
    if tokens == 0:
        return
    if tokens > ws.cap:  # rows past the capacity would land in the next slot or past the buffer
        raise ValueError(f"symm_twoshot: T={tokens} exceeds the workspace's {ws.cap} tokens")
    # enough programs for the previous call's clear too (its T is in device state, unknown here): a
    # small call
    # after a large one would otherwise leave one program clearing thousands of rows alone
    grid = max(1, min(programs or ws.num_sms, ws.num_sms, -(-ws.cap // ws.world)))
    _launch(
        grid,
        ws.ptrs,
        ws.state,
        0,
        ws.state,
        None,
        ws.state,
        ws.world,
        ws.rank,
        ws.cap,
        ws.data_off,
        ws.timeout_ns // 1000,
        residual_out,
        norm_out,
        q,
        sf,
        gemm2_out,
        perm,
        weights,
        shared,
        residual,
        gamma,
        routed_scaling,
        eps,
        weight_bias,
        quant,
        quant_scale,
        swizzled,
        phases,
        warps or default_warps(residual.shape[1]),
    )


def emulate(
    bufs: torch.Tensor,
    states: torch.Tensor,
    aborts: torch.Tensor,
    rank: int,
    phases: int,
    cap: int,
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
    programs: int = 3,
    max_polls: int = 3,
) -> None:
    """Rank `rank`'s `phases` (PUSH | REDUCE | GATHER | CLEAR) under TRITON_INTERPRET=1. bufs: [W,
    buffer elements] of the activation dtype, each rank's buffer past its header (data_off = 0);
    states:
    int32 [W, STATE_WORDS] (slot, -, error word, -, rows of slots 0-2; the caller advances the
    slot);
    aborts: int32 [W]. Programs run one after another, so a wait finds only what earlier launches
    wrote
    (it polls at most max_polls times)."""
    world = bufs.shape[0]
    tokens = perm.shape[0]
    if tokens > cap:
        raise ValueError(f"symm_twoshot: T={tokens} exceeds the emulated capacity {cap}")
    slot = int(states[rank, 0])
    prev_rows = int(states[rank, 4 + (slot + 2) % 3])
    blocks = max(-(-tokens // world), -(-prev_rows // world))
    if blocks == 0:
        return
    _launch(
        max(1, min(programs, blocks)),
        bufs,
        bufs.view(torch.int16),
        bufs.shape[1],
        aborts[rank : rank + 1],
        (slot, prev_rows, blocks),
        states[rank],
        world,
        rank,
        cap,
        0,
        max_polls,
        residual_out,
        norm_out,
        q,
        sf,
        gemm2_out,
        perm,
        weights,
        shared,
        residual,
        gamma,
        routed_scaling,
        eps,
        weight_bias,
        quant,
        quant_scale,
        swizzled,
        phases,
        4,
    )


def fill_buffers(bufs: torch.Tensor) -> None:
    """Every element -> the sentinel (emulated buffers)."""
    bufs.view(torch.int16).fill_(SENTINEL_BITS)
