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
# one chunk's releases add exactly this to its slot's counter, whatever the program count P
# (program 0 adds UNIT - P + 1, every other 1): calls with different launch shapes share one ring
_UNIT = tl.constexpr(1 << 20)


def rows_per_source(world: int, chunk: int) -> int:
    return -(-chunk // world)


def slot_elems(world: int, chunk: int, hidden: int) -> int:
    """Elements of one slot: reduce-scatter [W][CW][H], then all-gather [W][CW][H]."""
    return 2 * world * rows_per_source(world, chunk) * hidden


def buffer_bytes(world: int, chunk: int, hidden: int, elem_size: int) -> int:
    return HEADER_BYTES + SLOTS * slot_elems(world, chunk, hidden) * elem_size


@triton.jit
def rank_buf(ptrs_ptr, bufs_ptr, buf_elems, q, EMU: tl.constexpr):
    """Rank q's buffer base (int16 elements, header included): GPU, its symmetric address (256-byte
    aligned: saying so lets slot accesses vectorize); EMU, a row of the emulated buffers."""
    if EMU:
        return bufs_ptr + q * buf_elems
    else:
        return tl.multiple_of(tl.load(ptrs_ptr + q).to(tl.pointer_type(tl.int16)), 16)


@triton.jit
def slot_base(ptrs_ptr, bufs_ptr, buf_elems, q, slot, hidden, chunk, WORLD: tl.constexpr, EMU):
    """Rank q's slot `slot` (its reduce-scatter rows; the all-gather rows follow W * CW rows on)."""
    src_stride = tl.cdiv(chunk, WORLD).to(tl.int64) * hidden
    base = rank_buf(ptrs_ptr, bufs_ptr, buf_elems, q, EMU) + _HEAD_ELEMS
    return base + slot * 2 * WORLD * src_stride


@triton.jit
def fail(who, abort_ptr, ptrs_ptr, state_ptr, rank, WORLD: tl.constexpr, EMU: tl.constexpr):
    """A wait ran out: the error word (and, on the GPU, the pinned host word and every rank's abort
    word)."""
    if EMU:
        err, _ = _timeout_word(who, abort_ptr, rank)
        tl.store(state_ptr + 2, err.to(tl.int64))
    else:
        _report_timeout(who, ptrs_ptr, state_ptr, abort_ptr, rank, WORLD)


@triton.jit
def wait_tile(ptrs, mask, abort_ptr, start, timeout, EMU: tl.constexpr):
    """Poll a 2-D tile of int16 bits until no element is the sentinel (or time / abort): (bits,
    1 if it failed). Its status is a block reduction, so when it returns every thread's load of the
    final bits has completed (the tile may be cleared right after)."""
    v = tl.load(ptrs, mask=mask, other=0, volatile=True)
    polls = 1
    status = _poll_status(v, abort_ptr, start, timeout, polls, EMU)
    while status == 1:
        v = tl.load(ptrs, mask=mask, other=0, volatile=True)
        polls += 1
        status = _poll_status(v, abort_ptr, start, timeout, polls, EMU)
    return v, ((status & 5) != 0).to(tl.int32)


@triton.jit
def _read_counters(ptrs_ptr, emu_freed_ptr, slot, WORLD: tl.constexpr, EMU: tl.constexpr):
    """int64 [32]: lane q < W holds rank q's release counter of `slot` (GPU: all W read at once,
    system-scope acquire)."""
    lane = tl.arange(0, 32)
    live = lane < WORLD
    if EMU:
        return tl.load(emu_freed_ptr + lane * _SLOTS + slot, mask=live, other=0)
    else:
        base = tl.load(ptrs_ptr + lane, mask=live, other=0)
        cnt = (base + _FREED_BYTE).to(tl.pointer_type(tl.int64)) + slot
        return tl.atomic_add(cnt, lane.to(tl.int64) * 0, mask=live, sem="acquire", scope="sys")


@triton.jit
def wait_slot_free(
    ptrs_ptr, emu_freed_ptr, slot, need, abort_ptr, start, timeout, WORLD: tl.constexpr,
    EMU: tl.constexpr,
):  # fmt: skip
    """Until every rank's counter of `slot` reaches `need` (or time / abort); returns the ranks
    (bit mask) that never did."""
    lane = tl.arange(0, 32)
    seen = _read_counters(ptrs_ptr, emu_freed_ptr, slot, WORLD, EMU)
    short = tl.sum(tl.where((lane < WORLD) & ((seen - need) < 0), 1 << lane, 0), axis=0)
    polls = 1
    waiting = short
    while waiting != 0:
        seen = _read_counters(ptrs_ptr, emu_freed_ptr, slot, WORLD, EMU)
        short = tl.sum(tl.where((lane < WORLD) & ((seen - need) < 0), 1 << lane, 0), axis=0)
        polls += 1
        if EMU:
            late = polls >= timeout
        else:
            late = (_globaltimer() - start) > timeout
        ab = tl.load(abort_ptr, volatile=True)
        waiting = tl.where(late | (ab != 0), 0, short)
    if not EMU:
        tl.debug_barrier()  # the acquires were a few threads': order every thread's stores after
    return short


@triton.jit
def release(ptrs_ptr, emu_freed_ptr, rank, slot, pid, nprog, EMU: tl.constexpr):
    """This program is done with `slot` (its reads and clears): its share of _UNIT on its rank's
    counter (GPU: after a block barrier, a system-scope release)."""
    share = tl.where(pid == 0, _UNIT - nprog + 1, 1).to(tl.int64)
    if EMU:
        cnt = emu_freed_ptr + rank * _SLOTS + slot
        tl.store(cnt, tl.load(cnt) + share)
    else:
        tl.debug_barrier()  # every thread's clears precede the release
        lane = tl.arange(0, 32)
        cnt = (tl.load(ptrs_ptr + rank) + _FREED_BYTE).to(tl.pointer_type(tl.int64)) + slot
        tl.atomic_add(cnt + lane * 0, lane * 0 + share, mask=lane == 0, sem="release", scope="sys")


def padded_cols(cols: int, hidden: int) -> int:
    return min(cols, triton.next_power_of_2(hidden))
