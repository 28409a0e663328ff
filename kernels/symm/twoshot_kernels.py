"""The two-shot pipeline's kernels (`symm_twoshot` has the protocol and the ordering argument): the
finalize F(c), the row launches R(c) / G(c) that read their slot rows with plain loads, and the
one-program sync launch that signals and waits on the per-chunk flags and slot counters.

Every kernel also runs under TRITON_INTERPRET=1 (peer pointers are table entries the interpreter
follows as host addresses); EMU swaps only the GPU timer for a poll count and drops the system
fence (the interpreter runs one launch at a time).
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from fusion_bridge.kernels import quant_codes as QC
from fusion_bridge.kernels.symm import protocol as P
from fusion_bridge.kernels.quant import sf_padding_item
from fusion_bridge.kernels.symm.device import (
    _globaltimer,
    abort_word_ptr,
    payload_bits,
    start_clock,
)
from fusion_bridge.kernels.add_rmsnorm import norm_quant_row
from fusion_bridge.kernels.finalize_add import finalize_row
from fusion_bridge.kernels.pdl import pdl_enter
from fusion_bridge.kernels.symm.twoshot_device import (
    _fail,
    _rank_buf,
    _release,
    _slot_at,
)
from fusion_bridge.kernels.symm.twoshot_device import _slot_base
from fusion_bridge.kernels.symm.twoshot_device import _poison_own_partials, _wait_slot_free

FLAG_ARRIVED = P.TWOSHOT_ARRIVED  # this rank's partials of the chunk are in every owner's slot
FLAG_REDUCED = P.TWOSHOT_REDUCED  # this rank's reduced rows of it are in every other rank's slot


class Pipeline(NamedTuple):
    """The compile-time shape every launch of one call shares (one `tl.constexpr`, PIPE): WORLD
    ranks, SLOTS the chunks turn through, L2 the hints (0 none, 1 hints, 2 hints and the read slot
    rows dropped), USE_PDL (programmatic dependent launch), EMU (the interpreter's poll-count
    timer and no system fence; the sync launch's only)."""

    WORLD: int
    SLOTS: int
    L2: int
    USE_PDL: bool
    EMU: bool


class SyncSteps(NamedTuple):
    """What one sync launch does (one `tl.constexpr`, STEPS): SIGNAL / WAIT a flag
    (FLAG_ARRIVED / FLAG_REDUCED, 0 none), RELEASE a chunk's slot, ADVANCE the chunk base (the
    call's last launch), GATE the slots of later chunks."""

    SIGNAL: int
    WAIT: int
    RELEASE: bool
    ADVANCE: bool
    GATE: bool


@triton.jit
def _chunk_rows(c, tokens, chunk):
    return tl.minimum(chunk, tokens - c * chunk)


@triton.jit
def _f_place(i, n_c, groups, c, chunk, WORLD: tl.constexpr):
    """Finalize item i: (owner, owner row, live, token row int64, column block). Items go owner
    fastest, then the owner's rows, then column blocks (the standalone finalize's order:
    consecutive programs, consecutive rows of one column block)."""
    q = i % WORLD  # the owner
    rest = i // WORLD
    ii = rest % groups  # the owner's row
    j = q + WORLD * ii
    live = j < n_c
    # rows past the chunk read the chunk's last row (in bounds) and store nothing
    row = (c * chunk + tl.where(live, j, n_c - 1)).to(tl.int64)
    return q, ii, live, row, rest // groups


@triton.jit
def _row_outputs(
    x, bad, t, cols, in_row, tokens, hidden, src, out, scalars, sf_cols, FORM: tl.constexpr
):  # fmt: skip
    """Row t's outputs from its residual_out value x (fp32, exact in the activation dtype; NaN
    where a wait failed): residual_out, norm_out and its FP8 / NVFP4 codes (records: src a
    RowSource, gamma read; out a RowOutputs; scalars the LayerScalars; FORM the RowForm)."""
    x = tl.where((cols * 0 + bad) != 0, float("nan"), x)
    xr = x.to(out.residual_out.dtype.element_ty)  # exact (or NaN)
    tl.store(out.residual_out + t * hidden + cols, xr, mask=in_row)
    # gamma reloaded per row (L2-hot): held across the loop it costs registers
    g = tl.load(src.gamma + cols, mask=in_row, other=0.0).to(tl.float32) + scalars.weight_bias
    norm_quant_row(
        tl.where(in_row, xr.to(tl.float32), 0.0), g, t, 0, FORM.ROW_BLOCK, tokens, hidden, out,
        scalars, sf_cols, FORM,
    )  # fmt: skip


@triton.jit
def _flag_ptrs(ptrs_ptr, q, slot, FLAG: tl.constexpr):
    """Rank q's (tensor of ranks) flag of `slot` (int64, in its header)."""
    off = P.TWOSHOT_ARRIVED_BYTE if FLAG == P.TWOSHOT_ARRIVED else P.TWOSHOT_REDUCED_BYTE
    return (tl.load(ptrs_ptr + q) + off).to(tl.pointer_type(tl.int64)) + slot


@triton.jit
def _fence_sys(EMU: tl.constexpr):
    """fence.sc.sys (GPU): every write this rank's earlier launches made (ordered before this one
    by its stream) is visible system-wide before the flag store that follows."""
    if not EMU:
        tl.inline_asm_elementwise(
            "fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _wait_flags(
    ptrs_ptr, slot, need, abort_ptr, start, timeout, FLAG: tl.constexpr, WORLD: tl.constexpr,
    EMU: tl.constexpr,
):  # fmt: skip
    """Until every rank's flag of `slot` reaches `need` (system-scope acquire reads, one lane per
    rank, all in flight together); returns the ranks that never did (bit mask)."""
    lane = tl.arange(0, 32)
    on = lane < WORLD
    ptrs = _flag_ptrs(ptrs_ptr, tl.where(on, lane, 0), slot, FLAG)
    seen = tl.atomic_add(ptrs, lane * 0, mask=on, sem="acquire", scope="sys")
    seen = tl.where(on, seen, 1 << 62)
    polls = 1
    waiting = (tl.min(seen, axis=0) < need).to(tl.int32)
    while waiting != 0:
        seen = tl.atomic_add(ptrs, lane * 0, mask=on, sem="acquire", scope="sys")
        seen = tl.where(on, seen, 1 << 62)
        polls += 1
        if EMU:
            late = polls >= timeout
        else:
            late = (_globaltimer() - start) > timeout
        ab = tl.load(abort_ptr, volatile=True)
        waiting = (tl.min(seen, axis=0) < need).to(tl.int32) * (1 - late.to(tl.int32))
        waiting = waiting * (ab == 0).to(tl.int32)
    return tl.sum(tl.where(on & (seen < need), 1 << lane, 0), axis=0)


@triton.constexpr_function
def _pow2(n):
    return triton.next_power_of_2(n)


@triton.jit
def _discard_rows(row_ptr, stride, hidden, ROW_BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Drop the ROWS slot rows row_ptr + r * stride, which this program has read and no one reads
    before they are written again, from L2 without writing them back (`discard.global.L2`,
    128-byte lines: the caller ensures the rows start on a line and hidden % 64 == 0).
    Memory-model-wise a weak write of unspecified bytes: the stream orders it before the next
    chunk's F on this GPU, and a peer's next write of a row comes after this rank's release: a
    system-scope release atomic in a later sync launch, which starts only once this launch has
    completed (stream order; under PDL its grid-dependency wait). The caller first makes a block
    barrier after every thread's loads of the rows are done. One pass over ROWS x ROW_BLOCK // 16
    lanes (a line per lane, one lane per thread of a row launch at one row): every line is
    dropped once (a loop of one call per row held every row's addresses: 83-86 registers at W=2
    against 57, offline sm_90)."""
    per_row: tl.constexpr = ROW_BLOCK // 16
    lane = tl.arange(0, _pow2(ROWS) * per_row)
    r = lane // per_row
    line = lane % per_row
    addr = (row_ptr + r.to(tl.int64) * stride + line * 64).to(tl.int64, bitcast=True)
    live = ((line < hidden // 64) & (r < ROWS)).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p discard.global.L2 [$1], 128; mov.u32 $0, 0; }",
        "=r,l,r", [addr, live], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit(do_not_specialize=["c", "rel_c", "gate_lo", "gate_n", "nchunks", "rank", "timeout"])
def _sync_kernel(
    ptrs_ptr, state_ptr, c, rel_c, gate_lo, gate_n, nchunks, rank, timeout, slots,
    PIPE: tl.constexpr, STEPS: tl.constexpr, NAN_BITS: tl.constexpr,
):  # fmt: skip
    """slots: where a row lies in them (`protocol.TwoshotSlots`); PIPE: the call's `Pipeline`;
    STEPS: this launch's `SyncSteps`; NAN_BITS: the activation dtype's quiet NaN (int16 bits).
    One program, in this order: RELEASE this rank's readers of chunk rel_c are done (one unit on
    its counter of that chunk's slot); SIGNAL (FLAG_ARRIVED / FLAG_REDUCED, 0 none) this rank's
    writes of chunk c are done (its flag of the slot := the chunk's sequence number + 1, a
    system-scope release after a system fence); WAIT (a flag, 0 none) until every rank's flag of the
    slot shows chunk c; GATE until every rank released the slots that chunks gate_lo .. gate_lo +
    gate_n - 1 reuse; ADVANCE (the call's last launch) the base moves on by the call's chunks
    rounded up to a multiple of SLOTS (the skipped sequence numbers released). This rank's own
    release and signal come before its waits, so a wait only ever waits for the peers. A failed
    wait, or an abort word already set: the error word (`report_error`); with WAIT arrived, also
    this rank's own partials of the slot := NaN (the R launch after it sums NaN; G launches read the
    abort word). USE_PDL: first the wait for the grid before it (kernels/pdl.py), so its release
    follows the previous row launch's reads and its flag reads precede nothing; it does not let the
    next grid be scheduled early (a row launch's programs parked on the SMs while this one waits for
    the peers would take them from the next chunk's finalize)."""
    pdl_enter(PIPE.USE_PDL, LAUNCH_DEPENDENTS=False)
    WORLD: tl.constexpr = PIPE.WORLD
    SLOTS: tl.constexpr = PIPE.SLOTS
    EMU: tl.constexpr = PIPE.EMU
    hidden, chunk = slots.hidden, slots.chunk
    timeout_ns = timeout
    if not EMU:
        timeout_ns = timeout.to(tl.int64) * 1000
    start = start_clock(EMU)
    abort_ptr = abort_word_ptr(ptrs_ptr, rank)
    base = tl.load(state_ptr)
    seq = base + c
    slot = seq % SLOTS
    lane = tl.arange(0, 32)
    if STEPS.RELEASE:
        _release(ptrs_ptr, rank, (base + rel_c) % SLOTS, 0, 1)
    if STEPS.SIGNAL != 0:
        tl.debug_barrier()
        _fence_sys(EMU)
        flag = _flag_ptrs(ptrs_ptr, rank + lane * 0, slot, FLAG=STEPS.SIGNAL)
        tl.atomic_xchg(flag, lane * 0 + seq + 1, mask=lane == 0, sem="release", scope="sys")
    missing = 0
    if STEPS.WAIT != 0:
        missing = _wait_flags(
            ptrs_ptr, slot, seq + 1, abort_ptr, start, timeout_ns, FLAG=STEPS.WAIT, WORLD=WORLD,
            EMU=EMU,
        )  # fmt: skip
    if STEPS.GATE:
        for g in range(gate_lo, gate_lo + gate_n):
            s = base + g
            missing = missing | _wait_slot_free(
                ptrs_ptr, s % SLOTS, (s // SLOTS) * P.TWOSHOT_UNIT, abort_ptr, start, timeout_ns,
                WORLD=WORLD, EMULATED=EMU,
            )  # fmt: skip
    # an abort under way fails this launch even when every wait above was already met (a late
    # rank finds the flags and releases an aborted peer left behind): its rows are NaN, and the
    # error word makes its next call raise
    aborted = tl.load(abort_ptr, volatile=True) != 0
    if (missing != 0) | aborted:
        _fail(missing, abort_ptr, ptrs_ptr, state_ptr, rank, WORLD)
        if STEPS.WAIT == P.TWOSHOT_ARRIVED:  # the row launch R(c) comes next: its sums come out NaN
            _poison_own_partials(
                ptrs_ptr, rank, slot, hidden, chunk, NAN_BITS=NAN_BITS, WORLD=WORLD
            )
    if STEPS.ADVANCE:
        # the next call starts on slot 0 (so F / R find a chunk's slot from its index alone):
        # the sequence numbers up to the next multiple of SLOTS are skipped, each released here
        # (this rank never wrote their slots in this call), so every slot's counter still counts
        # one release per sequence number that maps to it
        skipped = (SLOTS - nchunks % SLOTS) % SLOTS
        for i in range(skipped):
            _release(ptrs_ptr, rank, (nchunks + i) % SLOTS, 0, 1)
        tl.store(state_ptr + lane * 0, lane * 0 + base + nchunks + skipped, mask=lane == 0)


@triton.jit(do_not_specialize=["tokens", "c", "rank"])
def _finalize_kernel(
    ptrs_ptr, state_ptr, src, tokens, slots, c, rank, scalars, PIPE: tl.constexpr,
    FORM: tl.constexpr, F_COLS: tl.constexpr,
):  # fmt: skip
    """F(c): one finalize item per program (the grid is the chunk's item count: an owner's row,
    F_COLS columns): this rank's partial of the row (`finalize_row`, one rounding, -0.0 -> +0.0)
    into the owner's reduce-scatter rows [rank][i] of the chunk's slot. src: a
    `records.RowSource` (the finalize's four fields; residual and gamma None), slots: where a
    row lies in them (`protocol.TwoshotSlots`), scalars: `records.LayerScalars` (routed_scaling
    only), PIPE: the call's `Pipeline`, FORM: `records.RowForm`. The launch that
    gated the slot came before it; this one never waits and makes no system-scope access.
    PIPE.L2 > 0: the expert rows loaded evict-first, the slot rows stored evict-last (the row
    launch reads them from L2). PIPE.USE_PDL: every program first waits for the grid before it on
    its stream (kernels/pdl.py)."""
    pdl_enter(PIPE.USE_PDL, LAUNCH_DEPENDENTS=True)
    WORLD: tl.constexpr = PIPE.WORLD
    SLOTS: tl.constexpr = PIPE.SLOTS
    hidden, chunk = slots.hidden, slots.chunk
    dtype: tl.constexpr = src.gemm2_out.dtype.element_ty
    # (base + c) % SLOTS == c % SLOTS (every call starts on slot 0), but the load stays: without
    # it ptxas ordered the K gathers differently and F took longer (docs/performance.md, "The
    # current default"); F's stores wait on it, its loads do not
    slot = (tl.load(state_ptr) + c) % SLOTS
    n_c = _chunk_rows(c, tokens, chunk)
    q, ii, live, row, cb = _f_place(tl.program_id(0), n_c, tl.cdiv(n_c, WORLD), c, chunk, WORLD)
    cols = cb * F_COLS + tl.arange(0, F_COLS)
    acc = finalize_row(
        src, row, cols, hidden, scalars.routed_scaling, TOP_K=FORM.TOP_K,
        HAS_SHARED=FORM.HAS_SHARED, STREAM_ONCE=PIPE.L2 > 0,
    )  # fmt: skip
    # the offset within the owner's buffer fits in int32 (the workspace is < 2^31 elements)
    cw = tl.cdiv(chunk, WORLD)
    off = ((slot * 2 * WORLD + rank) * cw + ii) * hidden
    dst = _rank_buf(ptrs_ptr, q) + (P.HEADER_BYTES // 2) + off
    mask = ((cols * 0 + live) != 0) & (cols < hidden)
    if PIPE.L2 > 0:
        tl.store(dst + cols, payload_bits(acc, dtype), mask=mask, eviction_policy="evict_last")
    else:
        tl.store(dst + cols, payload_bits(acc, dtype), mask=mask)


@triton.jit(do_not_specialize=["own_addr", "tokens", "c", "rank", "sf_rows", "sf_pad_items"])
def _rows_kernel(
    ptrs_ptr, own_addr, src, out, tokens, slots, c, rank, scalars, sf_rows, sf_cols, sf_pad_items,
    PIPE: tl.constexpr, FORM: tl.constexpr, GATHER: tl.constexpr, LAST: tl.constexpr,
):  # fmt: skip
    """src: a `records.RowSource` (residual and gamma; the finalize's fields None), out:
    `records.RowOutputs`, slots: where a row lies in them (`protocol.TwoshotSlots`), scalars:
    `records.LayerScalars` (eps, weight_bias, quant_scale), PIPE: the call's `Pipeline`, FORM:
    `records.RowForm`.
    R(c) (GATHER False): the rows this rank owns: the W partials (plain loads) summed in rank
    order in fp32, the residual added, one rounding (-0.0 -> +0.0): residual_out's bits, pushed into
    every other rank's all-gather rows [rank][i], and this rank's outputs of the row. G(c) (GATHER
    True): the rows other ranks own, from this rank's all-gather rows: residual_out and its norm (+
    FP8 / NVFP4), with the code the owner ran. One row per program; the sync launch before it waited
    for the flags. A wait of this call failed (here or on a peer) or the abort word was set when the
    sync launch before it ran: NaN rows. R learns it from its data: that sync launch poisoned this
    rank's own partials of the slot (`_poison_own_partials`; no other rank writes them), so every
    sum is NaN (reading the abort word per row made R slower). G reads the abort word per row, after
    the row's data loads are issued (its rows are written by the peers, so no poison of ours would
    stick). R's data loads need no load before them: this rank's buffer address is a launch
    argument (own_addr) and the slot is c % SLOTS (every call starts on slot 0), which measured
    faster than loading the buffer and the chunk base first (docs/performance.md, "The current
    default"). LAST: the call's last row launch, which also writes the swizzled NVFP4 scale padding.
    L2 > 0: the residual loaded evict-first; L2 == 2 (GPU, rows on 128-byte lines): the slot rows
    read are dropped from L2 (`_discard_rows`, behind a block barrier: R as soon as the partials are
    summed, G after the row's outputs), never written back to HBM. USE_PDL: every program first
    waits for the grid before it (the sync launch, whose flag waits must be done before a slot row
    is read; kernels/pdl.py)."""
    pdl_enter(PIPE.USE_PDL, LAUNCH_DEPENDENTS=True)
    WORLD: tl.constexpr = PIPE.WORLD
    SLOTS: tl.constexpr = PIPE.SLOTS
    L2: tl.constexpr = PIPE.L2
    ROW_BLOCK: tl.constexpr = FORM.ROW_BLOCK
    hidden, chunk = slots.hidden, slots.chunk
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dtype: tl.constexpr = out.residual_out.dtype.element_ty
    # this rank's buffer from the host (its address, a launch argument) and the slot from the
    # chunk index: no load stands between a row program's start and its data loads
    own = tl.multiple_of(own_addr.to(tl.pointer_type(tl.int16)), 16)
    abort_ptr = own.to(tl.pointer_type(tl.int32))
    slot = c % SLOTS  # every call starts on slot 0 (the sync kernel's ADVANCE)
    n_c = _chunk_rows(c, tokens, chunk)
    n_own = tl.where(n_c > rank, (n_c - rank + WORLD - 1) // WORLD, 0)
    row_elems = tl.full([], 0, tl.int64) + hidden
    src_stride = tl.cdiv(chunk, WORLD).to(tl.int64) * row_elems
    here = _slot_at(own, slot, hidden, chunk, WORLD)
    cols = tl.arange(0, ROW_BLOCK)
    in_row = cols < hidden
    if GATHER:
        ag = here + WORLD * src_stride
        for m in range(pid, n_c - n_own, nprog):
            # the m-th row of the chunk another rank owns: rows come in groups of W, and in
            # each group the W - 1 rows of the other ranks, this rank's own row skipped
            per: tl.constexpr = WORLD - 1 + (WORLD == 1)
            p = m % per
            j = (m // per) * WORLD + p + (p >= rank).to(tl.int32)
            row_ptr = ag + (j % WORLD) * src_stride + (j // WORLD) * row_elems
            v = tl.load(row_ptr + cols, mask=in_row, other=0, cache_modifier=".cg")
            bad = (tl.load(abort_ptr, volatile=True) != 0).to(tl.int32)
            _row_outputs(
                v.to(dtype, bitcast=True).to(tl.float32), bad, (c * chunk + j).to(tl.int64), cols,
                in_row, tokens, hidden, src, out, scalars, sf_cols, FORM,
            )  # fmt: skip
            if L2 == 2:
                tl.debug_barrier()
                _discard_rows(row_ptr, 0, hidden, ROW_BLOCK, 1)
    else:
        for ii in range(pid, n_own, nprog):
            t = (c * chunk + rank + WORLD * ii).to(tl.int64)
            if L2 > 0:
                res = tl.load(src.residual + t * row_elems + cols, mask=in_row, other=0.0,
                              eviction_policy="evict_first")  # fmt: skip
            else:
                res = tl.load(src.residual + t * row_elems + cols, mask=in_row, other=0.0)
            s = tl.zeros([ROW_BLOCK], dtype=tl.float32)
            for q in range(WORLD):  # rank order (a loop, not unrolled: fewer live pointers)
                v = tl.load(here + q * src_stride + ii * row_elems + cols, mask=in_row, other=0,
                            cache_modifier=".cg")  # fmt: skip
                s += v.to(dtype, bitcast=True).to(tl.float32)
            if L2 == 2:  # the partials are summed: every thread's loads of them are done
                tl.debug_barrier()
                _discard_rows(here + ii * row_elems, src_stride, hidden, ROW_BLOCK, WORLD)
            # no abort-word read: after a failed wait this rank's own partials are NaN (the sync
            # launch before it poisoned them), so x is NaN (read per row, the word cost time)
            x = res.to(tl.float32) + s
            bits = payload_bits(x, dtype)
            for q in range(WORLD):  # every other rank's all-gather rows
                if q != rank:
                    dst = _slot_base(ptrs_ptr, q, slot, hidden, chunk, WORLD)
                    tl.store(dst + (WORLD + rank) * src_stride + ii * row_elems + cols, bits,
                             mask=in_row)  # fmt: skip
            _row_outputs(
                bits.to(dtype, bitcast=True).to(tl.float32), 0, t, cols, in_row, tokens, hidden,
                src, out, scalars, sf_cols, FORM,
            )  # fmt: skip
    if LAST:
        if FORM.QUANT == QC.QUANT_NVFP4:
            if FORM.SWIZZLED:
                for item in range(pid, sf_pad_items, nprog):
                    sf_padding_item(item, out.sf, tokens, sf_rows, sf_cols)
