"""The large-T two-shot as a staged pipeline (measured, not adopted: no strategy launches it): the
ring's chunked two-shot (`symm_ring`: the same slot layout, ownership, sentinel arrival, release
counters and error word), but every stage of every chunk is its own launch with a grid sized to
its work, instead of one persistent launch that keeps every program resident (whose finalize runs
at one 16-warp program per SM). Local work on one H200 at world size 1 (benchmarks/ring_local.py
--staged, c512 shapes): 1.40-1.59x the sum of our two standalone kernels, against the ring's
1.60-1.77x in the same run; the target is 1.0x (benchmarks/results/README.md says where the time
goes).

Per chunk c (slot (base + c) % SLOTS, base in device state):

  Q(c): one program waits (bounded) until every rank released the slot (chunk c - SLOTS).
  F(c): the finalize items of chunk c (`symm_ring_stages._stage_finalize`, one item per program)
        into the owners' reduce-scatter rows; never waits.
  R(c): the rows this rank owns (`_stage_reduce`): wait for the W partials via the sentinel,
        sum in rank order, residual, round, clear, push to the peers, this rank's outputs.
  G(c): the rows other ranks own (`_stage_gather`): wait, clear, outputs (none at W = 1).
  P(c): one program releases the slot on this rank's counter (R and G, earlier on its stream,
        are done); after the last chunk it also advances the base.

A first revision had every F program wait for the slot and every G program (R at W = 1) release
its share, as the ring's persistent programs do: 5-15% slower (a system-scope atomic and an L1
invalidation in every finalize program, a system-scope fence in every row program; reverted,
benchmarks/results/ring_local_h200_staged_v2_rejected.csv's `*_per_program` rows).

F runs on a side stream, everything else on the caller's stream (or, "two_prio", on a
high-priority stream forked from it): F(c + 1) can overlap R(c) / G(c) (and the link). F(c) waits
for Q(c)'s event and R(c) for F(c)'s; the side streams fork from the caller's stream at the start
of the call and join it at the end, so CUDA-graph capture sees a closed fork / join. Q(c + SLOTS)
is issued right after P(c), so a gate only ever waits for the peers.

Deadlock freedom: Q(c) waits only for the peers' P(c - SLOTS), which follows their R / G of that
chunk, which wait only for F(c - SLOTS) of every rank (launched before, never waiting on anything
later): induction over the chunks. Emulated ranks on one GPU must launch all ranks' stages in one
global order on one stream (`symm_testing.staged_call`), so that no spinning launch holds SMs a
peer's earlier stage needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch
import triton
import triton.language as tl

from .launcher import KernelLauncher
from .quant import row_block, row_num_warps, sf_padding_item, sf_padding_items
from .quant_codes import QUANT_NVFP4
from .symm_device import abort_word_ptr, start_clock
from .symm_protocol import SymmLayer
from .symm_ring_device import _SLOTS, _UNIT, CHUNK, SLOTS, _fail, _release, _wait_slot_free
from .symm_ring_stages import _stage_finalize, _stage_gather, _stage_reduce

__all__ = ["StagedShape", "DEFAULT_SHAPE", "launch", "call_plan"]


@triton.jit
def _sf_padding(sf_ptr, tokens, sf_rows, sf_cols, sf_pad_items, pid, nprog, QUANT: tl.constexpr,
                SWIZZLED: tl.constexpr):  # fmt: skip
    """The swizzled NVFP4 scale padding (the call's last row launch)."""
    if QUANT == 2:
        if SWIZZLED:
            for item in range(pid, sf_pad_items, nprog):
                sf_padding_item(item, sf_ptr, tokens, sf_rows, sf_cols)


@triton.jit(do_not_specialize=["c", "rank", "timeout"])
def _gate_kernel(ptrs_ptr, state_ptr, c, rank, timeout, WORLD: tl.constexpr, EMU: tl.constexpr):
    """Q(c), one program: wait (bounded) until every rank released the slot chunk c reuses (the
    chunk SLOTS before it); the finalize launch F(c) is ordered after this one."""
    timeout_ns = timeout
    if not EMU:
        timeout_ns = timeout.to(tl.int64) * 1000
    start = start_clock(EMU)
    abort_ptr = abort_word_ptr(ptrs_ptr, rank)
    seq = tl.load(state_ptr) + c
    missing = _wait_slot_free(
        ptrs_ptr, seq % _SLOTS, (seq // _SLOTS) * _UNIT, abort_ptr, start, timeout_ns, WORLD, EMU
    )
    if missing != 0:
        _fail(missing, abort_ptr, ptrs_ptr, state_ptr, rank, WORLD)


@triton.jit(do_not_specialize=["c", "nchunks", "rank"])
def _release_kernel(ptrs_ptr, state_ptr, c, nchunks, rank, ADVANCE: tl.constexpr):
    """P(c), one program: this rank's readers of chunk c (the launches before this one on its
    stream) are done: one release of the whole chunk's unit on this rank's counter. ADVANCE (the
    call's last chunk): the base moves on by the call's chunks."""
    base = tl.load(state_ptr)
    _release(ptrs_ptr, rank, (base + c) % _SLOTS, 0, 1)
    if ADVANCE:
        lane = tl.arange(0, 32)
        tl.store(state_ptr + lane * 0, lane * 0 + base + nchunks, mask=lane == 0)


@triton.jit(do_not_specialize=["tokens", "c", "rank", "timeout"])
def _finalize_kernel(
    ptrs_ptr, state_ptr, gemm2_ptr, perm_ptr, weight_ptr, shared_ptr, tokens, hidden, chunk, c,
    rank, routed_scaling, timeout,
    WORLD: tl.constexpr, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, F_ROWS: tl.constexpr,
    F_COLS: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """F(c): one finalize item per program (the grid is the chunk's item count); the gate launch
    Q(c) before it waited for the slot."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    timeout_ns = timeout
    if not EMU:
        timeout_ns = timeout.to(tl.int64) * 1000
    start = start_clock(EMU)
    base = tl.load(state_ptr)
    _stage_finalize(
        c, base, ptrs_ptr, abort_word_ptr(ptrs_ptr, rank), state_ptr, start, timeout_ns, pid,
        nprog, gemm2_ptr, perm_ptr, weight_ptr, shared_ptr, tokens, hidden, chunk, rank,
        routed_scaling, gemm2_ptr.dtype.element_ty, WORLD, TOP_K, HAS_SHARED, F_ROWS, F_COLS, EMU,
        1, False, False,
    )  # fmt: skip


@triton.jit(do_not_specialize=["tokens", "c", "rank", "timeout", "sf_rows", "sf_pad_items"])
def _rows_kernel(
    ptrs_ptr, state_ptr, residual_ptr, gamma_ptr, residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr,
    tokens, hidden, chunk, c, rank, eps, weight_bias, quant_scale, sf_rows, sf_cols, sf_pad_items,
    timeout,
    WORLD: tl.constexpr, QUANT: tl.constexpr, SWIZZLED: tl.constexpr, ROW_BLOCK: tl.constexpr,
    HW_CVT: tl.constexpr, R_COLS: tl.constexpr, GATHER: tl.constexpr, LAST: tl.constexpr,
    EMU: tl.constexpr,
):  # fmt: skip
    """R(c) (GATHER False: the rows this rank owns) or G(c) (GATHER True: the rows other ranks
    own). One row per program. The release launch P(c) releases the slot afterwards. LAST: the
    call's last row launch, which also writes the swizzled NVFP4 scale padding."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    timeout_ns = timeout
    if not EMU:
        timeout_ns = timeout.to(tl.int64) * 1000
    start = start_clock(EMU)
    abort_ptr = abort_word_ptr(ptrs_ptr, rank)
    base = tl.load(state_ptr)
    if GATHER:
        _stage_gather(
            c, base, ptrs_ptr, abort_ptr, state_ptr, start, timeout_ns, pid, nprog, gamma_ptr,
            weight_bias, residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr, tokens, hidden, chunk,
            rank, eps, quant_scale, sf_cols, WORLD, QUANT, SWIZZLED, ROW_BLOCK, HW_CVT, EMU, 1,
            R_COLS, False,
        )  # fmt: skip
    else:
        _stage_reduce(
            c, base, ptrs_ptr, abort_ptr, state_ptr, start, timeout_ns, pid, nprog, residual_ptr,
            gamma_ptr, weight_bias, residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr, tokens, hidden,
            chunk, rank, eps, quant_scale, sf_cols, WORLD, QUANT, SWIZZLED, ROW_BLOCK, HW_CVT, EMU,
            1, R_COLS,
        )  # fmt: skip
    if LAST:
        _sf_padding(sf_ptr, tokens, sf_rows, sf_cols, sf_pad_items, pid, nprog, QUANT, SWIZZLED)


_F_CONSTS = ("WORLD", "TOP_K", "HAS_SHARED", "F_ROWS", "F_COLS", "EMU")
_R_CONSTS = (
    "WORLD", "QUANT", "SWIZZLED", "ROW_BLOCK", "HW_CVT", "R_COLS", "GATHER", "LAST", "EMU"
)  # fmt: skip
_LAUNCH_F = KernelLauncher(_finalize_kernel, _F_CONSTS)
_LAUNCH_R = KernelLauncher(_rows_kernel, _R_CONSTS)
_LAUNCH_Q = KernelLauncher(_gate_kernel, ("WORLD", "EMU"))
_LAUNCH_P = KernelLauncher(_release_kernel, ("ADVANCE",))


@dataclass(frozen=True)
class StagedShape:
    """A launch variant. chunk: tokens per chunk (the workspace's: 4 slots of [2][C][H], 29.4 MB
    at C=256, 58.7 MB at C=512, H=7168 bf16); f_cols / f_warps: the finalize item (one row
    segment, as our standalone finalize's 1024 columns x 4 warps); row_warps: 0 = our add+RMSNorm
    kernel's choice; row_cols: 0 = R / G hold a whole row, else they stream it in chunks of this
    many columns (`symm_ring_rows`, a power of two >= 64); stream_mode: "two" (F on a side
    stream, overlapping R / G), "two_prio" (the same with R / G on a high-priority stream; not yet
    measured) or "one" (every stage in order on the caller's stream)."""

    chunk: int = CHUNK
    f_cols: int = 1024
    f_warps: int = 4
    row_warps: int = 0
    row_cols: int = 0
    stream_mode: str = "two"

    def __post_init__(self):
        if self.stream_mode not in ("one", "two", "two_prio"):
            raise ValueError(
                f"stream_mode: expected 'one', 'two' or 'two_prio', got {self.stream_mode!r}"
            )
        rc = self.row_cols
        if rc != 0 and (rc < 64 or rc & (rc - 1)):
            raise ValueError(f"row_cols: expected 0 or a power of two >= 64, got {rc}")
        if self.chunk < 1:
            raise ValueError(f"chunk: expected >= 1, got {self.chunk}")


DEFAULT_SHAPE = StagedShape()


@dataclass(frozen=True)
class ChunkPlan:
    """One chunk's grids: finalize items, owned rows (R), other ranks' rows (G; 0 at W = 1)."""

    index: int
    f_items: int
    own_rows: int
    other_rows: int


def call_plan(tokens: int, world: int, rank: int, hidden: int, shape: StagedShape) -> list:
    """The chunks of a call and their grids (the kernel's own formulas, on the host)."""
    plans = []
    f_cols = min(shape.f_cols, triton.next_power_of_2(hidden))
    for c in range(-(-tokens // shape.chunk)):
        n_c = min(shape.chunk, tokens - c * shape.chunk)
        own = (n_c - rank + world - 1) // world if n_c > rank else 0
        items = world * -(-n_c // world) * -(-hidden // f_cols)
        plans.append(ChunkPlan(c, items, own, n_c - own))
    return plans


_SIDE: dict = {}


def _side_stream(device, high_priority: bool = False) -> torch.cuda.Stream:
    """One side stream per device and priority (-100: the highest the device offers)."""
    key = (device, high_priority)
    if key not in _SIDE:
        _SIDE[key] = torch.cuda.Stream(device=device, priority=-100 if high_priority else 0)
    return _SIDE[key]


def launch(layer: SymmLayer, *, shape: Optional[StagedShape] = None, **tensors) -> None:
    """One call: `tensors` as `symm_ring.launch` takes them (residual_out, norm_out, q, sf,
    gemm2_out, perm, weights, shared or None, residual, gamma). The layer's buffer must be laid out
    for shape.chunk (`symm_ring_device.buffer_bytes(W, H, elem, chunk)`). T == 0 launches nothing
    (on every rank)."""
    if tensors["perm"].shape[0] == 0:
        return
    shape = shape or DEFAULT_SHAPE
    calls = _call_launches(layer, shape, tensors, emulated=False)
    residual = tensors["residual"]
    if shape.stream_mode == "one" or not residual.is_cuda:
        for p in calls.plans:
            for _, fn in calls.per_chunk(p):
                fn()
    else:
        _two_streams(residual.device, calls, layer.world, shape.stream_mode == "two_prio")


def _call_launches(layer: SymmLayer, shape: StagedShape, tensors: dict, emulated: bool):
    """A call's launches, not yet made: a namespace of the chunk plans and, per chunk, callables
    f(p), r(p, gather), q(c), p(c) and per_chunk(p) -> [(stage letter, callable)] in this rank's
    order. emulated: the CPU interpreter's poll-count timer (symm_testing only)."""
    tokens, top_k = tensors["perm"].shape
    world, rank, hidden = layer.world, layer.rank, layer.hidden
    quant = layer.quant
    sf = tensors["sf"]
    swz = quant.code == QUANT_NVFP4 and bool(quant.swizzled)
    sf_rows, sf_cols = (sf.shape[0], sf.shape[1]) if quant.code == QUANT_NVFP4 else (tokens, 0)
    residual = tensors["residual"]
    shared = tensors["shared"]
    rb = row_block(hidden)
    f_cols = min(shape.f_cols, triton.next_power_of_2(hidden))
    f_args = (
        layer.ptrs, layer.state, tensors["gemm2_out"], tensors["perm"], tensors["weights"],
        shared if shared is not None else residual,
    )  # fmt: skip
    f_consts = (world, top_k, shared is not None, 1, f_cols, emulated)
    r_ptrs = (
        layer.ptrs, layer.state, residual, tensors["gamma"], tensors["residual_out"],
        tensors["norm_out"], tensors["q"], sf,
    )  # fmt: skip
    r_cols = min(shape.row_cols, rb)
    row_warps = shape.row_warps or row_num_warps(rb, quant.code)
    pad_items = sf_padding_items(tokens, sf_rows, sf_cols) if swz else 0
    plans = call_plan(tokens, world, rank, hidden, shape)
    nchunks = len(plans)
    timeout = layer.timeout_us

    def f_launch(p):
        args = f_args + (tokens, hidden, shape.chunk, p.index, rank, layer.routed_scaling, timeout)
        return lambda: _LAUNCH_F((p.f_items,), args, f_consts, shape.f_warps)

    def r_launch(p, gather):
        rows = p.other_rows if gather else p.own_rows
        last = p.index == nchunks - 1 and (gather or world == 1)
        args = r_ptrs + (
            tokens, hidden, shape.chunk, p.index, rank, layer.eps, layer.weight_bias,
            quant.scale, sf_rows, sf_cols, pad_items if last else 0, timeout,
        )  # fmt: skip
        consts = (world, quant.code, swz, rb, residual.is_cuda, r_cols, gather, last, emulated)
        return lambda: _LAUNCH_R((max(1, rows),), args, consts, row_warps)

    def q_launch(c):
        args = (layer.ptrs, layer.state, c, rank, timeout)
        return lambda: _LAUNCH_Q((1,), args, (world, emulated), 1)

    def p_launch(c):
        args = (layer.ptrs, layer.state, c, nchunks, rank)
        return lambda: _LAUNCH_P((1,), args, (c == nchunks - 1,), 1)

    def per_chunk(p):
        out = [("Q", q_launch(p.index)), ("F", f_launch(p)), ("R", r_launch(p, False))]
        out += [("G", r_launch(p, True))] if world > 1 else []
        return out + [("P", p_launch(p.index))]

    return SimpleNamespace(
        plans=plans, f=f_launch, r=r_launch, q=q_launch, p=p_launch, per_chunk=per_chunk
    )


def _two_streams(device, calls, world, prio):
    """F on the side stream, everything else on the rows stream (the caller's, or with `prio` a
    high-priority stream forked from it: the block scheduler then gives a ready R / G its SMs
    before the next finalize's; CUDA graphs keep the priority per kernel node, PyTorch
    instantiates them with node priorities): Q(c) for the first SLOTS chunks at the start, then
    Q(c + SLOTS) right after P(c) (this rank's release of the slot it reuses); F(c) waits for
    Q(c)'s event, R(c) for F(c)'s."""
    main = torch.cuda.current_stream(device)
    side = _side_stream(device)
    rows = _side_stream(device, high_priority=True) if prio else main
    side.wait_stream(main)
    if prio:
        rows.wait_stream(main)
    gates = {}

    def gate(c):
        calls.q(c)()
        gates[c] = torch.cuda.Event()
        gates[c].record(rows)

    with torch.cuda.stream(rows):
        for c in range(min(SLOTS, len(calls.plans))):
            gate(c)
    for p in calls.plans:
        with torch.cuda.stream(side):
            side.wait_event(gates.pop(p.index))
            calls.f(p)()
            f_done = torch.cuda.Event()
            f_done.record(side)
        with torch.cuda.stream(rows):
            rows.wait_event(f_done)
            calls.r(p, False)()
            if world > 1:
                calls.r(p, True)()
            calls.p(p.index)()
            if p.index + SLOTS < len(calls.plans):
                gate(p.index + SLOTS)
    if prio:  # the caller's stream joins both (without prio it waited for every F already)
        main.wait_stream(rows)
