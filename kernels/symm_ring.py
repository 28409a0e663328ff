"""The large-T bandwidth path over symmetric memory: a chunked two-shot pipeline in one launch,
with a workspace of a fixed size whatever T is (a ring of chunk slots). Multicast is never used.

Rows are cut into chunks of C tokens; chunk c uses ring slot s = (base + c) % SLOTS, where `base`
(device state) counts the chunks of every earlier call. Inside a chunk, local row j belongs to rank
j % W (its owner), as the owner's row i = j // W. Every program of every rank walks the chunks with
three stages in flight, one chunk apart:

  finalize(c): tiles of [F_ROWS owner rows, F_COLS columns] of rank r's partial (fp32 sum of the K
               routed rows, routed scaling, shared add, ONE rounding, -0.0 -> +0.0), stored into the
               owner's reduce-scatter region [source r][row i] of slot s. Never waits for data;
               the next tile's routing is loaded before this tile's gathers.
  reduce(c-1): the rows rank r owns, whole: wait until the W sources are no longer the sentinel,
               sum them in rank order in fp32, add the residual, round once (-0.0 -> +0.0):
               residual_out's bits, pushed into every OTHER rank's all-gather region [owner r]
               [row i]; the sources go back to the sentinel; the owner stores its own outputs of
               the row right away (residual_out, norm, FP8 / NVFP4), with no round trip through
               its own slot.
  gather(c-2): the rows other ranks own, whole: wait for the owner's row, store it as
               residual_out, norm it (+ FP8 / NVFP4), put the row back to the sentinel; then the
               program releases slot s (a counter in its rank's header; the P programs' shares add
               up to one unit). At W = 1 there is nothing to gather.

Before finalize(c) writes into slot s of any rank, the program waits (one system-scope acquire per
rank, all in flight together) until every rank's counter of slot s shows that all programs
released the chunk that used s before (SLOTS chunks earlier). All ranks launch the same P programs
with the same T, and every program is resident (P is capped by the compiled kernel's occupancy),
so every wait is for an earlier stage: no deadlock, by induction over (chunk, stage). A kernel
that occupies SMs alongside only delays programs until it ends; one that itself waits for this
call (another rank's ring on the same GPU, as the emulated-ranks test has, beside other processes'
kernels) can starve it, and the bounded waits then end the call with the error word. Waits are
bounded (time, or the abort word a peer that timed out sets): a missing peer gives NaN rows and the
error word, never a hang.

Every rank norms every row from the same rounded residual_out bits with the same code (the owner in
reduce, the others in gather: one helper, `symm_ring_stages._row_outputs`), so every output is
bitwise identical on every rank. Error against the fp32 oracle: the partial's rounding,
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

from .quant import row_block, sf_padding_item, sf_padding_items
from .quant_codes import QUANT_NVFP4
from .symm_device import abort_word_ptr, start_clock
from .symm_protocol import SymmLayer
from .symm_ring_device import _SLOTS, CHUNK, SLOTS, STATE_WORDS, _release, buffer_bytes
from .symm_ring_stages import _stage_finalize, _stage_gather, _stage_reduce

__all__ = ["CHUNK", "SLOTS", "STATE_WORDS", "buffer_bytes", "RingShape", "DEFAULT_SHAPE", "launch"]
STAGE_FINALIZE, STAGE_REDUCE, STAGE_GATHER, STAGE_SF_PAD = 0, 1, 2, 3


@triton.jit(do_not_specialize=["tokens", "rank", "timeout", "sf_rows", "sf_pad_items"])
def _ring_kernel(
    ptrs_ptr, state_ptr, gemm2_ptr, perm_ptr, weight_ptr, shared_ptr, residual_ptr, gamma_ptr,
    residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr, tokens, hidden, chunk, rank, routed_scaling,
    eps, weight_bias, quant_scale, sf_rows, sf_cols, sf_pad_items, timeout,
    WORLD: tl.constexpr, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr, ROW_BLOCK: tl.constexpr, HW_CVT: tl.constexpr, F_ROWS: tl.constexpr,
    F_COLS: tl.constexpr,
    EMU: tl.constexpr = False, EMU_PID: tl.constexpr = 0, EMU_NPROG: tl.constexpr = 1,
    EMU_STAGE: tl.constexpr = 0, EMU_CHUNK: tl.constexpr = 0, EMU_ITEMS: tl.constexpr = 0,
    PHASES: tl.constexpr = 7,
):  # fmt: skip
    """EMU* (set only by symm_testing, the CPU emulation): run one stage (EMU_STAGE) of one chunk
    for one program, time counted in polls, no end-of-call ticket. Everything else, peer pointers,
    counters and error reports included, is the GPU code. PHASES (set only by symm_testing, the
    benchmark ablations; symm_protocol.RING_*): the stages the GPU loop runs."""
    dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
    if EMU:
        pid = EMU_PID
        nprog = EMU_NPROG
        timeout_ns = timeout
    else:
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        timeout_ns = timeout.to(tl.int64) * 1000
    start = start_clock(EMU)
    abort_ptr = abort_word_ptr(ptrs_ptr, rank)
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
                EMU_CHUNK, base, ptrs_ptr, abort_ptr, state_ptr, start, timeout_ns, pid, nprog,
                gemm2_ptr, perm_ptr, weight_ptr, shared_ptr, tokens, hidden, chunk, rank,
                routed_scaling, dtype, WORLD, TOP_K, HAS_SHARED, F_ROWS, F_COLS, EMU, EMU_ITEMS,
            )  # fmt: skip
        if EMU_STAGE == 1:
            _stage_reduce(
                EMU_CHUNK, base, ptrs_ptr, abort_ptr, state_ptr, start, timeout_ns, pid, nprog,
                residual_ptr, gamma_ptr, weight_bias, residual_out_ptr, norm_out_ptr, q_ptr,
                sf_ptr, tokens, hidden, chunk, rank, eps, quant_scale, sf_cols, WORLD, QUANT,
                SWIZZLED, ROW_BLOCK, HW_CVT, EMU, EMU_ITEMS,
            )  # fmt: skip
        if EMU_STAGE == 2:
            _stage_gather(
                EMU_CHUNK, base, ptrs_ptr, abort_ptr, state_ptr, start, timeout_ns, pid, nprog,
                gamma_ptr, weight_bias, residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr, tokens,
                hidden, chunk, rank, eps, quant_scale, sf_cols, WORLD, QUANT, SWIZZLED, ROW_BLOCK,
                HW_CVT, EMU, EMU_ITEMS,
            )  # fmt: skip
        if EMU_STAGE == 3:
            if QUANT == 2:
                if SWIZZLED:
                    for item in range(EMU_PID, EMU_ITEMS, EMU_NPROG):
                        if item < sf_pad_items:
                            sf_padding_item(item, sf_ptr, tokens, sf_rows, sf_cols)
    else:
        for it in range(0, nchunks + 2):
            if (it < nchunks) & ((PHASES & 1) != 0):
                _stage_finalize(
                    it, base, ptrs_ptr, abort_ptr, state_ptr, start, timeout_ns, pid, nprog,
                    gemm2_ptr, perm_ptr, weight_ptr, shared_ptr, tokens, hidden, chunk, rank,
                    routed_scaling, dtype, WORLD, TOP_K, HAS_SHARED, F_ROWS, F_COLS, EMU, 0,
                )  # fmt: skip
            if (it >= 1) & (it <= nchunks) & ((PHASES & 2) != 0):
                _stage_reduce(
                    it - 1, base, ptrs_ptr, abort_ptr, state_ptr, start, timeout_ns, pid, nprog,
                    residual_ptr, gamma_ptr, weight_bias, residual_out_ptr, norm_out_ptr, q_ptr,
                    sf_ptr, tokens, hidden, chunk, rank, eps, quant_scale, sf_cols, WORLD, QUANT,
                    SWIZZLED, ROW_BLOCK, HW_CVT, EMU, 0,
                )  # fmt: skip
            if (it >= 2) & ((PHASES & 4) != 0):
                _stage_gather(
                    it - 2, base, ptrs_ptr, abort_ptr, state_ptr, start, timeout_ns, pid, nprog,
                    gamma_ptr, weight_bias, residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr, tokens,
                    hidden, chunk, rank, eps, quant_scale, sf_cols, WORLD, QUANT, SWIZZLED,
                    ROW_BLOCK, HW_CVT, EMU, 0,
                )  # fmt: skip
            if (it >= 2) & ((PHASES & 4) == 0):  # ablation: the slot goes back unread
                _release(ptrs_ptr, rank, (base + it - 2) % _SLOTS, pid, nprog)
        if QUANT == 2:
            if SWIZZLED:
                for item in range(pid, sf_pad_items, nprog):
                    sf_padding_item(item, sf_ptr, tokens, sf_rows, sf_cols)
        # the last ticket advances the chunk base for the next call (every program read it first)
        done = (lane == 0) & (ticket == nprog - 1)
        tl.store(state_ptr + lane * 0, lane * 0 + base + nchunks, mask=done)
        tl.store(state_ptr + 1 + lane * 0, lane * 0, mask=done)


# ------------------------------------------------------------------------------------------------
# launch
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RingShape:
    """A launch variant: programs per SM (capped by the compiled kernel's occupancy: every program
    must be resident), warps and the finalize tile [rows, columns] (reduce and gather take whole
    rows). The default is the fastest shape of the sweep in
    benchmarks/results/ring_local_h200_sweep.csv (16 warps hold a whole H=7168 row in 128
    registers, so one program per SM; 8 warps need 167 and were slower)."""

    programs_per_sm: int = 2
    warps: int = 16
    f_rows: int = 1
    f_cols: int = 4096

    def constexprs(self, hidden: int) -> dict:
        cap = triton.next_power_of_2(hidden)
        return dict(
            F_ROWS=self.f_rows,
            F_COLS=min(self.f_cols, cap),
            ROW_BLOCK=row_block(hidden),
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


def call_args(
    layer: SymmLayer,
    shape: Optional[RingShape],
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
    chunk: int = CHUNK,
) -> tuple[list, dict]:
    """(positional args, constexprs) of one call (any T > 0: the ring turns within the call).
    chunk: the buffers' (the CPU emulation uses small ones)."""
    tokens, top_k = perm.shape
    quant = layer.quant
    sf_rows, sf_cols = (sf.shape[0], sf.shape[1]) if quant.code == QUANT_NVFP4 else (tokens, 0)
    swz = quant.code == QUANT_NVFP4 and quant.swizzled
    args = [
        layer.ptrs, layer.state, gemm2_out, perm, weights,
        shared if shared is not None else residual, residual, gamma, residual_out, norm_out, q, sf,
        tokens, layer.hidden, chunk, layer.rank, layer.routed_scaling, layer.eps,
        layer.weight_bias, quant.scale, sf_rows, sf_cols,
        sf_padding_items(tokens, sf_rows, sf_cols) if swz else 0, layer.timeout_us,
    ]  # fmt: skip
    constexprs = dict(
        WORLD=layer.world,
        TOP_K=top_k,
        HAS_SHARED=shared is not None,
        QUANT=quant.code,
        SWIZZLED=bool(quant.swizzled),
        HW_CVT=residual.is_cuda,
        **(shape or DEFAULT_SHAPE).constexprs(layer.hidden),
    )
    return args, constexprs


def launch(layer: SymmLayer, *, shape: Optional[RingShape] = None, **tensors) -> None:
    """One call on the GPU: `tensors` are call_args's keywords (residual_out, norm_out, q, sf as
    uint8: [T, H] fp8 codes / [T, H/2] packed fp4, gemm2_out, perm, weights, shared or None,
    residual, gamma). `layer`: a SymmLayer of a ring workspace (state int64 [STATE_WORDS]). Any T;
    T == 0 launches nothing (on every rank)."""
    if tensors["perm"].shape[0] == 0:
        return
    shape = shape or DEFAULT_SHAPE
    args, constexprs = call_args(layer, shape, **tensors)
    key = (tuple(sorted(constexprs.items())), shape.warps, tensors["residual"].device)
    per_sm = _OCCUPANCY.get(key)
    if per_sm is None:  # compile first: the grid must fit on the GPU at once
        compiled = _ring_kernel.warmup(*args, grid=(1,), num_warps=shape.warps, **constexprs)
        compiled._init_handles()  # loads it: n_regs is known from here on
        per_sm = _OCCUPANCY[key] = resident_per_sm(compiled, shape.warps)
    programs = layer.num_sms * min(shape.programs_per_sm, per_sm)
    _ring_kernel[(programs,)](*args, num_warps=shape.warps, **constexprs)
