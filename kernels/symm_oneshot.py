"""One-launch MoE epilogue over symmetric memory: finalize + shared add + all-reduce + residual add
+
RMSNorm (+ FP8 / NVFP4), for small T on one node, with NVLink multicast never used.

The data carries its own arrival (Lamport-style): every data slot holds the sentinel -0.0 (bits
0x8000
in bf16 and fp16) until its partial lands, and a published partial never holds -0.0 (it is mapped to
+0.0, which changes no sum: x + (-0.0) == x + (+0.0) for every x != 0, and the rank-ordered sum
never
starts from the residual, so a sign of zero can only differ when the whole sum is zero). A reader
spins
on the data itself: no flags, no fence before a flag, no second round trip.

Per call, on every rank (all ranks launch the same grid, since T is the same on every rank), epoch
e,
slot s = e % 3:
  A. publish: each program finalizes (row, column chunk) items of its rank's partial
         partial[t] = round(routed_scaling * sum_k w[t,k] * gemm2_out[perm[t,k]] + shared[t])
     (fp32 accumulate, ONE rounding to the activation dtype, -0.0 -> +0.0) and stores it into
     slot [s][its rank] of every rank's symmetric buffer (its own included), plain stores.
  B. clear: the local slot (s + 2) % 3, used by the previous call, goes back to the sentinel for the
     rows that call used (its T is kept in device state), for all sources.
  C. reduce + norm: each program takes (row, column chunk) items, reads the row's W partials from
  its
     local buffer (volatile loads, all ranks' rows, the whole row: the sum of squares needs it)
     until
     none is the sentinel (bounded), sums them **in rank order** in fp32, adds the residual, and
     writes its chunk of residual_out, norm_out = round(x * rsqrt(mean(x^2) + eps) * (gamma +
     weight_bias)) and the quantized norm_out. Every rank reads the same rounded values in the same
     order with the same reduction tree, so outputs are bitwise identical on all ranks. Error: the
     partial's rounding plus each output's rounding (2 roundings to the activation dtype).
Phase A never waits, so no program waits for a program that waits for it (all publishes of all
programs precede, in their own program order, every wait).

Memory-ordering argument (no host state: CUDA graphs replay it):
- Epoch: state[0] in device memory holds e mod 3 (the slot; it never wraps). Each program loads it
  (and the previous slot's row count), then takes a ticket (atomic add on state[1], release, gpu
  scope:
  the loads are ordered before it). The program holding the last ticket has, through the release
  sequence of the counter and an acquire fence, seen every program's loads done; at its end it
  stores
  (e + 1) mod 3, this slot's T, and resets the counter. Launches on one stream are ordered, so the
  next call reads the next slot.
- A reader never uses a slot before it is written: it uses a value only once it differs from the
  sentinel, and each element is naturally aligned (2 bytes, single-copy atomic), so a torn or
  reordered arrival over NVLink shows as "not yet" and is polled again. The polls are volatile
  loads (L1 bypassed; the point of coherence of a rank's buffer is its own L2, where its own stores
  and
  its peers' NVLink stores land).
- A slot is never overwritten while a peer may still read it, and never read stale: rank r's slot
  s = e % 3 is written by peers in call e, read by r in call e, cleared by r in call e + 1 (after r
  saw
  every value of it in call e, so the clear is later in coherence order than the data), and written
  again by a peer p only in call e + 3. p starts call e + 3 only after its call e + 2 completed,
  which
  needed r's data of call e + 2, which r publishes only after its call e + 1 (the clear) completed:
  the clear precedes the new data at r's L2. Peers are at most one call apart (a rank finishes call
  e only with every peer's call-e data), so slot (e + 1) % 3 may be written by a peer running ahead
  while r is still in call e, and r clears only (e + 2) % 3: three slots, not two.
- The previous call's T is kept per slot in state[4 + slot]; the row counts differ per call, and the
  clear covers exactly the rows that call dirtied.
- T = 0 launches nothing on every rank (T is the same on all ranks), so epochs stay in step.
- The grid is at most the SM count (one program per SM fits), so every program that is waited on is
  resident.
- Timeout: the poll's exit condition is one block reduction over (pending sentinel | timer expired |
  abort word set), so every warp of a program leaves the loop on the same iteration and agrees on
  the
  outcome (a per-thread %globaltimer test would let warps leave on different iterations). On a
  timeout
  the program writes NaN outputs, an error word (bit 16 + the ranks whose data did not arrive) into
  pinned host memory (read by the host without a sync) and into state[2], and an abort word into
  every
  rank's header, so every later call on every rank fails at once instead of waiting (the bridge must
  be
  rebuilt).

Buffer layout per rank (bytes): a 256-byte header (int32 abort word at 0), then the data slots
[3][W][cap][H] of the activation dtype, all the sentinel at creation.

The same @triton.jit helpers (most in `symm_common`) serve the fused GPU kernel and the entry points
that run under
TRITON_INTERPRET=1 with emulated ranks (`emulate_publish`, `emulate_clear`, `emulate_reduce_norm`,
where the timer is a poll count): only the inline PTX (timer, fence) and the peer pointers are
GPU-only.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .quant import QUANT_NVFP4
from .symm_common import (
    ERR_ABORTED,  # noqa: F401 (re-exported)
    ERR_TIMEOUT,
    HEADER_BYTES,
    SENTINEL,  # noqa: F401 (re-exported)
    SENTINEL_BITS,  # noqa: F401 (re-exported)
    SLOTS,  # noqa: F401
    _clear_item,
    _fence_acq_rel_gpu_if,
    _finalize_chunk,
    _globaltimer,
    _missing_ranks,
    _gamma_row,
    _norm_quant_row,
    _payload_bits,
    _peer_ptr,
    _report_timeout,
    _round,
    _sf_padding_item,
    _tl_dtype,
    _wait_row,
    fill_sentinel,  # noqa: F401 (re-exported)
    row_block,
    sf_padding_items,
)

STATE_WORDS = (
    8  # slot (epoch mod 3), ticket counter, error word, unused, rows of slot 0, 1, 2, unused
)


def buffer_bytes(world: int, cap: int, hidden: int, elem_size: int) -> int:
    return HEADER_BYTES + SLOTS * world * cap * hidden * elem_size


# ------------------------------------------------------------------------------------------------
# arithmetic shared by the fused kernel and the emulation entry points
# ------------------------------------------------------------------------------------------------
@triton.jit
def _row_outputs(
    v,
    row,
    lo,
    hi,
    bad,
    residual_ptr,
    gamma_ptr,
    residual_out_ptr,
    norm_out_ptr,
    q_ptr,
    sf_ptr,
    hidden,
    eps,
    weight_bias,
    quant_scale,
    sf_cols,
    WORLD: tl.constexpr,
    WP: tl.constexpr,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    """From the row's W partials (int16 bits [WP, ROW_BLOCK]): the whole row's x and norm (each
    program
    of the row computes them identically), stored for columns [lo, hi) only (multiples of 64, so the
    masks stay constant over whole 16-byte vectors). bad != 0 writes NaN."""
    dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
    qi = tl.arange(0, WP)[:, None]
    vf = v.to(dtype, bitcast=True).to(tl.float32)
    s = tl.sum(tl.where(qi == 0, vf, 0.0), axis=0)  # exact: one nonzero term per column
    for q in tl.static_range(1, WORLD):  # rank order
        s += tl.sum(tl.where(qi == q, vf, 0.0), axis=0)
    cols = tl.arange(0, ROW_BLOCK)
    in_row = cols < hidden
    offs = row * hidden + cols
    x = tl.load(residual_ptr + offs, mask=in_row, other=0.0).to(tl.float32) + s
    x = tl.where((cols * 0 + bad) != 0, float("nan"), x)
    tl.store(residual_out_ptr + offs, _round(x, dtype), mask=in_row & (cols >= lo) & (cols < hi))
    _norm_quant_row(
        x,
        _gamma_row(gamma_ptr, hidden, weight_bias, ROW_BLOCK),
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
        QUANT,
        SWIZZLED,
        ROW_BLOCK,
        HW_CVT,
    )


@triton.jit(do_not_specialize=["tokens", "sf_rows", "rank", "timeout_us"])  # one compile per BLOCK1
def _fused_kernel(
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
    data_off,
    rank,
    routed_scaling,
    eps,
    weight_bias,
    quant_scale,
    sf_rows,
    sf_cols,
    timeout_us,
    block2,
    WORLD: tl.constexpr,
    WP: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    BLOCK1: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    HW_CVT: tl.constexpr,
    CLEAR_BLOCK: tl.constexpr,
    ABLATE: tl.constexpr = 0,
):
    # ABLATE (benchmarks only; results are wrong): 2 no peers (own slot only, both ranks), 3
    # exchange
    # only (publish constants, wait, no finalize loads, no outputs): where the time goes
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
    slot = tl.load(state_ptr)  # this call's slot, 0..2 (the epoch mod 3: it never wraps)
    prev = (slot + 2) % 3
    prev_rows = tl.load(state_ptr + 4 + prev)
    start = _globaltimer()
    slot_stride = cap.to(tl.int64) * hidden  # one source's rows
    local = _peer_ptr(ptrs_ptr, rank, tl.int16)

    # A. finalize + publish into slot [slot][rank] of every rank's buffer (never waits)
    chunks1 = tl.cdiv(hidden, BLOCK1)
    dst = data_off + (slot * WORLD + rank).to(tl.int64) * slot_stride
    for item in range(pid, tokens * chunks1, nprog):
        row = (item // chunks1).to(tl.int64)
        cols = (item % chunks1) * BLOCK1 + tl.arange(0, BLOCK1)
        if ABLATE == 3:
            bits = tl.full([BLOCK1], 0x3F80, tl.int16)
        else:
            bits = _payload_bits(
                _finalize_chunk(
                    gemm2_ptr,
                    perm_ptr,
                    weight_ptr,
                    shared_ptr,
                    row,
                    cols,
                    hidden,
                    routed_scaling,
                    TOP_K,
                    HAS_SHARED,
                ),
                dtype,
            )
        if ABLATE == 2:
            tl.store(local + dst + row * hidden + cols, bits, mask=cols < hidden)
        else:
            for q in tl.static_range(WORLD):
                tl.store(
                    _peer_ptr(ptrs_ptr, q, tl.int16) + dst + row * hidden + cols,
                    bits,
                    mask=cols < hidden,
                )

    # the ticket: one lane of a tensor atomic (a scalar one would broadcast its result through a
    # barrier
    # right here); relaxed, so it waits for none of the stores above; its predicate depends on both
    # state loads, so it is issued only after they returned. Its result is used only at the end.
    lane = tl.arange(0, BLOCK1)
    ticket = tl.atomic_add(
        state_ptr + 1 + lane * 0,
        lane * 0 + 1,
        mask=(lane == 0) & (slot >= 0) & (prev_rows >= 0),
        sem="relaxed",
        scope="gpu",
    )

    # B. the previous call's slot back to the sentinel (its rows, every source): overlaps the wait
    prev_base = local + data_off + (prev * WORLD).to(tl.int64) * slot_stride
    chunks_c = tl.cdiv(hidden, CLEAR_BLOCK)
    for q in tl.static_range(WORLD):
        for item in range(pid, prev_rows * chunks_c, nprog):
            _clear_item(item, prev_base + q * slot_stride, hidden, CLEAR_BLOCK)

    # C. wait for the row's partials (the data is the flag), reduce in rank order, norm, quant
    abort_ptr = tl.load(ptrs_ptr + rank).to(tl.pointer_type(tl.int32))
    src = local + data_off + (slot * WORLD).to(tl.int64) * slot_stride
    timeout_ns = timeout_us.to(tl.int64) * 1000
    chunks2 = tl.cdiv(hidden, block2)
    for item in range(pid, tokens * chunks2, nprog):
        row = (item // chunks2).to(tl.int64)
        lo = tl.multiple_of((item % chunks2) * block2, 64)
        v, status = _wait_row(
            src,
            slot_stride,
            row,
            hidden,
            abort_ptr,
            start,
            timeout_ns,
            rank if ABLATE == 2 else -1,
            -1,
            WORLD,
            WP,
            ROW_BLOCK,
            False,
            True,
        )
        bad = ((status & 5) != 0).to(tl.int32)  # still pending after the timeout, or aborted
        if bad != 0:  # `status` is uniform over the program, so is this branch
            _report_timeout(
                _missing_ranks(v, WORLD, WP), ptrs_ptr, state_ptr, abort_ptr, rank, WORLD
            )
        if ABLATE != 3:
            _row_outputs(
                v,
                row,
                lo,
                lo + block2,
                bad,
                residual_ptr,
                gamma_ptr,
                residual_out_ptr,
                norm_out_ptr,
                q_ptr,
                sf_ptr,
                hidden,
                eps,
                weight_bias,
                quant_scale,
                sf_cols,
                WORLD,
                WP,
                QUANT,
                SWIZZLED,
                ROW_BLOCK,
                HW_CVT,
            )
    if QUANT == 2:
        if SWIZZLED:
            for item in range(pid, tl.cdiv(sf_rows - tokens, 32) * tl.cdiv(sf_cols, 128), nprog):
                _sf_padding_item(item, sf_ptr, tokens, sf_rows, sf_cols)

    # D. the last ticket advances the epoch and records this slot's rows for the next call's clear
    last = (lane == 0) & (ticket == nprog - 1)
    last = last & (_fence_acq_rel_gpu_if(last.to(tl.int32)) == 0)  # the stores depend on the fence
    tl.store(state_ptr + 4 + slot + lane * 0, lane * 0 + tokens, mask=last)
    tl.store(state_ptr + 1 + lane * 0, lane * 0, mask=last)
    tl.store(state_ptr + lane * 0, lane * 0 + (slot + 1) % 3, mask=last)


# ------------------------------------------------------------------------------------------------
# emulation entry points (CPU CI, any W in one process); slots: [W, T, H] activation dtype, one slot
# ------------------------------------------------------------------------------------------------
@triton.jit
def _emu_publish_kernel(
    gemm2_ptr,
    perm_ptr,
    weight_ptr,
    shared_ptr,
    slots_ptr,
    tokens,
    hidden,
    rank,
    routed_scaling,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK1: tl.constexpr,
    DTYPE: tl.constexpr,
):
    chunks1 = tl.cdiv(hidden, BLOCK1)
    item = tl.program_id(0)
    row = (item // chunks1).to(tl.int64)
    cols = (item % chunks1) * BLOCK1 + tl.arange(0, BLOCK1)
    bits = _payload_bits(
        _finalize_chunk(
            gemm2_ptr,
            perm_ptr,
            weight_ptr,
            shared_ptr,
            row,
            cols,
            hidden,
            routed_scaling,
            TOP_K,
            HAS_SHARED,
        ),
        DTYPE,
    )
    tl.store(slots_ptr + (rank * tokens + row) * hidden + cols, bits, mask=cols < hidden)


@triton.jit
def _emu_clear_kernel(slots_ptr, hidden, CLEAR_BLOCK: tl.constexpr):
    _clear_item(tl.program_id(0), slots_ptr, hidden, CLEAR_BLOCK)


@triton.jit
def _emu_reduce_kernel(
    slots_ptr,
    abort_ptr,
    status_ptr,
    residual_ptr,
    gamma_ptr,
    residual_out_ptr,
    norm_out_ptr,
    q_ptr,
    sf_ptr,
    tokens,
    hidden,
    eps,
    weight_bias,
    quant_scale,
    sf_rows,
    sf_cols,
    max_polls,
    block2,
    WORLD: tl.constexpr,
    WP: tl.constexpr,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    """One program per item: (row, chunk) items first, then swizzled padding items.
    status_ptr[item]:
    0, or ERR_TIMEOUT | missing ranks (the poll count ran out), or the abort word."""
    chunks2 = tl.cdiv(hidden, block2)
    item = tl.program_id(0)
    if item < tokens * chunks2:
        row = (item // chunks2).to(tl.int64)
        v, status = _wait_row(
            slots_ptr,
            tokens * hidden,
            row,
            hidden,
            abort_ptr,
            0,
            max_polls,
            -1,
            -1,
            WORLD,
            WP,
            ROW_BLOCK,
            True,
            True,
        )
        bad = ((status & 5) != 0).to(tl.int32)
        err = tl.where(
            (status & 4) != 0, tl.load(abort_ptr), ERR_TIMEOUT | _missing_ranks(v, WORLD, WP)
        )
        tl.store(status_ptr + item, tl.where(bad != 0, err, 0))
        lo = (item % chunks2) * block2
        _row_outputs(
            v,
            row,
            lo,
            lo + block2,
            bad,
            residual_ptr,
            gamma_ptr,
            residual_out_ptr,
            norm_out_ptr,
            q_ptr,
            sf_ptr,
            hidden,
            eps,
            weight_bias,
            quant_scale,
            sf_cols,
            WORLD,
            WP,
            QUANT,
            SWIZZLED,
            ROW_BLOCK,
            HW_CVT,
        )
    else:
        if QUANT == 2:
            if SWIZZLED:
                _sf_padding_item(item - tokens * chunks2, sf_ptr, tokens, sf_rows, sf_cols)


def emulate_publish(
    slots: torch.Tensor,
    rank: int,
    gemm2_out: torch.Tensor,
    perm: torch.Tensor,
    weights: torch.Tensor,
    shared: Optional[torch.Tensor],
    routed_scaling: float,
    block1: int = 64,
) -> None:
    """Rank `rank`'s phase A into slots [W, T, H] (activation dtype), the stand-in for slot [s][src]
    of every rank's buffer (all ranks hold the same copy)."""
    tokens, top_k = perm.shape
    hidden = gemm2_out.shape[1]
    if tokens == 0:
        return
    _emu_publish_kernel[(tokens * triton.cdiv(hidden, block1),)](
        gemm2_out,
        perm,
        weights,
        shared if shared is not None else gemm2_out,
        slots.view(torch.int16),
        tokens,
        hidden,
        rank,
        float(routed_scaling),
        TOP_K=top_k,
        HAS_SHARED=shared is not None,
        BLOCK1=block1,
        DTYPE=_tl_dtype(slots.dtype),
    )


def emulate_clear(slots: torch.Tensor, clear_block: int = 64) -> None:
    """Phase B over slots [W, T, H]: every row of every source back to the sentinel."""
    world, tokens, hidden = slots.shape
    if world * tokens == 0:
        return
    _emu_clear_kernel[(world * tokens * triton.cdiv(hidden, clear_block),)](
        slots.view(torch.int16), hidden, CLEAR_BLOCK=clear_block
    )


def emulate_reduce_norm(
    slots: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    residual_out: torch.Tensor,
    norm_out: torch.Tensor,
    q: torch.Tensor,
    sf: torch.Tensor,
    eps: float,
    weight_bias: float,
    quant: int,
    quant_scale: float,
    swizzled: bool,
    block2: int = 64,
    max_polls: int = 3,
    abort_word: int = 0,
) -> torch.Tensor:
    """Phase C from slots [W, T, H] on any rank (polls at most max_polls times). q: uint8 ([T, H]
    fp8
    codes / [T, H/2] fp4); sf: uint8. Returns the per-item status words (int32; 0 = fine)."""
    world, tokens, hidden = slots.shape
    rb = row_block(hidden)
    block2 = min(block2, rb)
    status = torch.zeros(
        tokens * triton.cdiv(hidden, block2), dtype=torch.int32, device=slots.device
    )
    if tokens == 0:
        return status
    sf_rows, sf_cols = (sf.shape[0], sf.shape[1]) if quant == QUANT_NVFP4 else (tokens, 0)
    items = tokens * triton.cdiv(hidden, block2)
    grid = items + (
        sf_padding_items(tokens, sf_rows, sf_cols) if quant == QUANT_NVFP4 and swizzled else 0
    )
    abort = torch.tensor([abort_word], dtype=torch.int32, device=slots.device)
    _emu_reduce_kernel[(grid,)](
        slots.view(torch.int16),
        abort,
        status,
        residual,
        gamma,
        residual_out,
        norm_out,
        q,
        sf,
        tokens,
        hidden,
        float(eps),
        float(weight_bias),
        float(quant_scale),
        sf_rows,
        sf_cols,
        max_polls,
        block2,
        WORLD=world,
        WP=triton.next_power_of_2(world),
        QUANT=quant,
        SWIZZLED=swizzled,
        ROW_BLOCK=rb,
        HW_CVT=slots.is_cuda,
    )
    return status


# ------------------------------------------------------------------------------------------------
# the fused launch
# ------------------------------------------------------------------------------------------------
def default_launch(tokens: int, hidden: int, num_sms: int = 132) -> tuple[int, int, int]:
    """(BLOCK1, block2, num_warps). BLOCK1 (finalize + publish chunk, compiled in): 1024 while T *
    chunks
    stays within two waves of programs (T=1 spreads the K gathers of a row over 7 SMs at H=7168),
    else
    whole rows (more bytes in flight per program at large T); two values, so few compiles. block2
    (which columns a program stores in phase C; a runtime value, a multiple of 64): whole rows at T
    <= 2,
    else the row split over as many programs as one wave allows. Every program of a row reads the
    whole
    row's partials (local) for its sum of squares. Measured on 2x H200, H=7168 (us, graph): T=1
    (512, 512) 6.35, (1024, 512) 6.12, (512, row) 5.72; T=16 (512, 896) 8.70, (1024, 896) 7.82,
    (512, row) 8.97."""
    rb = row_block(hidden)
    block1 = 1024 if rb > 1024 and tokens * triton.cdiv(hidden, 1024) <= 2 * num_sms else rb
    per_row = max(1, num_sms // max(tokens, 1))
    block2 = rb if tokens <= 2 else min(rb, max(512, -(-triton.cdiv(hidden, per_row) // 64) * 64))
    return block1, block2, 8 if rb >= 4096 else 4


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
    launch: Optional[tuple[int, int, int]] = None,
    ablate: int = 0,
) -> None:
    """One launch. `ws`: ptrs (int64 [W + 1]: every rank's buffer address, then the pinned error
    word's),
    state (int32 [8] device: epoch, ticket counter, error, -, rows of slot 0/1/2), world, rank, cap,
    data_off (int16 elements before slot 0), num_sms, timeout_ns. T == 0 launches nothing (on every
    rank). T must be <= ws.cap."""
    tokens, top_k = perm.shape
    hidden = residual.shape[1]
    if tokens == 0:
        return
    block1, block2, warps = launch or default_launch(tokens, hidden, ws.num_sms)
    rb = row_block(hidden)
    block1, block2 = min(block1, rb), min(block2, rb)
    assert block2 % 64 == 0 and block1 % 64 == 0
    items = max(tokens * triton.cdiv(hidden, block1), tokens * triton.cdiv(hidden, block2))
    nprog = max(1, min(ws.num_sms, items))
    sf_rows, sf_cols = (sf.shape[0], sf.shape[1]) if quant == QUANT_NVFP4 else (tokens, 0)
    _fused_kernel[(nprog,)](
        ws.ptrs,
        ws.state,
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
        ws.cap,
        ws.data_off,
        ws.rank,
        float(routed_scaling),
        float(eps),
        float(weight_bias),
        float(quant_scale),
        sf_rows,
        sf_cols,
        ws.timeout_ns // 1000,
        block2,
        WORLD=ws.world,
        WP=triton.next_power_of_2(ws.world),
        TOP_K=top_k,
        HAS_SHARED=shared is not None,
        QUANT=quant,
        SWIZZLED=swizzled,
        BLOCK1=block1,
        ROW_BLOCK=rb,
        HW_CVT=True,
        CLEAR_BLOCK=min(1024, rb),
        ABLATE=ablate,
        num_warps=warps,
    )
