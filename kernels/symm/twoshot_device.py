"""The two-shot's device-side protocol pieces (`symm_twoshot` has the design and the
ordering argument; the layout and sizes are `protocol`'s, the pieces it shares with the
one-shot (the error word, the error report, the publish rounding) `device`'s): the slot
addresses, the release counters and the bounded wait on them.

Every helper also runs under TRITON_INTERPRET=1 (peer pointers are table entries the interpreter
follows as host addresses); EMULATED swaps only the GPU timer for a poll count.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusion_bridge.kernels.symm.device import _globaltimer, peer_ptr, report_error
from fusion_bridge.kernels.symm import protocol as P

SLOTS = P.TWOSHOT_SLOTS
CHUNK = P.TWOSHOT_CHUNK
MAX_SLOTS = P.TWOSHOT_MAX_SLOTS
FREED_BYTE = P.TWOSHOT_FREED_BYTE
UNIT = P.TWOSHOT_UNIT


def buffer_bytes(
    world: int, hidden: int, elem_size: int, chunk: int = CHUNK, slots: int = SLOTS
) -> int:
    return P.twoshot_buffer_bytes(world, hidden, elem_size, chunk, slots)


@triton.jit
def _counter(ptrs_ptr, q, slot):
    """Rank q's release counter of `slot` (int64, in its header)."""
    return (tl.load(ptrs_ptr + q) + P.TWOSHOT_FREED_BYTE).to(tl.pointer_type(tl.int64)) + slot


@triton.jit
def _read_counters(ptrs_ptr, slot, WORLD: tl.constexpr):
    """Every rank's release counter of `slot`, one lane each (system-scope acquire reads, an atomic
    add of 0, all in flight together), broadcast to the program: int64 [32], lanes past W huge."""
    lane = tl.arange(0, 32)
    on = lane < WORLD
    base = tl.load(ptrs_ptr + tl.where(on, lane, 0), mask=on, other=0)
    cnt = (base + P.TWOSHOT_FREED_BYTE).to(tl.pointer_type(tl.int64)) + slot
    got = tl.atomic_add(cnt, lane * 0, mask=on, sem="acquire", scope="sys")
    return tl.where(on, got, 1 << 62)


@triton.jit
def _wait_slot_free(
    ptrs_ptr, slot, need, abort_ptr, start, timeout, WORLD: tl.constexpr, EMULATED: tl.constexpr
):  # fmt: skip
    """Until every rank's counter of `slot` reaches `need`; returns the ranks that never did."""
    lane = tl.arange(0, 32)
    seen = _read_counters(ptrs_ptr, slot, WORLD)
    polls = 1
    waiting = (tl.min(seen, axis=0) - need < 0).to(tl.int32)
    while waiting != 0:
        seen = _read_counters(ptrs_ptr, slot, WORLD)
        polls += 1
        if EMULATED:
            late = polls >= timeout
        else:
            late = (_globaltimer() - start) > timeout
        ab = tl.load(abort_ptr, volatile=True)
        waiting = (tl.min(seen, axis=0) - need < 0).to(tl.int32) * (1 - late.to(tl.int32))
        waiting = waiting * (ab == 0).to(tl.int32)
    missing = tl.sum(tl.where((lane < WORLD) & (seen - need < 0), 1 << lane, 0), axis=0)
    tl.debug_barrier()  # the acquires were some threads': order the whole program's stores after
    return missing


@triton.jit
def _release(ptrs_ptr, rank, slot, pid, nprog):
    """This program is done with `slot` (its reads): its share of P.TWOSHOT_UNIT on its rank's
    counter, one lane's system-scope release after a block barrier (the twoshot sync launch: one
    program)."""
    share = tl.where(pid == 0, P.TWOSHOT_UNIT - nprog + 1, 1).to(tl.int64)
    tl.debug_barrier()  # every thread's reads precede the release
    lane = tl.arange(0, 32)
    cnt = _counter(ptrs_ptr, rank, slot)
    tl.atomic_add(cnt + lane * 0, lane * 0 + share, mask=lane == 0, sem="release", scope="sys")


@triton.jit
def _rank_buf(ptrs_ptr, q):
    """Rank q's buffer base (int16 elements, header included)."""
    return peer_ptr(ptrs_ptr, q, tl.int16)


@triton.jit
def _fail(who, abort_ptr, ptrs_ptr, state_ptr, rank, WORLD: tl.constexpr):
    report_error(who, ptrs_ptr, state_ptr, abort_ptr, rank, WORLD)


@triton.jit
def _slot_at(buf, slot, hidden, chunk, WORLD: tl.constexpr):
    """Slot `slot` of the buffer at `buf` (int16 pointer, header included): its reduce-scatter
    region, [source][CW][H] rows apart."""
    cw = tl.cdiv(chunk, WORLD)
    src_stride = cw.to(tl.int64) * hidden
    return buf + P.HEADER_BYTES // 2 + slot * 2 * WORLD * src_stride


@triton.jit
def _slot_base(ptrs_ptr, q, slot, hidden, chunk, WORLD: tl.constexpr):
    """Rank q's slot `slot` (`_slot_at` of its buffer)."""
    return _slot_at(_rank_buf(ptrs_ptr, q), slot, hidden, chunk, WORLD)


@triton.jit
def _poison_own_partials(
    ptrs_ptr, rank, slot, hidden, chunk, NAN_BITS: tl.constexpr, WORLD: tl.constexpr
):  # fmt: skip
    """A wait before a row launch failed: this rank's own partials of `slot` (its reduce-scatter
    rows [rank][*], which no other rank writes) := NaN (NAN_BITS: the activation dtype's quiet NaN
    as int16), so every row the next row launch sums is NaN without the launch reading the abort
    word. One program; only ever on the failure path (milliseconds at H=7168)."""
    cw = tl.cdiv(chunk, WORLD)
    n = cw.to(tl.int64) * hidden
    dst = _slot_base(ptrs_ptr, rank, slot, hidden, chunk, WORLD) + rank * n
    offs = tl.arange(0, 1024)
    nan = tl.full([1024], NAN_BITS, tl.int16)
    for start in range(0, n, 1024):
        tl.store(dst + start + offs, nan, mask=start + offs < n)
