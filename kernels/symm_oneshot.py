"""One-launch MoE epilogue over symmetric memory: finalize + shared add + all-reduce + residual add +
RMSNorm (+ FP8 / NVFP4), for small T on one node, with NVLink multicast never used.

Per call, on every rank (all ranks launch the same grid, since T is the same on every rank):
  1. publish: each program finalizes (row, column-chunk) items of its rank's partial
         partial[t] = round(routed_scaling * sum_k w[t,k] * gemm2_out[perm[t,k]] + shared[t])
     (fp32 accumulate, ONE rounding to the activation dtype) and stores it into slot
     [epoch parity][its rank] of every rank's symmetric buffer (its own included), then, after a CTA
     barrier, stores the call's epoch into flag [its rank][program] of every rank (release, system
     scope).
  2. wait: each program spins (acquire, system scope, bounded by %globaltimer) until the flags of all
     programs of all ranks hold this epoch or a later one.
  3. reduce + norm: each program sums the W rounded partials of its rows **in rank order** in fp32 from
     its local buffer, adds the residual, and writes residual_out, norm_out = round(x * rsqrt(mean(x^2)
     + eps) * (gamma + weight_bias)) and the quantized norm_out. Every rank reads the same rounded
     values in the same order, so outputs are bitwise identical on all ranks. Error: the partial's
     rounding plus each output's rounding (2 roundings to the activation dtype).

Memory-ordering argument (epoch e, slot e % 2, no host state, so CUDA graphs replay it):
- The epoch lives in device memory (state[0]); every program reads it first; the last program to
  finish (state[1], an acq_rel done-counter) stores e + 1. Launches on one stream are ordered, so the
  next call reads e + 1.
- A reader never reads a slot before it is written: it waits for flag >= e from every program of
  every rank; each flag store is a system-scope release issued after a CTA barrier that follows that
  program's data stores. A flag value > e comes from a later launch of that rank, which started only
  after its launch e had completed.
- A writer never overwrites a slot a peer may still read: rank r writes slot e % 2 again only in call
  e + 2, which starts after r's call e + 1 completed; that call waited for flags >= e + 1 from every
  rank p, which p stores only in its call e + 1, after its call e (the reads of slot e % 2) completed.
  Flags compare with ">= e" (wrap-safe int32 difference), so a peer running one call ahead cannot hide
  the current epoch by overwriting a flag.
- T = 0 launches nothing on every rank (T is the same on all ranks), so epochs stay in step.
- The grid is at most the SM count (one program per SM fits), so every program that is waited on is
  resident.
- Spins end after `timeout_ns`: the program then writes NaN outputs, an error word into pinned host
  memory (readable by the host without a sync) and into state[2], and an abort word into every rank's
  buffer, so every later call on every rank fails at once instead of waiting (the bridge must be
  rebuilt).

Buffer layout per rank (bytes): int32 flags [W][MAX_PROGS], int32 abort word, padding to 256, then the
activation-dtype data slots [2][W][cap][H].

The same @triton.jit helpers serve the fused GPU kernel and two entry points that run under
TRITON_INTERPRET=1 with emulated ranks (`emulate_publish`, `emulate_reduce_norm`): only the signalling
is GPU-only.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .quant import QUANT_NVFP4, _e2m1_codes, _e4m3_rne_satfinite, quantize_row
from .rounding import round_to

MAX_PROGS = 512  # flags per source rank; the grid never exceeds it (nor the SM count)
ERR_TIMEOUT = tl.constexpr(1 << 16)  # error word: bit 16 = this rank timed out; bits 0-15 = ranks missed
ERR_ABORTED = tl.constexpr(1 << 17)  # a peer timed out earlier (bits 20-27: that rank; 0-15: whom it missed)


def flags_bytes(world: int) -> int:
    """Bytes before the data slots: flags, abort word, padding to 256."""
    return -(-(world * MAX_PROGS + 1) * 4 // 256) * 256


def buffer_bytes(world: int, cap: int, hidden: int, elem_size: int) -> int:
    return flags_bytes(world) + 2 * world * cap * hidden * elem_size


# ---------------------------------------------------------------------------------------------------
# arithmetic shared by the fused kernel and the emulation entry points
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _finalize_chunk(gemm2_ptr, perm_ptr, weight_ptr, shared_ptr, row, cols, hidden, routed_scaling,
                    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr):
    """fp32 [BLOCK]: routed_scaling * sum_k w * gemm2_out[perm] (+ shared) for row `row` (int64), `cols`.
    Slots with perm == -1 are never read (a skipped slot's weight may be garbage)."""
    in_row = cols < hidden
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        src = tl.load(perm_ptr + row * TOP_K + k).to(tl.int64)
        weight = tl.load(weight_ptr + row * TOP_K + k).to(tl.float32)
        valid = (cols * 0 + src) >= 0  # vector form: the interpreter rejects a scalar-bool mask
        x = tl.load(gemm2_ptr + src * hidden + cols, mask=in_row & valid, other=0.0).to(tl.float32)
        acc += tl.where(valid, x * weight, 0.0)
    acc = acc * routed_scaling
    if HAS_SHARED:
        acc += tl.load(shared_ptr + row * hidden + cols, mask=in_row, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _row_sum(slots_ptr, rank_stride, residual_ptr, row, cols, hidden, WORLD: tl.constexpr):
    """fp32: residual + (partial_0 + partial_1 + ... in rank order) at (row, cols)."""
    mask = cols < hidden
    offs = row * hidden + cols
    s = tl.load(slots_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for q in tl.static_range(1, WORLD):
        s += tl.load(slots_ptr + q * rank_stride + offs, mask=mask, other=0.0).to(tl.float32)
    return tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32) + s


@triton.jit
def _nvfp4_chunk(y, row, chunk, hidden, q_ptr, sf_ptr, global_scale, sf_cols,
                 SWIZZLED: tl.constexpr, BLOCK: tl.constexpr):
    """NVFP4 of columns [chunk*BLOCK, (chunk+1)*BLOCK) of a row (y rounded, 0 past H); BLOCK % 64 == 0,
    so the chunks together cover the swizzled padding columns too (written 0)."""
    yb = tl.reshape(y.to(tl.float32), [BLOCK // 16, 16])
    amax = tl.max(tl.abs(yb), axis=1)
    sf_code, sf = _e4m3_rne_satfinite(tl.math.div_rn(global_scale * amax, 6.0))
    scaled = yb * global_scale
    codes = _e2m1_codes(tl.abs(scaled), sf[:, None]) | ((scaled < 0).to(tl.int32) << 3)
    lo, hi = tl.split(tl.reshape(codes, [BLOCK // 2, 2]))
    packed = chunk * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
    tl.store(q_ptr + row * (hidden // 2) + packed, (lo | (hi << 4)).to(tl.uint8), mask=packed < hidden // 2)
    kb = chunk * (BLOCK // 16) + tl.arange(0, BLOCK // 16)
    sf_byte = tl.where(kb < hidden // 16, sf_code, 0).to(tl.uint8)
    if SWIZZLED:
        off = ((row // 128) * (sf_cols * 128) + (kb // 4) * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4
               + (kb % 4))
        tl.store(sf_ptr + off, sf_byte, mask=kb < sf_cols)
    else:
        tl.store(sf_ptr + row * (hidden // 16) + kb, sf_byte, mask=kb < hidden // 16)


@triton.jit
def _reduce_norm_item(row, chunk, slots_ptr, rank_stride, residual_ptr, gamma_ptr, residual_out_ptr,
                      norm_out_ptr, q_ptr, sf_ptr, tokens, hidden, eps, weight_bias, quant_scale, sf_cols, bad,
                      WORLD: tl.constexpr, QUANT: tl.constexpr, SWIZZLED: tl.constexpr, BLOCK: tl.constexpr,
                      ROW_BLOCK: tl.constexpr, HW_CVT: tl.constexpr):
    """Item (row (int64), column chunk of BLOCK). It reads its whole row once (ROW_BLOCK >= H, for the
    sum of squares) and, when the row has several chunks, its own chunk again (issued together with the
    row, so no extra latency); it writes only its chunk. bad != 0 writes NaN."""
    rcols = tl.arange(0, ROW_BLOCK)
    xr = _row_sum(slots_ptr, rank_stride, residual_ptr, row, rcols, hidden, WORLD)
    if BLOCK == ROW_BLOCK:
        cols = rcols
        x = xr
    else:
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        x = _row_sum(slots_ptr, rank_stride, residual_ptr, row, cols, hidden, WORLD)
    x = tl.where((cols * 0 + bad) != 0, float("nan"), x)
    mask = cols < hidden
    offs = row * hidden + cols
    tl.store(residual_out_ptr + offs, round_to(x, residual_out_ptr.dtype.element_ty), mask=mask)
    inv_rms = tl.rsqrt(tl.sum(xr * xr, axis=0) / hidden + eps)
    g = tl.load(gamma_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_bias
    y = round_to(x * inv_rms * g, norm_out_ptr.dtype.element_ty)
    tl.store(norm_out_ptr + offs, y, mask=mask)
    if QUANT == 1:
        quantize_row(y, row, cols, tokens, hidden, q_ptr, sf_ptr, quant_scale, sf_cols, QUANT, SWIZZLED, BLOCK,
                     HW_CVT)
    if QUANT == 2:
        _nvfp4_chunk(tl.where(mask, y, 0.0), row, chunk, hidden, q_ptr, sf_ptr, quant_scale, sf_cols, SWIZZLED,
                     BLOCK)


@triton.jit
def _sf_padding_item(item, sf_ptr, tokens, sf_cols):
    """Swizzled scale padding rows T .. round_up(T, 128): item = (padding row, 128 scale columns) -> 0."""
    kchunks = tl.cdiv(sf_cols, 128)
    row = tokens + item // kchunks
    kb = (item % kchunks) * 128 + tl.arange(0, 128)
    off = ((row // 128) * (sf_cols * 128) + (kb // 4) * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4
           + (kb % 4))
    tl.store(sf_ptr + off, tl.zeros([128], dtype=tl.uint8), mask=kb < sf_cols)


# ---------------------------------------------------------------------------------------------------
# signalling (GPU only)
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _peer_ptr(ptrs_ptr, q, dtype: tl.constexpr):
    """Rank q's buffer as a `dtype` pointer. Buffers are 256-byte aligned: saying so lets the slot
    loads and stores vectorize (the compiler knows nothing about an integer cast to a pointer)."""
    return tl.multiple_of(tl.load(ptrs_ptr + q).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _ld_acquire_sys(ptrs):
    return tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit(do_not_specialize=["tokens", "sf_rows", "rank", "timeout_us"])  # one compile for every T
def _fused_kernel(ptrs_ptr, state_ptr, gemm2_ptr, perm_ptr, weight_ptr, shared_ptr, residual_ptr, gamma_ptr,
                  residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr, tokens, hidden, cap, data_off, rank,
                  routed_scaling, eps, weight_bias, quant_scale, sf_rows, sf_cols, timeout_us,
                  WORLD: tl.constexpr, MAXP: tl.constexpr, FLAGS_BLOCK: tl.constexpr, TOP_K: tl.constexpr,
                  HAS_SHARED: tl.constexpr, QUANT: tl.constexpr, SWIZZLED: tl.constexpr,
                  BLOCK1: tl.constexpr, BLOCK2: tl.constexpr, ROW_BLOCK: tl.constexpr, HW_CVT: tl.constexpr,
                  ABLATE: tl.constexpr = 0):
    # ABLATE (benchmarks only; results are wrong): 1 no wait, 2 no peers (own slot, no flags, no wait),
    # 3 signal only (flags + wait, no finalize, no norm): where the time goes
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
    epoch = tl.load(state_ptr)
    slot_rows = ((epoch & 1) * WORLD).to(tl.int64) * cap  # first row of this parity's [W][cap] block

    # 1. finalize + publish into every rank's slot [parity][rank]
    chunks1 = tl.cdiv(hidden, BLOCK1)
    for item in range(pid, tokens * chunks1 if ABLATE != 3 else 0, nprog):
        row = (item // chunks1).to(tl.int64)
        cols = (item % chunks1) * BLOCK1 + tl.arange(0, BLOCK1)
        part = round_to(_finalize_chunk(gemm2_ptr, perm_ptr, weight_ptr, shared_ptr, row, cols, hidden,
                                        routed_scaling, TOP_K, HAS_SHARED), dtype)
        dst_row = (slot_rows + rank * cap + row) * hidden + data_off
        if ABLATE == 2:
            tl.store(_peer_ptr(ptrs_ptr, rank, dtype) + dst_row + cols, part, mask=cols < hidden)
        else:
            for q in tl.static_range(WORLD):
                base = _peer_ptr(ptrs_ptr, q, dtype)
                tl.store(base + dst_row + cols, part, mask=cols < hidden)
    tl.debug_barrier()  # every thread's stores precede the release below (cumulativity)
    if ABLATE != 2:
        for q in tl.static_range(WORLD):
            flags_q = tl.load(ptrs_ptr + q).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(flags_q + rank * MAXP + pid, epoch, sem="release", scope="sys")

    # 2. wait for every program of every rank (bounded)
    local_flags = tl.load(ptrs_ptr + rank).to(tl.pointer_type(tl.int32))
    idx = tl.arange(0, FLAGS_BLOCK)
    is_flag = idx < WORLD * nprog
    src = idx // nprog
    addr = tl.where(is_flag, local_flags + src * MAXP + idx % nprog, local_flags + WORLD * MAXP)
    start = _globaltimer()
    now = start
    missing = 1 if ABLATE == 0 or ABLATE == 3 else 0
    aborted = 0
    f = tl.zeros([FLAGS_BLOCK], dtype=tl.int32)
    timeout_ns = timeout_us.to(tl.int64) * 1000
    while (missing > 0) & (aborted == 0) & (now - start < timeout_ns):
        f = _ld_acquire_sys(addr)
        missing = tl.sum((is_flag & ((f - epoch) < 0)).to(tl.int32), axis=0)
        aborted = tl.max(tl.where(is_flag, 0, f), axis=0)  # the abort word
        now = _globaltimer()
    bad = ((missing > 0) | (aborted != 0)).to(tl.int32)
    if bad != 0:
        who = tl.reduce(tl.where(is_flag & ((f - epoch) < 0), 1 << src, 0), 0, _or)
        err = tl.where(aborted != 0, aborted, ERR_TIMEOUT | who)
        host_err = tl.load(ptrs_ptr + WORLD).to(tl.pointer_type(tl.int32))
        tl.store(host_err, err)
        tl.store(state_ptr + 2, err)
        if aborted == 0:  # tell every rank (itself included) to stop waiting from now on
            for q in tl.static_range(WORLD):
                flags_q = tl.load(ptrs_ptr + q).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(flags_q + WORLD * MAXP, ERR_ABORTED | (rank << 20) | who, sem="relaxed",
                               scope="sys")

    # 3. reduce in rank order + residual + RMSNorm (+ quant) from the local buffer
    local_slots = _peer_ptr(ptrs_ptr, rank, dtype) + data_off + slot_rows * hidden
    chunks2 = tl.cdiv(hidden, BLOCK2)
    for item in range(pid, tokens * chunks2 if ABLATE != 3 else 0, nprog):
        _reduce_norm_item((item // chunks2).to(tl.int64), item % chunks2, local_slots, cap * hidden, residual_ptr,
                          gamma_ptr, residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr, tokens, hidden, eps,
                          weight_bias, quant_scale, sf_cols, bad, WORLD, QUANT, SWIZZLED, BLOCK2, ROW_BLOCK, HW_CVT)
    if QUANT == 2:
        if SWIZZLED:
            for item in range(pid, (sf_rows - tokens) * tl.cdiv(sf_cols, 128), nprog):
                _sf_padding_item(item, sf_ptr, tokens, sf_cols)

    # 4. the last program to finish advances the epoch for the next launch
    done = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == nprog - 1:
        tl.store(state_ptr, epoch + 1)
        tl.store(state_ptr + 1, 0)


# ---------------------------------------------------------------------------------------------------
# emulation entry points (CPU CI, any W in one process)
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _emu_publish_kernel(gemm2_ptr, perm_ptr, weight_ptr, shared_ptr, slots_ptr, tokens, hidden, rank,
                        routed_scaling, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK1: tl.constexpr):
    chunks1 = tl.cdiv(hidden, BLOCK1)
    item = tl.program_id(0)
    row = (item // chunks1).to(tl.int64)
    cols = (item % chunks1) * BLOCK1 + tl.arange(0, BLOCK1)
    part = round_to(_finalize_chunk(gemm2_ptr, perm_ptr, weight_ptr, shared_ptr, row, cols, hidden,
                                    routed_scaling, TOP_K, HAS_SHARED), slots_ptr.dtype.element_ty)
    tl.store(slots_ptr + (rank * tokens + row) * hidden + cols, part, mask=cols < hidden)


@triton.jit
def _emu_reduce_kernel(slots_ptr, residual_ptr, gamma_ptr, residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr,
                       tokens, hidden, eps, weight_bias, quant_scale, sf_cols, WORLD: tl.constexpr,
                       QUANT: tl.constexpr, SWIZZLED: tl.constexpr, BLOCK2: tl.constexpr,
                       ROW_BLOCK: tl.constexpr, HW_CVT: tl.constexpr):
    """One program per item: (row, chunk) items first, then swizzled padding items."""
    chunks2 = tl.cdiv(hidden, BLOCK2)
    item = tl.program_id(0)
    if item < tokens * chunks2:
        _reduce_norm_item((item // chunks2).to(tl.int64), item % chunks2, slots_ptr, tokens * hidden,
                          residual_ptr, gamma_ptr, residual_out_ptr, norm_out_ptr, q_ptr, sf_ptr, tokens, hidden,
                          eps, weight_bias, quant_scale, sf_cols, 0, WORLD, QUANT, SWIZZLED, BLOCK2, ROW_BLOCK,
                          HW_CVT)
    else:
        if QUANT == 2:
            if SWIZZLED:
                _sf_padding_item(item - tokens * chunks2, sf_ptr, tokens, sf_cols)


def row_block(hidden: int) -> int:
    return max(64, triton.next_power_of_2(hidden))


def emulate_publish(slots: torch.Tensor, rank: int, gemm2_out: torch.Tensor, perm: torch.Tensor,
                    weights: torch.Tensor, shared: Optional[torch.Tensor], routed_scaling: float,
                    block1: int = 64) -> None:
    """Rank `rank`'s step 1 into slots [W, T, H] (activation dtype), the stand-in for slot [parity][src]
    of every rank's buffer (all ranks hold the same copy)."""
    tokens, top_k = perm.shape
    hidden = gemm2_out.shape[1]
    if tokens == 0:
        return
    _emu_publish_kernel[(tokens * triton.cdiv(hidden, block1),)](
        gemm2_out, perm, weights, shared if shared is not None else slots, slots, tokens, hidden, rank,
        float(routed_scaling), TOP_K=top_k, HAS_SHARED=shared is not None, BLOCK1=block1)


def emulate_reduce_norm(slots: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor,
                        residual_out: torch.Tensor, norm_out: torch.Tensor, q: torch.Tensor, sf: torch.Tensor,
                        eps: float, weight_bias: float, quant: int, quant_scale: float, swizzled: bool,
                        block2: int = 64) -> None:
    """Step 3 from slots [W, T, H] on any rank. q: uint8 ([T, H] fp8 codes / [T, H/2] fp4); sf: uint8."""
    world, tokens, hidden = slots.shape
    if tokens == 0:
        return
    block2 = min(block2, row_block(hidden))
    sf_rows, sf_cols = (sf.shape[0], sf.shape[1]) if quant == QUANT_NVFP4 else (tokens, 0)
    items = tokens * triton.cdiv(hidden, block2)
    if quant == QUANT_NVFP4 and swizzled:
        items += (sf_rows - tokens) * triton.cdiv(sf_cols, 128)
    _emu_reduce_kernel[(items,)](
        slots, residual, gamma, residual_out, norm_out, q, sf, tokens, hidden, float(eps), float(weight_bias),
        float(quant_scale), sf_cols, WORLD=world, QUANT=quant, SWIZZLED=swizzled, BLOCK2=block2,
        ROW_BLOCK=row_block(hidden), HW_CVT=slots.is_cuda)


# ---------------------------------------------------------------------------------------------------
# the fused launch
# ---------------------------------------------------------------------------------------------------
def default_launch(tokens: int, hidden: int) -> tuple[int, int, int]:
    """(BLOCK1, BLOCK2, num_warps). Measured on 2x H200 (H=7168, K=8, graph, rotated inputs; us at
    T=1/16/64/256): (1024, whole row, 8 warps) 8.0/12.0/17.5/41.3 was best or within noise of the best at
    every T; narrow chunks that spread a row over many SMs lost (256, 512, 8: 9.7/17.8/45.7/155), since
    each chunk re-reads its whole row for the sum of squares."""
    rb = row_block(hidden)
    return min(1024, rb), rb, 8 if rb >= 4096 else 4


def fused_into(ws, residual_out: torch.Tensor, norm_out: torch.Tensor, q: torch.Tensor, sf: torch.Tensor,
               gemm2_out: torch.Tensor, perm: torch.Tensor, weights: torch.Tensor, shared: Optional[torch.Tensor],
               residual: torch.Tensor, gamma: torch.Tensor, routed_scaling: float, eps: float, weight_bias: float,
               quant: int, quant_scale: float, swizzled: bool,
               launch: Optional[tuple[int, int, int]] = None, ablate: int = 0) -> None:
    """One launch. `ws`: ptrs (int64 [W + 1]: every rank's buffer address, then the pinned error word's),
    state (int32 [4] device: epoch, done-counter, error), world, rank, cap, data_off (elements),
    num_sms, timeout_ns. T == 0 launches nothing (on every rank). T must be <= ws.cap."""
    tokens, top_k = perm.shape
    hidden = residual.shape[1]
    if tokens == 0:
        return
    block1, block2, warps = launch or default_launch(tokens, hidden)
    rb = row_block(hidden)
    block2 = min(block2, rb)
    items = max(tokens * triton.cdiv(hidden, block1), tokens * triton.cdiv(hidden, block2))
    nprog = max(1, min(ws.num_sms, MAX_PROGS, items))
    sf_rows, sf_cols = (sf.shape[0], sf.shape[1]) if quant == QUANT_NVFP4 else (tokens, 0)
    flags_block = triton.next_power_of_2(ws.world * min(ws.num_sms, MAX_PROGS) + 1)  # same for every T
    _fused_kernel[(nprog,)](
        ws.ptrs, ws.state, gemm2_out, perm, weights, shared if shared is not None else residual, residual, gamma,
        residual_out, norm_out, q, sf, tokens, hidden, ws.cap, ws.data_off, ws.rank, float(routed_scaling),
        float(eps), float(weight_bias), float(quant_scale), sf_rows, sf_cols, ws.timeout_ns // 1000,
        WORLD=ws.world, MAXP=MAX_PROGS, FLAGS_BLOCK=flags_block, TOP_K=top_k,
        HAS_SHARED=shared is not None, QUANT=quant, SWIZZLED=swizzled, BLOCK1=block1, BLOCK2=block2,
        ROW_BLOCK=rb, HW_CVT=True, ABLATE=ablate, num_warps=warps)
