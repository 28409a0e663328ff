"""The ring two-shot's buffer layout and its device-side protocol pieces (see `symm_ring` for the
design and the ordering argument).

Buffer per rank: a 256-byte header (int32 abort word at byte 0, int64 release counters [SLOTS] at
byte 64), then SLOTS slots, each [W][CW][H] reduce-scatter rows (source, owner row) followed by
[W][CW][H] all-gather rows (owner, owner row), CW = ceil(C / W), all the sentinel at creation.
Device state per rank: int64 [STATE_WORDS] = (chunk base, ticket, error word, unused).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .symm_common import (
    HEADER_BYTES,
    _globaltimer,
    _poll_status,
    _report_timeout,
    _timeout_word,
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
