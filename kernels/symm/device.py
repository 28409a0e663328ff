"""The device side of the symmetric-memory protocol (`protocol`): the @triton.jit helpers that
both symmetric-memory kernels call, so the ticket, the epoch advance, the bounded wait, the publish
and the error report are written once.

Every helper runs under TRITON_INTERPRET=1 too (peer pointers are table entries cast to pointers,
which the interpreter follows as host addresses), except the two inline-PTX pieces, the GPU timer
and the epoch fence, which the `EMULATED` hook (see `protocol`) swaps for a poll count
and for nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusion_bridge.kernels.symm import protocol as P
from fusion_bridge.kernels.rounding import round_to


# ---- the call's place in the epoch sequence -----------------------------------------------------
@triton.jit
def call_state(state_ptr):
    """(slot, previous slot, rows the previous call used in it), from device state."""
    slot = tl.load(state_ptr)  # this call's slot, 0..2 (the epoch mod 3: it never wraps)
    prev = (slot + 2) % 3
    return slot, prev, tl.load(state_ptr + P.STATE_ROWS + prev)


@triton.jit
def take_ticket(state_ptr, slot, prev_rows, LANES: tl.constexpr):
    """One lane of a tensor atomic (a scalar one would broadcast its result through a barrier right
    here); relaxed, so it waits for no earlier store; its predicate depends on both state loads, so
    it is issued only after they returned. The result is used only by `advance_epoch`."""
    lane = tl.arange(0, LANES)
    return tl.atomic_add(
        state_ptr + P.STATE_TICKET + lane * 0,
        lane * 0 + 1,
        # the scalars compared as blocks: Triton 3.7+'s interpreter gives `block & scalar`
        # an int32 mask, which its atomics refuse (the compiled code is the same)
        mask=(lane == 0) & (lane * 0 + slot >= 0) & (lane * 0 + prev_rows >= 0),
        sem="relaxed",
        scope="gpu",
    )


@triton.jit
def advance_epoch(state_ptr, ticket, slot, tokens, LANES: tl.constexpr, EMULATED: tl.constexpr):
    """The program holding the last ticket has (through the counter's release sequence and an
    acquire fence) seen every program's state loads done: it records this slot's rows for the next
    call's clear, resets the counter and advances the slot."""
    lane = tl.arange(0, LANES)
    last = (lane == 0) & (ticket == tl.num_programs(0) - 1)
    if not EMULATED:
        last = last & (_fence_acq_rel_gpu_if(last.to(tl.int32)) == 0)  # stores depend on the fence
    tl.store(state_ptr + P.STATE_ROWS + slot + lane * 0, lane * 0 + tokens, mask=last)
    tl.store(state_ptr + P.STATE_TICKET + lane * 0, lane * 0, mask=last)
    tl.store(state_ptr + lane * 0, lane * 0 + (slot + 1) % 3, mask=last)


# ---- publish, wait, clear -----------------------------------------------------------------------
@triton.jit
def peer_ptr(ptrs_ptr, q, dtype: tl.constexpr):
    """Rank q's buffer as a `dtype` pointer. Buffers are 256-byte aligned: saying so lets the slot
    loads and stores vectorize (the compiler knows nothing about an integer cast to a pointer)."""
    return tl.multiple_of(tl.load(ptrs_ptr + q).to(tl.pointer_type(dtype)), 16)


@triton.jit
def abort_word_ptr(ptrs_ptr, rank):
    return tl.load(ptrs_ptr + rank).to(tl.pointer_type(tl.int32))


@triton.jit
def payload_bits(acc, dtype: tl.constexpr):
    """fp32 -> the int16 bits to publish: one RNE rounding to `dtype`; -0.0 (the sentinel) -> +0.0
    (no sum changes: only an all-zero sum could differ, in the sign of its zero)."""
    bits = round_to(acc, dtype).to(tl.int16, bitcast=True)
    return tl.where(bits == P.SENTINEL_BITS, 0, bits).to(tl.int16)


@triton.jit
def start_clock(EMULATED: tl.constexpr):
    if EMULATED:
        return 0
    else:
        return _globaltimer()


@triton.jit
def _poll_status(v, abort_ptr, start, timeout, polls, EMULATED: tl.constexpr):
    """One int32, the same in every thread of the program (a block reduction, so every warp leaves
    the poll on the same iteration): POLL_PENDING some value is still the sentinel, POLL_LATE the
    time (EMULATED: the poll count) ran out, POLL_ABORTED the abort word is set (protocol)."""
    if EMULATED:
        late = polls >= timeout
    else:
        late = (_globaltimer() - start) > timeout
    ab = tl.load(abort_ptr, volatile=True)
    flags = (
        (v == P.SENTINEL_BITS).to(tl.int32) * P.POLL_PENDING
        | (late.to(tl.int32) * P.POLL_LATE)
        | ((ab != 0).to(tl.int32) * P.POLL_ABORTED)
    )
    return tl.max(
        tl.max(flags, axis=0), axis=0
    )  # sources first: they sit in each thread's registers


@triton.jit
def wait_row(
    src_ptr,
    src_stride,
    row,
    hidden,
    abort_ptr,
    start,
    timeout,
    skip_q,
    WORLD: tl.constexpr,
    WP: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    EMULATED: tl.constexpr,
):
    """Poll row `row` of the WORLD sources (int16 bits [WP, ROW_BLOCK], source q at src_ptr +
    q * src_stride) until no value is the sentinel, the time runs out or the abort word is set.
    skip_q: a source never read (a rank's own partial, kept in registers; -1 for none), read as 0.
    Returns (bits, status); status & POLL_FAILED != 0: the wait failed (`report_error`)."""
    q = tl.arange(0, WP)[:, None]
    cols = tl.arange(0, ROW_BLOCK)[None, :]
    mask = (q < WORLD) & (cols < hidden) & (q != skip_q)
    ptrs = src_ptr + q.to(tl.int64) * src_stride + row * hidden + cols
    v = tl.load(ptrs, mask=mask, other=0, volatile=True)
    polls = 1
    status = _poll_status(v, abort_ptr, start, timeout, polls, EMULATED)
    while status == P.POLL_PENDING:
        v = tl.load(ptrs, mask=mask, other=0, volatile=True)
        polls += 1
        status = _poll_status(v, abort_ptr, start, timeout, polls, EMULATED)
    return v, status


@triton.jit
def missing_ranks(v, WORLD: tl.constexpr, WP: tl.constexpr):
    """Bit q set when source q still holds a sentinel."""
    pending = tl.max((v == P.SENTINEL_BITS).to(tl.int32), axis=1)  # [WP]
    qs = tl.arange(0, WP)
    return tl.sum(tl.where(qs < WORLD, pending << qs, 0), axis=0)


@triton.jit
def report_error(who, ptrs_ptr, state_ptr, abort_ptr, rank, WORLD: tl.constexpr):
    """A wait failed. The error word: this rank timed out waiting for ranks `who` (a bit mask), or a
    peer (or a sibling program of this rank: then it is this rank's own timeout) set the abort word.
    It goes to the pinned host word (ptrs[WORLD], read without a sync) and state; if no abort is
    under way, every rank (itself included) is told to stop waiting from now on."""
    ab = tl.load(abort_ptr, volatile=True)
    own = ((ab >> P.ERR_RANK_SHIFT) & P.ERR_RANK_MASK) == rank
    err = tl.where(
        ab == 0, P.ERR_TIMEOUT | who, tl.where(own, P.ERR_TIMEOUT | (ab & P.ERR_MISSED), ab)
    )
    tl.store(tl.load(ptrs_ptr + WORLD).to(tl.pointer_type(tl.int32)), err)
    tl.store(state_ptr + P.STATE_ERROR, err)
    if ab == 0:
        for q in tl.static_range(WORLD):
            tl.atomic_xchg(
                abort_word_ptr(ptrs_ptr, q),
                # the tensor first: under Triton 3.7+'s interpreter `constexpr | tensor` stays a
                # constexpr wrapping the tensor, which atomic_xchg cannot take
                who | (rank << P.ERR_RANK_SHIFT) | P.ERR_ABORTED,
                sem="relaxed",
                scope="sys",
            )


@triton.jit
def clear_item(item, slot_ptr, hidden, CLEAR_BLOCK: tl.constexpr):
    """Item (source row r of a [rows, H] block, column chunk) -> the sentinel."""
    chunks = tl.cdiv(hidden, CLEAR_BLOCK)
    r = (item // chunks).to(tl.int64)
    cols = (item % chunks) * CLEAR_BLOCK + tl.arange(0, CLEAR_BLOCK)
    tl.store(
        slot_ptr + r * hidden + cols,
        tl.full([CLEAR_BLOCK], P.SENTINEL_BITS, tl.int16),
        mask=cols < hidden,
    )


# ---- GPU only: inline PTX -----------------------------------------------------------------------
@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _fence_acq_rel_gpu_if(pred):
    """fence.acq_rel.gpu in the lanes where pred != 0; returns 0 (later stores depend on it)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $1, 0; @p fence.acq_rel.gpu; mov.u32 $0, 0; }",
        "=r,r",
        [pred],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
