"""The symmetric-memory protocol of our kernels (`symm_oneshot`, the two-shot `symm_twoshot`):
buffer layout, device state, error words, sizes and the launch arguments fixed for a layer.

Imports no Triton: capability and sizing code (strategies/symm_workspace.py) read it without loading
a kernel. The device side of the protocol (tickets, epochs, waits, error reports) is
`kernels/symm/device.py`; each kernel's module docstring carries its memory-ordering argument.

One-shot: the data carries its own arrival (Lamport-style): a slot element holds the sentinel -0.0
(bits 0x8000 in bf16 and fp16) until a peer writes it, a published value never holds -0.0 (it is
mapped to +0.0), and a reader polls the data itself. Three slots rotate, each cleared one call
behind. The two-shot signals a chunk's arrival with flags instead (below) and never clears.

Buffer of one rank (bytes): a HEADER_BYTES header (int32 abort word at 0), then data slots of the
activation dtype, all the sentinel at creation:
    one-shot (`ONESHOT`): [ONESHOT_SLOTS][W][cap][H] (source rank, token)
    two-shot (`TWOSHOT`): see the two-shot section below; its size does not depend on T
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

import torch

from fusion_bridge.kernels.layer import LayerRecord, scalars_of

HEADER_BYTES = 256
# slot rows start on 128-byte lines: the twoshot row launches drop whole L2 lines they have read
assert HEADER_BYTES % 128 == 0
ONESHOT_SLOTS = 3
SENTINEL_BITS = -32768  # int16 view of -0.0 in bf16 and fp16 (0x8000)

# the one-shot's device state, int32 [ONESHOT_STATE_WORDS] per rank: the epoch lives here, so
# CUDA graphs replay it
STATE_SLOT = 0  # this call's slot: the epoch mod ONESHOT_SLOTS (it never wraps)
STATE_TICKET = 1  # programs that finished their loads this call (the last one advances the epoch)
STATE_ERROR = 2  # the error word of a failed wait (also written to the pinned host word)
STATE_ROWS = 4  # rows of slot 0, 1, 2 as the call that wrote them used them (the next clear's)
ONESHOT_STATE_WORDS = 8

# error word: bits 0-15 the ranks missed; bit 16 this rank timed out; bit 17 a peer timed out
# earlier (then bits 20-27 name that peer)
ERR_MISSED = 0xFFFF  # the bits of the ranks missed
ERR_TIMEOUT = 1 << 16
ERR_ABORTED = 1 << 17
ERR_RANK_SHIFT = 20
ERR_RANK_MASK = 0xFF  # (word >> ERR_RANK_SHIFT) & ERR_RANK_MASK: the peer that timed out

# the one-shot's poll status (device.wait_row), the same in every thread of a program: a value is
# still the sentinel, the time ran out, the abort word is set; the wait failed when a value is
# still pending (after the timeout) or an abort is under way
POLL_PENDING = 1
POLL_LATE = 2
POLL_ABORTED = 4
POLL_FAILED = POLL_PENDING | POLL_ABORTED

# ---- test and benchmark hooks -------------------------------------------------------------------
# Both kernels take two constexprs that default to production and compile away there:
#   PHASES   a bitmask of the parts of a call to run (default ALL_PHASES). The CPU emulation runs
#            one part per launch on every rank in turn (a wait finds what earlier launches wrote);
#            the benchmarks' ablations leave parts out (their results are then wrong).
#   EMULATED interpreter (TRITON_INTERPRET=1): the timeout counts polls instead of reading the GPU
#            timer, and the epoch fence (inline PTX) is left out. Everything else is the GPU code:
#            peer pointers, tickets, waits and error reports run as they do on the device.
# Only fusion_bridge/testing/symm_oneshot_rig.py sets them; no production launcher or strategy
# exposes them.
PUBLISH = 1  # finalize the partials and store them where they are read (two-shot: at the owner)
REDUCE = 2  # wait for a row's partials and sum them (two-shot: push the reduced row to every rank)
NORM = 4  # the outputs: residual_out, norm_out, quant (two-shot: wait for the owner's row first)
CLEAR = 8  # the previous call's slot back to the sentinel
EPOCH = 16  # the end-of-call ticket: record this slot's rows, advance the slot
FINALIZE = 32  # partials from the top-k gathers (off: a constant partial; the exchange alone)
ALL_PHASES = PUBLISH | REDUCE | NORM | CLEAR | EPOCH | FINALIZE
CONSTANT_PARTIAL_BITS = 0x3F80  # the partial without FINALIZE: 1.0 in bf16 (int16 bits)


# ---- the two-shot (kernels/symm/twoshot.py, behind `symm_fused_twoshot`) ------------------------
# Per rank: the HEADER_BYTES header (int32 abort word at 0; int64 [TWOSHOT_MAX_SLOTS] each: the
# release counters at TWOSHOT_FREED_BYTE, the "my partials of the slot's chunk arrived everywhere"
# flags at TWOSHOT_ARRIVED_BYTE, the "my reduced rows of it did" flags at TWOSHOT_REDUCED_BYTE),
# then TWOSHOT_SLOTS slots, each [2][W][CW][H], CW = ceil(TWOSHOT_CHUNK / W): the reduce-scatter
# rows (source, owner row) then the all-gather rows (owner, owner row) of one chunk. Chunks take the
# slots in turn within a call and across calls, so the size does not depend on T; a slot is handed
# back through its release counter, its arrival through the flags (sequence number + 1 of the
# chunk). Device state: int64 [TWOSHOT_STATE_WORDS] = (chunk base: the chunks of every earlier call,
# each call's rounded up to a multiple of the slots, so a call starts on slot 0; -, error word, -).
TWOSHOT_SLOTS = 2
TWOSHOT_CHUNK = 1024  # tokens per chunk (measured at world size 1: 2 x 1024 faster than 4 x 512)
TWOSHOT_MAX_SLOTS = 4  # the header's arrays (a launch shape may use 2..4 slots)
TWOSHOT_FREED_BYTE = 64
TWOSHOT_ARRIVED_BYTE = 96
TWOSHOT_REDUCED_BYTE = 128
# the two-shot's per-slot flags (its sync launch's SIGNAL / WAIT): this rank's partials of the
# chunk are in every owner's slot; this rank's reduced rows of it are in every other rank's slot
TWOSHOT_ARRIVED = 1
TWOSHOT_REDUCED = 2
TWOSHOT_STATE_WORDS = 4
# one chunk's releases add exactly this to its slot's counter
TWOSHOT_UNIT = 1 << 20


def twoshot_buffer_bytes(
    world: int, hidden: int, elem_size: int, chunk: int = TWOSHOT_CHUNK, slots: int = TWOSHOT_SLOTS
) -> int:
    """One rank's two-shot buffer, independent of T (58.7 MB at H=7168, bf16, any W)."""
    rows_per_source = -(-chunk // world)
    return HEADER_BYTES + slots * 2 * world * rows_per_source * hidden * elem_size


def slot_elems(world: int, cap: int, hidden: int) -> int:
    """Elements of one one-shot slot."""
    return world * cap * hidden


def oneshot_buffer_bytes(world: int, cap: int, hidden: int, elem_size: int) -> int:
    """One rank's one-shot buffer: [ONESHOT_SLOTS][W][cap][H] after the header."""
    return HEADER_BYTES + ONESHOT_SLOTS * slot_elems(world, cap, hidden) * elem_size


@dataclass(frozen=True)
class Layout:
    """One workspace layout of the symmetric-memory kernels: its name (in reports and messages),
    one rank's device state (`state_words` of `state_dtype`), the most tokens one call may carry
    (None: any T up to the spec's max_tokens, the buffer does not grow with T) and one rank's
    buffer bytes (world, cap, hidden, element size)."""

    name: str
    state_words: int
    state_dtype: torch.dtype
    max_cap_tokens: Optional[int]
    bytes_per_rank: Callable[[int, int, int, int], int]

    def buffer_bytes(self, world: int, cap: int, hidden: int, elem_size: int) -> int:
        return self.bytes_per_rank(world, cap, hidden, elem_size)


#: one-shot: slots of W x cap rows, so a token cap (2048: the small-T path)
ONESHOT = Layout("oneshot", ONESHOT_STATE_WORDS, torch.int32, 2048, oneshot_buffer_bytes)
#: two-shot: a few chunk slots that the chunks of a call take in turn, so no token cap
TWOSHOT = Layout(
    "twoshot",
    TWOSHOT_STATE_WORDS,
    torch.int64,
    None,
    lambda world, cap, hidden, elem_size: twoshot_buffer_bytes(world, hidden, elem_size),
)
LAYOUTS = (ONESHOT, TWOSHOT)


def fill_sentinel(t: torch.Tensor) -> None:
    """Every element of a bf16/fp16 tensor -> the sentinel (-0.0): "not arrived"."""
    t.view(torch.int16).fill_(SENTINEL_BITS)


class SymmBuffers(NamedTuple):
    """The workspace as a kernel record: ptrs (int64 [W + 1]: every rank's buffer, then the error
    word's address), state (this rank's device state)."""

    ptrs: Any
    state: Any


class OneshotSlots(NamedTuple):
    """Where a row lies in the one-shot's slots (a kernel record): hidden (H, a row's elements),
    cap (rows per source: the tokens one call may carry), data_off (int16 elements before slot 0:
    the header). Row r of source q in slot s: data_off + ((s * W + q) * cap + r) * H."""

    hidden: int
    cap: int
    data_off: int


class TwoshotSlots(NamedTuple):
    """Where a row lies in the two-shot's slots (a kernel record): hidden (H), chunk (tokens per
    chunk: a slot holds [2][W][ceil(chunk / W)][H] rows)."""

    hidden: int
    chunk: int


@dataclass(frozen=True)
class SymmLayer(LayerRecord):
    """What every launch of one layer shares, bound once in prepare(): the spec's scalars
    (`LayerRecord`), the workspace (ptrs: int64 [W + 1] device, every rank's buffer then the error
    word; state: the layout's state words) and the group's shape. Per-call tensors are passed by
    keyword to `launch`."""

    ptrs: torch.Tensor = None
    state: torch.Tensor = None
    world: int = 0
    rank: int = 0
    cap: int = 0  # tokens one call may carry
    data_off: int = 0  # int16 elements before slot 0 (the header)
    num_sms: int = 0  # the smallest SM count of the group: every rank launches the same grid
    timeout_us: int = 0  # a wait longer than this fails the call (EMULATED: polls)
    # this rank's buffer address (ptrs[rank], known on the host): the two-shot's row launches take
    # it as an argument so that no load precedes their data loads
    own_addr: int = 0
    # the workspace as the one-shot kernel takes it (two record arguments), built with the layer
    buffers: SymmBuffers = field(init=False, repr=False, compare=False)
    slots: OneshotSlots = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "buffers", SymmBuffers(self.ptrs, self.state))
        object.__setattr__(self, "slots", OneshotSlots(self.hidden, self.cap, self.data_off))

    @classmethod
    def bind(cls, ws, spec) -> "SymmLayer":
        """From a workspace (strategies/symm_workspace.SymmWorkspace) and an EpilogueSpec."""
        return cls(
            ptrs=ws.ptrs,
            state=ws.state,
            world=ws.world,
            rank=ws.rank,
            cap=ws.cap,
            data_off=ws.data_off,
            num_sms=ws.num_sms,
            timeout_us=ws.timeout_ns // 1000,
            own_addr=ws.buffer.data_ptr(),
            **scalars_of(spec),
        )


def describe_error(word: int, rank: int, who: str = "symm_fused_oneshot") -> str:
    """The kernel's error word as a message naming the rank(s) that did not arrive."""
    missed = [r for r in range(16) if word & (1 << r)]
    if word & ERR_ABORTED:
        peer = (word >> ERR_RANK_SHIFT) & ERR_RANK_MASK
        return (
            f"{who}: rank {rank} stopped because rank {peer} timed out "
            f"waiting for rank(s) {missed} in an earlier call; its outputs since then are NaN. The "
            "peers are out of step: rebuild the bridge (close it and create a new one on every "
            "rank)"
        )
    if word & ERR_TIMEOUT:
        return (
            f"{who}: rank {rank} timed out waiting for rank(s) {missed}, which did not make the "
            "matching call (all ranks must call with the same T, in the same order); that call's "
            "outputs are NaN. Rebuild the bridge (close it and create a new one on every rank)"
        )
    return f"{who}: rank {rank}: unknown kernel error word {word:#x}; rebuild the bridge"
