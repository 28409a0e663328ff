"""The large-T bandwidth path over symmetric memory: a chunked two-shot pipeline in one launch,
with a workspace of a fixed size whatever T is (a ring of chunk slots). Multicast is never used.

Rows are cut into chunks of C tokens; chunk c uses ring slot s = (base + c) % SLOTS, where `base`
(device state) counts the chunks of every earlier call. Inside a chunk, local row j belongs to rank
j % W (its owner), as the owner's row i = j // W. Every program of every rank walks the chunks with
three stages in flight, one chunk apart:

  finalize(c): tiles of [F_ROWS owner rows, F_COLS columns] of rank r's partial (fp32 sum of the K
               routed rows, routed scaling, shared add, ONE rounding, -0.0 -> +0.0), stored into the
               owner's reduce-scatter region [source r][row i] of slot s. Never waits for data.
  reduce(c-1): the owned rows' tiles: wait until the W sources are no longer the sentinel, sum them
               in rank order in fp32, add the residual, round once (-0.0 -> +0.0): residual_out's
               bits, pushed into every rank's all-gather region [owner r][row i]; the sources go
               back to the sentinel.
  gather(c-2): whole rows: wait for the owner's row, store it as residual_out, norm it (+ FP8 /
               NVFP4), put the row back to the sentinel; then the program releases slot s (a
               counter in its rank's header; the P programs' shares add up to one unit).

Before finalize(c) writes into slot s of any rank, the program waits until every rank's counter of
slot s shows that all programs released the chunk that used s before (SLOTS chunks earlier). All
ranks launch the same P programs with the same T, and every program is resident (P is capped by the
compiled kernel's occupancy), so every wait is for an earlier stage: no deadlock, by induction over
(chunk, stage). Waits are bounded (time, or the abort word a peer that timed out sets): a missing
peer gives NaN rows and the error word, never a hang.

Every rank norms every row from the same rounded residual_out bits with the same code, so every
output is bitwise identical on every rank. Error against the fp32 oracle: the partial's rounding,
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

from .quant import QUANT_NVFP4
from .symm_common import _globaltimer, _sf_padding_item, sf_padding_items
from .symm_ring_protocol import (
    SLOTS,
    STATE_WORDS,
    _SLOTS,
    _UNIT,
    buffer_bytes,
    fail,
    padded_cols,
    release,
    wait_slot_free,
)
from .symm_ring_stages import stage_finalize, stage_gather, stage_reduce

__all__ = ["SLOTS", "STATE_WORDS", "buffer_bytes", "RingShape", "DEFAULT_SHAPE", "fused_into"]
STAGE_FINALIZE, STAGE_REDUCE, STAGE_GATHER, STAGE_SF_PAD = 0, 1, 2, 3


@triton.jit(do_not_specialize=["tokens", "rank", "timeout", "sf_rows", "sf_pad_items", "buf_elems"])
def _ring_kernel(
    ptrs_ptr, bufs_ptr, buf_elems, emu_abort_ptr, emu_freed_ptr, state_ptr, gemm2_ptr, perm_ptr,
    weight_ptr, shared_ptr, residual_ptr, gamma_ptr, residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr,
    tokens, hidden, chunk, rank, routed_scaling, eps, weight_bias, quant_scale, sf_rows, sf_cols,
    sf_pad_items, timeout,
    WORLD: tl.constexpr, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr, HW_CVT: tl.constexpr,
    F_ROWS: tl.constexpr, F_COLS: tl.constexpr, R_ROWS: tl.constexpr, R_COLS: tl.constexpr,
    G_ROWS: tl.constexpr, G_COLS: tl.constexpr, G_TILES: tl.constexpr,
    EMU: tl.constexpr = False, EMU_PID: tl.constexpr = 0, EMU_NPROG: tl.constexpr = 1,
    EMU_STAGE: tl.constexpr = 0, EMU_CHUNK: tl.constexpr = 0, EMU_ITEMS: tl.constexpr = 0,
    SKIP_STAGES: tl.constexpr = 0,
):  # fmt: skip
    """EMU*: the CPU emulation (symm_ring_emu). SKIP_STAGES (benchmark ablation only, the results
    are then wrong): bit 0 leaves out the reduce stage, bit 1 the gather stage (slots still
    released, so the ring turns)."""
    dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
    KP: tl.constexpr = triton.next_power_of_2(TOP_K)
    if EMU:
        pid = EMU_PID
        nprog = EMU_NPROG
        start = 0
        timeout_ns = timeout
        abort_ptr = emu_abort_ptr + rank
    else:
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        start = _globaltimer()
        timeout_ns = timeout.to(tl.int64) * 1000
        abort_ptr = tl.load(ptrs_ptr + rank).to(tl.pointer_type(tl.int32))
    base = tl.load(state_ptr)  # chunks of every earlier call (int64)
    lane = tl.arange(0, 32)
    if not EMU:  # the ticket: issued after the base load returned (its predicate depends on it)
        ticket = tl.atomic_add(
            state_ptr + 1 + lane * 0, lane * 0 + 1, mask=(lane == 0) & (base >= 0),
            sem="relaxed", scope="gpu",
        )  # fmt: skip
    nchunks = tl.cdiv(tokens, chunk)
    for it in range(EMU_CHUNK if EMU else 0, EMU_CHUNK + 1 if EMU else nchunks + 2):
        c = it  # finalize(c)
        if ((not EMU) or (EMU_STAGE == 0)) and (c < nchunks):
            seq = base + c
            slot = seq % _SLOTS
            # the chunk that used this slot SLOTS chunks ago is released on every rank
            short = wait_slot_free(
                ptrs_ptr, emu_freed_ptr, slot, (seq // _SLOTS) * _UNIT, abort_ptr, start,
                timeout_ns, WORLD, EMU,
            )  # fmt: skip
            if short != 0:
                fail(short, abort_ptr, ptrs_ptr, state_ptr, rank, WORLD, EMU)
            stage_finalize(
                c, tl.minimum(chunk, tokens - c * chunk), chunk, pid, nprog, rank, hidden, slot,
                ptrs_ptr, bufs_ptr, buf_elems, gemm2_ptr, perm_ptr, weight_ptr, shared_ptr,
                routed_scaling, dtype, WORLD, TOP_K, KP, HAS_SHARED, F_ROWS, F_COLS, EMU,
                EMU_ITEMS,
            )  # fmt: skip
        c = it if EMU else it - 1  # reduce(c)
        stage_on: tl.constexpr = (not EMU or EMU_STAGE == 1) and (SKIP_STAGES & 1) == 0
        if stage_on and (c >= 0) and (c < nchunks):
            stage_reduce(
                c, tl.minimum(chunk, tokens - c * chunk), chunk, pid, nprog, rank, hidden,
                (base + c) % _SLOTS, ptrs_ptr, bufs_ptr, buf_elems, abort_ptr, state_ptr, start,
                timeout_ns, residual_ptr, dtype, WORLD, R_ROWS, R_COLS, EMU, EMU_ITEMS,
            )  # fmt: skip
        c = it if EMU else it - 2  # gather(c), then this program releases the slot
        if ((not EMU) or (EMU_STAGE == 2)) and (c >= 0) and (c < nchunks):
            if (SKIP_STAGES & 2) == 0:
                stage_gather(
                    c, tl.minimum(chunk, tokens - c * chunk), chunk, pid, nprog, rank, hidden,
                    (base + c) % _SLOTS, ptrs_ptr, bufs_ptr, buf_elems, abort_ptr, state_ptr,
                    start, timeout_ns, gamma_ptr, weight_bias, residual_out_ptr, norm_out_ptr,
                    q_ptr, sf_ptr, eps, quant_scale, sf_cols, WORLD, QUANT, SWIZZLED, HW_CVT,
                    G_ROWS, G_COLS, G_TILES, EMU, EMU_ITEMS,
                )  # fmt: skip
            release(ptrs_ptr, emu_freed_ptr, rank, (base + c) % _SLOTS, pid, nprog, EMU)
    if (QUANT == 2) and SWIZZLED and ((not EMU) or (EMU_STAGE == 3)):
        for item in range(EMU_PID if EMU else pid, EMU_ITEMS if EMU else sf_pad_items, nprog):
            if item < sf_pad_items:
                _sf_padding_item(item, sf_ptr, tokens, sf_rows, sf_cols)
    if not EMU:  # the last ticket advances the chunk base (every program read it before)
        done = (lane == 0) & (ticket == nprog - 1)
        tl.store(state_ptr + lane * 0, lane * 0 + base + nchunks, mask=done)
        tl.store(state_ptr + 1 + lane * 0, lane * 0, mask=done)


# ------------------------------------------------------------------------------------------------
# launch
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RingShape:
    """A launch variant: chunk tokens (fixed per workspace: it sizes the slots), programs per SM
    (capped by the compiled kernel's occupancy: every program must be resident), warps, and the
    finalize / reduce / gather tiles [rows, columns] (columns: powers of two >= 64)."""

    chunk: int = 256
    programs_per_sm: int = 8
    warps: int = 4
    f_rows: int = 2
    f_cols: int = 1024
    r_rows: int = 2
    r_cols: int = 1024
    g_rows: int = 2
    g_cols: int = 1024

    def constexprs(self, hidden: int) -> dict:
        g_cols = padded_cols(self.g_cols, hidden)
        return dict(
            F_ROWS=self.f_rows,
            F_COLS=padded_cols(self.f_cols, hidden),
            R_ROWS=self.r_rows,
            R_COLS=padded_cols(self.r_cols, hidden),
            G_ROWS=self.g_rows,
            G_COLS=g_cols,
            G_TILES=triton.cdiv(hidden, g_cols),
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


def _args(ws, io: dict, quant: int, quant_scale: float, swizzled: bool) -> tuple[list, dict]:
    perm = io["perm"]
    tokens, top_k = perm.shape
    hidden = io["residual"].shape[1]
    sf = io["sf"]
    sf_rows, sf_cols = (sf.shape[0], sf.shape[1]) if quant == QUANT_NVFP4 else (tokens, 0)
    pad = sf_padding_items(tokens, sf_rows, sf_cols) if quant == QUANT_NVFP4 and swizzled else 0
    args = [
        io["ptrs"], io["bufs"], io["buf_elems"], io["emu_abort"], io["emu_freed"], io["state"],
        io["gemm2_out"], perm, io["weights"],
        io["shared"] if io["shared"] is not None else io["residual"],
        io["residual"], io["gamma"], io["residual_out"], io["norm_out"], io["q"], sf,
        tokens, hidden, io["chunk"], io["rank"], float(io["routed_scaling"]), float(io["eps"]),
        float(io["weight_bias"]), float(quant_scale), sf_rows, sf_cols, pad, io["timeout"],
    ]  # fmt: skip
    constexprs = dict(
        WORLD=io["world"],
        TOP_K=top_k,
        HAS_SHARED=io["shared"] is not None,
        QUANT=quant,
        SWIZZLED=bool(swizzled),
        HW_CVT=io["residual"].is_cuda,
    )
    return args, constexprs


def fused_into(
    ws,
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
    routed_scaling: float,
    eps: float,
    weight_bias: float,
    quant: int,
    quant_scale: float,
    swizzled: bool,
    shape: Optional[RingShape] = None,
) -> None:
    """One GPU launch. `ws`: ptrs (int64 [W + 1]: every rank's buffer, then the pinned error word),
    state (int64 [STATE_WORDS]), world, rank, chunk, num_sms (the same on every rank), timeout_ns.
    Any T (the ring is reused within the call); T == 0 launches nothing (on every rank).
    shape: a launch variant (its chunk must be the workspace's). q / sf: uint8 views of the FP8 /
    NVFP4 outputs (any tensor when unused)."""
    if perm.shape[0] == 0:
        return
    io = dict(
        gemm2_out=gemm2_out, perm=perm, weights=weights, shared=shared, residual=residual,
        gamma=gamma, residual_out=residual_out, norm_out=norm_out, q=q, sf=sf,
        routed_scaling=routed_scaling, eps=eps, weight_bias=weight_bias,
    )  # fmt: skip
    launch(ws, io, quant, quant_scale, swizzled, shape or DEFAULT_SHAPE)


def launch(ws, io: dict, quant: int, quant_scale: float, swizzled: bool, shape, **hooks) -> None:
    """fused_into's launch; `hooks` are the kernel's benchmark-only constexprs (symm_ring_emu)."""
    if shape.chunk != ws.chunk:
        raise ValueError(f"symm_ring: shape.chunk={shape.chunk} but the workspace's is {ws.chunk}")
    io = dict(
        io, ptrs=ws.ptrs, bufs=ws.state, buf_elems=0, emu_abort=ws.state, emu_freed=ws.state,
        state=ws.state, chunk=ws.chunk, rank=ws.rank, timeout=ws.timeout_ns // 1000,
        world=ws.world,
    )  # fmt: skip
    args, constexprs = _args(ws, io, quant, quant_scale, swizzled)
    constexprs.update(shape.constexprs(io["residual"].shape[1]), **hooks)
    key = (tuple(sorted(constexprs.items())), shape.warps, io["residual"].device)
    per_sm = _OCCUPANCY.get(key)
    if per_sm is None:
        compiled = _ring_kernel.warmup(*args, grid=(1,), num_warps=shape.warps, **constexprs)
        compiled._init_handles()  # loads it: n_regs is known from here on
        per_sm = _OCCUPANCY[key] = resident_per_sm(compiled, shape.warps)
    programs = ws.num_sms * min(shape.programs_per_sm, per_sm)
    _ring_kernel[(programs,)](*args, num_warps=shape.warps, **constexprs)
