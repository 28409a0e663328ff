"""One-launch MoE epilogue over symmetric memory: finalize + shared add + all-reduce + residual
add + RMSNorm (+ FP8 / NVFP4), for small T on one node, with NVLink multicast never used.

The data carries its own arrival (Lamport-style): every data slot holds the sentinel -0.0 (bits
0x8000 in bf16 and fp16) until its partial lands, and a published partial never holds -0.0 (it is
mapped to +0.0, which changes no sum: x + (-0.0) == x + (+0.0) for every x != 0, and the
rank-ordered sum never starts from the residual, so a sign of zero can only differ when the whole
sum is zero). A reader spins on the data itself: no flags, no fence before a flag, no
second round trip.

Per call, on every rank (all ranks launch the same grid, since T is the same on every rank),
epoch e, slot s = e % 3:
  A. publish: each program finalizes (row, column chunk) items of its rank's partial
         partial[t] = round(routed_scaling * sum_k w[t,k] * gemm2_out[perm[t,k]] + shared[t])
     (fp32 accumulate, ONE rounding to the activation dtype, -0.0 -> +0.0) and stores it into
     slot [s][its rank] of every rank's symmetric buffer (its own included), plain stores.
  B. clear: the local slot (s + 2) % 3, used by the previous call, goes back to the sentinel for the
     rows that call used (its T is kept in device state), for all sources.
  C. reduce + norm: each program takes (row, column chunk) items, reads the row's W partials from
     its local buffer (volatile loads, all ranks' rows, the whole row: the sum of squares needs it)
     until none is the sentinel (bounded), sums them **in rank order** in fp32, adds the residual,
     and writes its chunk of residual_out,
     norm_out = round(x * rsqrt(mean(x^2) + eps) * (gamma + weight_bias)) and the quantized
     norm_out. Every rank reads the same rounded values in the same order with the same reduction
     tree, so outputs are bitwise identical on all ranks. Error: the partial's rounding plus each
     output's rounding (2 roundings to the activation dtype).
Phase A never waits, so no program waits for a program that waits for it (all publishes of all
programs precede, in their own program order, every wait).

Memory-ordering argument (no host state: CUDA graphs replay it):
- Epoch: state[0] in device memory holds e mod 3 (the slot; it never wraps). Each program loads it
  (and the previous slot's row count), then takes a ticket (atomic add on state[1], release, gpu
  scope: the loads are ordered before it). The program holding the last ticket has, through the
  release sequence of the counter and an acquire fence, seen every program's loads done; at its end
  it stores (e + 1) mod 3, this slot's T, and resets the counter. Launches on one stream are
  ordered, so the next call reads the next slot.
- A reader never uses a slot before it is written: it uses a value only once it differs from the
  sentinel, and each element is naturally aligned (2 bytes, single-copy atomic), so a torn or
  reordered arrival over NVLink shows as "not yet" and is polled again. The polls are volatile
  loads (L1 bypassed; the point of coherence of a rank's buffer is its own L2, where its own stores
  and its peers' NVLink stores land).
- A slot is never overwritten while a peer may still read it, and never read stale: rank r's slot
  s = e % 3 is written by peers in call e, read by r in call e, cleared by r in call e + 1 (after r
  saw every value of it in call e, so the clear is later in coherence order than the data), and
  written again by a peer p only in call e + 3. p starts call e + 3 only after its call e + 2
  completed, which needed r's data of call e + 2, which r publishes only after its call e + 1 (the
  clear) completed: the clear precedes the new data at r's L2. Peers are at most one call apart (a
  rank finishes call e only with every peer's call-e data), so slot (e + 1) % 3 may be written by a
  peer running ahead while r is still in call e, and r clears only (e + 2) % 3:
  three slots, not two.
- The previous call's T is kept per slot in state[4 + slot]; the row counts differ per call, and the
  clear covers exactly the rows that call dirtied.
- T = 0 launches nothing on every rank (T is the same on all ranks), so epochs stay in step.
- The grid is at most the SM count (one program per SM fits), so every program that is waited
  on is resident.
- Timeout: the poll's exit condition is one block reduction over (pending sentinel | timer expired |
  abort word set), so every warp of a program leaves the loop on the same iteration and agrees on
  the outcome (a per-thread %globaltimer test would let warps leave on different iterations). On a
  timeout the program writes NaN outputs, an error word (bit 16 + the ranks whose data did not
  arrive) into pinned host memory (read by the host without a sync) and into state[2], and an abort
  word into every rank's header, so every later call on every rank fails at once instead of waiting
  (the bridge must be rebuilt).

Buffer layout per rank: see `protocol` (a 256-byte header with the abort word, then the data
slots [3][W][cap][H] of the activation dtype, all the sentinel at creation).

The CPU tests and the benchmarks' ablations run this very kernel body through the two hooks that
`protocol` documents (PHASES, EMULATED); fusion_bridge/testing/symm_oneshot_rig.py is their
only caller.
"""

from __future__ import annotations

from typing import Callable, Optional

import triton
import triton.language as tl

from fusion_bridge.kernels import quant_codes as QC
from fusion_bridge.kernels.finalize_add import finalize_row
from fusion_bridge.kernels.launch_cache import KernelLauncher
from fusion_bridge.kernels.records import RowForm, RowOutputs, RowSource
from fusion_bridge.kernels.row_epilogue import row_outputs
from fusion_bridge.kernels.symm import protocol as P
from fusion_bridge.kernels.symm.oneshot_configs import (  # noqa: F401 (CONFIG_VARIANTS, variant_config: re-exported)
    CONFIG_VARIANTS,
    OneshotConfig,
    default_config,
    variant_config,
)
from fusion_bridge.kernels.quant import QUANT_NVFP4, row_block, sf_padding_item
from fusion_bridge.kernels.symm.device import (
    abort_word_ptr,
    advance_epoch,
    call_state,
    clear_item,
    missing_ranks,
    payload_bits,
    peer_ptr,
    report_error,
    start_clock,
    take_ticket,
    wait_row,
)
from fusion_bridge.kernels.symm.protocol import SymmLayer


@triton.jit
def _rank_ordered_sum(v, dtype: tl.constexpr, WORLD: tl.constexpr, WP: tl.constexpr):
    """fp32 [ROW_BLOCK]: the row's W partials (int16 bits [WP, ROW_BLOCK]) summed in rank order
    (exact selections: one nonzero term per column and rank)."""
    qi = tl.arange(0, WP)[:, None]
    vf = v.to(dtype, bitcast=True).to(tl.float32)
    s = tl.sum(tl.where(qi == 0, vf, 0.0), axis=0)
    for q in tl.static_range(1, WORLD):  # rank order
        s += tl.sum(tl.where(qi == q, vf, 0.0), axis=0)
    return s


@triton.jit(do_not_specialize=["tokens", "sf_rows", "rank", "timeout"])  # one compile per BLOCK1
def _oneshot_kernel(
    ws,
    src,
    out,
    tokens,
    slots,
    rank,
    scalars,
    sf_rows,
    sf_cols,
    timeout,
    block2,
    WORLD: tl.constexpr,
    FORM: tl.constexpr,
    BLOCK1: tl.constexpr,
    PHASES: tl.constexpr = P.ALL_PHASES,  # test/benchmark hook (protocol.py)
    EMULATED: tl.constexpr = False,  # test hook (protocol.py)
):
    """ws: the workspace (`protocol.SymmBuffers`), slots: where a row lies in it
    (`protocol.OneshotSlots`), src: `records.RowSource`, out: `records.RowOutputs`, scalars:
    `records.LayerScalars`, FORM: `records.RowForm`; timeout: us (EMULATED: polls); block2: the
    columns a program stores in phase C (a multiple of 64)."""
    WP: tl.constexpr = triton.next_power_of_2(WORLD)
    ROW_BLOCK: tl.constexpr = FORM.ROW_BLOCK
    CLEAR_BLOCK: tl.constexpr = min(1024, ROW_BLOCK)
    ptrs_ptr, state_ptr = ws.ptrs, ws.state
    hidden, cap, data_off = slots.hidden, slots.cap, slots.data_off
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dtype: tl.constexpr = out.residual_out.dtype.element_ty
    slot, prev, prev_rows = call_state(state_ptr)
    start = start_clock(EMULATED)
    slot_stride = cap.to(tl.int64) * hidden  # one source's rows
    local = peer_ptr(ptrs_ptr, rank, tl.int16)

    # A. finalize + publish into slot [slot][rank] of every rank's buffer (never waits)
    if P.PUBLISH & PHASES:
        chunks1 = tl.cdiv(hidden, BLOCK1)
        dst = data_off + (slot * WORLD + rank).to(tl.int64) * slot_stride
        for item in range(pid, tokens * chunks1, nprog):
            row = (item // chunks1).to(tl.int64)
            cols = (item % chunks1) * BLOCK1 + tl.arange(0, BLOCK1)
            if P.FINALIZE & PHASES:
                acc = finalize_row(
                    src,
                    row,
                    cols,
                    hidden,
                    scalars.routed_scaling,
                    TOP_K=FORM.TOP_K,
                    HAS_SHARED=FORM.HAS_SHARED,
                )
                bits = payload_bits(acc, dtype)
            else:
                bits = tl.full([BLOCK1], P.CONSTANT_PARTIAL_BITS, tl.int16)
            for q in tl.static_range(WORLD):
                tl.store(
                    peer_ptr(ptrs_ptr, q, tl.int16) + dst + row * hidden + cols,
                    bits,
                    mask=cols < hidden,
                )
    if P.EPOCH & PHASES:
        ticket = take_ticket(state_ptr, slot, prev_rows, BLOCK1)

    # B. the previous call's slot back to the sentinel (its rows, every source), overlapping
    # the wait
    if P.CLEAR & PHASES:
        prev_base = local + data_off + (prev * WORLD).to(tl.int64) * slot_stride
        chunks_c = tl.cdiv(hidden, CLEAR_BLOCK)
        for q in tl.static_range(WORLD):
            for item in range(pid, prev_rows * chunks_c, nprog):
                clear_item(item, prev_base + q * slot_stride, hidden, CLEAR_BLOCK)

    # C. wait for the row's partials (the data is the flag), reduce in rank order, norm, quant
    if P.REDUCE & PHASES:
        abort_ptr = abort_word_ptr(ptrs_ptr, rank)
        src_rows = local + data_off + (slot * WORLD).to(tl.int64) * slot_stride
        if EMULATED:
            timeout_ns = timeout  # polls
        else:
            timeout_ns = timeout.to(tl.int64) * 1000
        chunks2 = tl.cdiv(hidden, block2)
        for item in range(pid, tokens * chunks2, nprog):
            row = (item // chunks2).to(tl.int64)
            lo = tl.multiple_of((item % chunks2) * block2, 64)
            v, status = wait_row(
                src_rows,
                slot_stride,
                row,
                hidden,
                abort_ptr,
                start,
                timeout_ns,
                -1,
                WORLD=WORLD,
                WP=WP,
                ROW_BLOCK=ROW_BLOCK,
                EMULATED=EMULATED,
            )
            # still pending after the timeout, or aborted
            bad = ((status & P.POLL_FAILED) != 0).to(tl.int32)
            if bad != 0:  # `status` is uniform over the program, so is this branch
                report_error(
                    missing_ranks(v, WORLD, WP), ptrs_ptr, state_ptr, abort_ptr, rank, WORLD
                )
            if P.NORM & PHASES:
                row_outputs(
                    _rank_ordered_sum(v, dtype, WORLD, WP),
                    row,
                    lo,
                    lo + block2,
                    bad,
                    tokens,
                    hidden,
                    src,
                    out,
                    scalars,
                    sf_cols,
                    FORM,
                )
    if P.NORM & PHASES:
        if FORM.QUANT == QC.QUANT_NVFP4:
            if FORM.SWIZZLED:
                for item in range(
                    pid, tl.cdiv(sf_rows - tokens, 32) * tl.cdiv(sf_cols, 128), nprog
                ):
                    sf_padding_item(item, out.sf, tokens, sf_rows, sf_cols)

    # D. the last ticket advances the epoch, records this slot's rows for the next clear
    if P.EPOCH & PHASES:
        advance_epoch(state_ptr, ticket, slot, tokens, BLOCK1, EMULATED)


# the kernel's constexprs, by name, in the order its launches pass them (PHASES and EMULATED: the
# test and benchmark hooks, production values here; fusion_bridge/testing/symm_oneshot_rig.py
# launches KERNEL with others)
_CONSTEXPRS = ("WORLD", "FORM", "BLOCK1", "PHASES", "EMULATED")
_ONESHOT = KernelLauncher(_oneshot_kernel, _CONSTEXPRS)
_PRODUCTION = (P.ALL_PHASES, False)  # PHASES, EMULATED


def call_args(
    layer: SymmLayer, config: Optional[OneshotConfig], src: RowSource, out: RowOutputs
) -> tuple[int, tuple, tuple, int]:
    """(programs, runtime arguments, constexprs WORLD, FORM, BLOCK1, warps) of one call of the
    exchange kernel (world size >= 2); T > 0. config None: `default_config`."""
    tokens, top_k = src.perm.shape
    hidden = layer.hidden
    quant = layer.quant
    block1, block2, warps = config or default_config(tokens, hidden, layer.num_sms)
    rb = row_block(hidden)
    block1, block2 = min(block1, rb), min(block2, rb)
    assert block2 % 64 == 0 and block1 % 64 == 0
    items = max(tokens * triton.cdiv(hidden, block1), tokens * triton.cdiv(hidden, block2))
    sf = out.sf
    sf_rows, sf_cols = (sf.shape[0], sf.shape[1]) if quant.code == QUANT_NVFP4 else (tokens, 0)
    args = (
        layer.buffers,
        src.for_kernel(),
        out,
        tokens,
        layer.slots,
        layer.rank,
        layer.scalars,
        sf_rows,
        sf_cols,
        layer.timeout_us,
        block2,
    )
    form = RowForm(
        TOP_K=top_k,
        HAS_SHARED=src.shared is not None,
        QUANT=quant.code,
        SWIZZLED=quant.swizzled,
        ROW_BLOCK=rb,
        HW_CVT=src.residual.is_cuda,
    )
    return max(1, min(layer.num_sms, items)), args, (layer.world, form, block1), warps


# the exchange kernel (world size >= 2), for fusion_bridge/testing/symm_oneshot_rig.py
KERNEL = _oneshot_kernel


class OneshotLauncher:
    """The one-shot's calls of one layer (`layer`: a `SymmLayer`, world size >= 2; the verbs of
    `layer.FamilyLauncher`). World size 1 has no exchange: `fused_tp1`'s kernels, kernels/tp1/."""

    def __init__(self, layer: SymmLayer):
        self.layer = layer

    def config_for(self, tokens: int) -> OneshotConfig:
        """The config of a call of T tokens that names none (`default_config`)."""
        return default_config(tokens, self.layer.hidden, self.layer.num_sms)

    def variant_config(self, variant: str, tokens: int) -> Optional[OneshotConfig]:
        """The config of a launch variant ("default": None, or one of CONFIG_VARIANTS) at T."""
        layer = self.layer
        return variant_config(
            variant, tokens, layer.hidden, layer.num_sms, layer.world, layer.quant.code
        )

    def __call__(
        self, src: RowSource, out: RowOutputs, config: Optional[OneshotConfig] = None
    ) -> None:
        """One call: `src` (`RowSource.of(inputs)`) into `out` (residual_out, norm_out [T, H];
        q, sf uint8: [T, H] fp8 codes / [T, H/2] packed fp4 and the nvfp4 scales, any tensor when
        unused). T == 0 launches nothing (on every rank); T must be <= layer.cap."""
        if src.perm.shape[0] == 0:
            return
        programs, args, constexprs, warps = call_args(self.layer, config, src, out)
        _ONESHOT((programs,), args, constexprs + _PRODUCTION, warps)

    def bound(
        self, src: RowSource, out: RowOutputs, config: Optional[OneshotConfig] = None
    ) -> Callable[[], None]:
        """The call's launch with its arguments decided (benchmarks); T > 0."""
        programs, args, constexprs, warps = call_args(self.layer, config, src, out)
        fixed = constexprs + _PRODUCTION
        return lambda: _ONESHOT((programs,), args, fixed, warps)
