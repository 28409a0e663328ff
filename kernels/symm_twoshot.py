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

Buffer layout per rank: see `symm_protocol` (a 256-byte header with the abort word, then 3 slots,
each [W][cap_blocks][H] reduce-scatter rows (source, block) followed by [cap][H] all-gather rows, of
the activation dtype, all the sentinel at creation).

The CPU tests (ranks' buffers in host memory, one part of a call per launch, the timer a poll count)
and the benchmarks' ablations run this very kernel body through the two hooks that `symm_protocol`
documents (PHASES, EMULATED); kernels/symm_testing.py is their only caller.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from . import symm_protocol as P
from .add_rmsnorm import norm_quant_row
from .finalize_add import finalize_row
from .quant import QUANT_NVFP4, row_block, sf_padding_item, sf_padding_items
from .symm_device import (
    abort_word_ptr,
    advance_epoch,
    call_state,
    clear_row,
    missing_ranks,
    payload_bits,
    peer_ptr,
    report_error,
    start_clock,
    take_ticket,
    wait_row,
)
from .symm_protocol import SymmLayer

PUBLISH = tl.constexpr(P.PUBLISH)
REDUCE = tl.constexpr(P.REDUCE)
NORM = tl.constexpr(P.NORM)
CLEAR = tl.constexpr(P.CLEAR)
EPOCH = tl.constexpr(P.EPOCH)


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
    acc = finalize_row(
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
    )
    return payload_bits(acc, dtype)


@triton.jit(do_not_specialize=["tokens", "sf_rows", "rank", "timeout", "cap", "capb", "pad_items"])
def _twoshot_kernel(
    ptrs_ptr,
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
    pad_items,
    timeout,
    WORLD: tl.constexpr,
    WP: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    HW_CVT: tl.constexpr,
    PHASES: tl.constexpr = P.ALL_PHASES,  # test/benchmark hook (symm_protocol)
    EMULATED: tl.constexpr = False,  # test hook (symm_protocol)
):
    dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    slot, prev, prev_rows = call_state(state_ptr)
    blocks_to_walk = tl.maximum(tl.cdiv(tokens, WORLD), tl.cdiv(prev_rows, WORLD))
    if EPOCH & PHASES:  # the ticket (symm_device.take_ticket); used only at the end
        ticket = take_ticket(state_ptr, slot, prev_rows, 32)
    start = start_clock(EMULATED)
    if EMULATED:
        timeout_ns = timeout  # polls
    else:
        timeout_ns = timeout.to(tl.int64) * 1000
    abort_ptr = abort_word_ptr(ptrs_ptr, rank)
    cols = tl.arange(0, ROW_BLOCK)
    in_row = cols < hidden
    zero64 = tl.full([], 0, tl.int64)
    row_elems = zero64 + hidden  # int64; keeps hidden's divisibility (vector stores)
    slot_len = (WORLD * capb + cap).to(tl.int64) * row_elems
    rs_stride = capb.to(tl.int64) * row_elems  # one source's reduce-scatter rows
    local = peer_ptr(ptrs_ptr, rank, tl.int16) + data_off
    rs_here = local + slot * slot_len
    ag_here = rs_here + WORLD * rs_stride
    nblocks = tl.cdiv(tokens, WORLD)
    prev_blocks = tl.cdiv(prev_rows, WORLD)
    qi = tl.arange(0, WP)[:, None]
    g = tl.load(gamma_ptr + cols, mask=in_row, other=0.0).to(tl.float32) + weight_bias  # once

    last = -1
    for b in range(pid, blocks_to_walk, nprog):
        if (
            NORM & PHASES
        ):  # past this call's blocks only clears remain: finish the last gather first
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
                    EMULATED,
                )
                last = -1
        if CLEAR & PHASES:  # clear what the previous call wrote into this rank's previous slot
            if b < prev_blocks:
                old = local + prev * slot_len
                for q in tl.static_range(WORLD):
                    if q != rank:
                        if b * WORLD + rank < prev_rows:
                            clear_row(old + q * rs_stride + b * row_elems, hidden, ROW_BLOCK)
                    if b * WORLD + q < prev_rows:  # every row of the block, its own included
                        clear_row(
                            old + WORLD * rs_stride + (b * WORLD + q) * row_elems, hidden, ROW_BLOCK
                        )
        if b < nblocks:
            if PUBLISH & PHASES:  # push the partials of block b's rows owned by peers
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
                        dst = peer_ptr(ptrs_ptr, q, tl.int16) + data_off + slot * slot_len
                        tl.store(dst + rank * rs_stride + b * row_elems + cols, bits, mask=in_row)
            if REDUCE & PHASES:  # reduce the owned row of block b, push it to every rank
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
                    v, status = wait_row(
                        rs_here,
                        rs_stride,
                        b,
                        hidden,
                        abort_ptr,
                        start,
                        timeout_ns,
                        rank,
                        WORLD,
                        WP,
                        ROW_BLOCK,
                        EMULATED,
                    )
                    bad = ((status & 5) != 0).to(tl.int32)
                    if bad != 0:  # uniform over the program
                        report_error(
                            missing_ranks(v, WORLD, WP), ptrs_ptr, state_ptr, abort_ptr, rank, WORLD
                        )
                    vf = v.to(dtype, bitcast=True).to(tl.float32)
                    s = tl.where(rank == 0, own, tl.sum(tl.where(qi == 0, vf, 0.0), axis=0))
                    for q in tl.static_range(1, WORLD):  # rank order, the own partial in its place
                        s += tl.where(rank == q, own, tl.sum(tl.where(qi == q, vf, 0.0), axis=0))
                    x = res.to(tl.float32) + s
                    x = tl.where((cols * 0 + bad) != 0, float("nan"), x)
                    xbits = payload_bits(x, dtype)
                    for q in tl.static_range(WORLD):  # its own buffer too: every rank norms alike
                        dst = peer_ptr(ptrs_ptr, q, tl.int16) + data_off + slot * slot_len
                        tl.store(dst + WORLD * rs_stride + t * row_elems + cols, xbits, mask=in_row)
            if NORM & PHASES:
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
                        EMULATED,
                    )
            last = b
    if NORM & PHASES:
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
                EMULATED,
            )
        if QUANT == 2:
            if SWIZZLED:
                for item in range(pid, pad_items, nprog):
                    sf_padding_item(item, sf_ptr, tokens, sf_rows, sf_cols)

    if EPOCH & PHASES:  # the last ticket advances the epoch, records this slot's rows
        advance_epoch(state_ptr, ticket, slot, tokens, 32, EMULATED)


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
    EMULATED: tl.constexpr,
):
    """Block b's rows, this rank's own included: wait for the owner's reduced row, store it as
    residual_out, norm it. Every rank runs this same code on every row, so norm_out's reduction
    order (which follows the compiler's layout of the row) is the same everywhere: bitwise-identical
    outputs."""
    dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
    cols = tl.arange(0, ROW_BLOCK)
    in_row = cols < hidden
    for q in tl.static_range(WORLD):
        t = tl.full([], 0, tl.int64) + b * WORLD + q
        if t < tokens:
            v, status = wait_row(
                ag_here, 0, t, hidden, abort_ptr, start, timeout_ns, -1, 1, 1, ROW_BLOCK, EMULATED
            )
            bad = ((status & 5) != 0).to(tl.int32)
            if bad != 0:
                report_error(1 << q, ptrs_ptr, state_ptr, abort_ptr, rank, WORLD)
            x = tl.sum(v.to(dtype, bitcast=True).to(tl.float32), axis=0)  # [1, RB] -> [RB], exact
            x = tl.where((cols * 0 + bad) != 0, float("nan"), x)
            xr = x.to(dtype)  # exact (or NaN)
            tl.store(residual_out_ptr + t * hidden + cols, xr, mask=in_row)
            norm_quant_row(
                tl.where(in_row, xr.to(tl.float32), 0.0),
                g,
                t,
                0,
                ROW_BLOCK,
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
                True,  # overflow-safe, as every norm of ours (a branch taken only on overflow)
            )


class TwoshotShape(NamedTuple):
    """A launch shape: programs (capped at the SM count: every program must be resident), warps."""

    programs: Optional[int]
    warps: Optional[int]


def default_warps(hidden: int) -> int:
    """Measured on one H200, world 1 (benchmarks/twoshot_local.py): at H=4096 16 warps beat 8 by
    19-23%; at H=7168 they tie, and 8 leave more registers per thread for the W partials of a wider
    world."""
    rb = row_block(hidden)
    return 16 if rb == 4096 else 8 if rb > 4096 else 4


def call_args(
    layer: SymmLayer,
    shape: Optional[TwoshotShape],
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
) -> tuple[int, tuple, dict]:
    """(programs, positional args, constexprs + num_warps) of one call; 0 < T <= layer.cap."""
    tokens, top_k = perm.shape
    if tokens > layer.cap:  # rows past the capacity would land in the next slot or past the buffer
        raise ValueError(f"symm_twoshot: T={tokens} exceeds the workspace's {layer.cap} tokens")
    hidden = layer.hidden
    programs, warps = shape or (None, None)
    quant = layer.quant
    sf_rows, sf_cols = (sf.shape[0], sf.shape[1]) if quant.code == QUANT_NVFP4 else (tokens, 0)
    pad = sf_padding_items(tokens, sf_rows, sf_cols) if quant.code == QUANT_NVFP4 else 0
    args = (
        layer.ptrs,
        layer.state,
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
        layer.cap,
        P.cap_blocks(layer.world, layer.cap),
        layer.data_off,
        layer.rank,
        layer.routed_scaling,
        layer.eps,
        layer.weight_bias,
        quant.scale,
        sf_rows,
        sf_cols,
        pad if quant.swizzled else 0,
        layer.timeout_us,
    )
    constexprs = dict(
        WORLD=layer.world,
        WP=triton.next_power_of_2(layer.world),
        TOP_K=top_k,
        HAS_SHARED=shared is not None,
        QUANT=quant.code,
        SWIZZLED=quant.swizzled,
        ROW_BLOCK=row_block(hidden),
        HW_CVT=residual.is_cuda,
        num_warps=warps or default_warps(hidden),
    )
    # enough programs for the previous call's clear too (its T is in device state, unknown here): a
    # small call after a large one would otherwise leave one program clearing thousands of rows
    grid = max(1, min(programs or layer.num_sms, layer.num_sms, -(-layer.cap // layer.world)))
    return grid, args, constexprs


KERNEL = _twoshot_kernel


def launch(layer: SymmLayer, *, shape: Optional[TwoshotShape] = None, **tensors) -> None:
    """One call on the GPU; `tensors` as for symm_oneshot.launch. T == 0 launches nothing (on every
    rank); T must be <= layer.cap."""
    if tensors["perm"].shape[0] == 0:
        return
    programs, args, constexprs = call_args(layer, shape, **tensors)
    _twoshot_kernel[(programs,)](*args, **constexprs)
