"""The large-T two-shot (`symm_fused_twoshot`): rows cut into chunks
that take a few fixed slots in turn (so the workspace does not grow with T), and every stage of
every chunk its own launch with a grid sized to its work (one row or one finalize item per
program, as our standalone kernels); a chunk's arrival is one flag per (rank, slot), so the row
launches read their slots with plain vectorized loads and never clear them. Each rank reduces
only the rows it owns (rows j with j % W == rank): two-shot byte counts.

The default config: 2 slots x 1024 tokens, F on two side streams let ahead of X, the row launches
on a high-priority stream, the L2 hints with the read slot rows dropped, PDL on sm_90+. How its
local work at world size 1 (no peer reads and no all-gather at W = 1, so the work the link
overlaps with), and each of its halves alone, compare with our standalone finalize +
add+RMSNorm: docs/performance.md#the-large-t-two-shot-the-two-shot-pipeline.

Per chunk c (slot s = (base + c) % SLOTS = c % SLOTS, sequence number base + c, base in device
state; each call moves the base on by its chunks rounded up to a multiple of SLOTS, releasing the
skipped sequence numbers' slots at once, so every call starts on slot 0 and the finalize and row
launches know a chunk's slot without reading the base), kernels in `twoshot_kernels`:

  F(c): the finalize items of chunk c into the owners' reduce-scatter rows [rank][i] of slot s
        (one item, a row segment, per program); never waits.
  V(c): (c > 0 and chunk c - 1 + SLOTS in the call) one program, right after R(c - 1) /
        G(c - 1): release slot s' (chunk c - 1) on this rank's counter, wait until every rank
        released it (the gate of chunk c - 1 + SLOTS: its F may then start).
  X(c): one program: (without V(c)) release chunk c - 1's slot; raise this rank's "arrived" flag
        of s to base + c + 1; wait until every rank's "arrived" flag of s shows chunk c.
  R(c): the rows this rank owns: the W partials summed in rank order, residual, one rounding,
        pushed into every other rank's all-gather rows, this rank's outputs.
  Y(c): (W > 1) one program: raise the "reduced" flag of s, wait for every rank's.
  G(c): (W > 1) the rows the other ranks own, from this rank's all-gather rows.
A call starts with one gate for the first SLOTS chunks and ends with one release of its last chunk
(which also advances the base, as above).

F runs on two side streams (chunk c on side stream c % 2), everything else on a high-priority
stream forked from the caller's (a call of one chunk: on the caller's stream): F(c + 1) overlaps
R(c) / G(c), the link, X(c) and the end of F(c) (the row launches' priority keeps the early
finalize programs from taking the SMs R(c) needs). F(c) waits for the event of the launch that gated
its slot, X(c) for F(c)'s; the side streams fork from the caller's stream at the start of the call
and join it through X (the caller's stream waits for every F; CUDA-graph capture sees a closed
fork / join). The side streams are per thread.

L2 (`L2_HINTS`, GPU only): F loads the expert rows with the evict-first hint and stores the slot
rows with evict-last, R loads the residual evict-first, so R(c) finds chunk c's slot rows in L2
while F(c + 1) streams its expert rows through it; with rows on 128-byte lines (H % 64 == 0) R / G
then drop the slot rows they read from L2 (`discard.global.L2`) instead of writing them back to
HBM: nothing reads a slot row again before the slot's next chunk writes it.

Memory ordering. Writer: the flag is raised by a launch that its stream orders after the writes it
covers (F(c), or R(c)'s pushes), after a system-scope fence, by a system-scope release; so every
rank that reads the flag with a system-scope acquire sees those writes. Reader: the acquire is in
the one-program launch X / Y; the row launch that reads the rows comes after it on the same stream
and loads them with .cg (L2, never a stale L1 line), so plain loads read the new rows; no element
needs to differ from a sentinel, and nothing clears the slot. Reuse: V(c) / X(c) releases chunk c -
1's slot only after R(c - 1) / G(c - 1) (same stream: their reads, and their discards, which count
as writes, are done; the release follows a block barrier and is system-scope); a writer's gate
acquires every rank's counter before F writes the slot again. The flags hold sequence numbers, so a
flag left by the slot's previous chunk (SLOTS chunks earlier) never reads as this chunk's. Every
call on one workspace must use the same number of slots (the counters count uses per slot).

Deadlock freedom: every one-program launch makes this rank's release and signal before it waits, and
waits only for the peers' release of chunk c - 1 and signals of chunk c, which their own V(c) / X(c)
/ Y(c) make before any of their waits (a rank reaches V(c) after R(c - 1) / G(c - 1), which follow
only its X(c - 1) / Y(c - 1)); X(c) follows F(c), which follows the gate of its slot, made by V(c +
1 - SLOTS) / X(c + 1 - SLOTS), earlier in this rank's order: by induction over the chunks every wait
is for a launch that is made. tests/kernels/test_symm_twoshot_interleavings.py runs it under
random interleavings of 2-4 ranks. Emulated ranks on one GPU launch every rank's stages in one
global order on one stream (`testing/symm_twoshot_rig.twoshot_call`), the syncs split into their
signal and wait halves (per chunk: gate, F, signal / wait arrived, R, signal / wait reduced, G,
release), so that no spinning launch holds the SMs a peer's earlier stage needs.

Errors: a wait that runs out (time, or the abort word a peer that timed out set) reports the error
word and sets every rank's abort word (`report_error`); every row launch of that call after it on
any rank writes NaN rows. A sync launch that finds the abort word set reports the error word even
when its own waits were met (a late rank finds the flags an aborted peer left). How the row launches
learn it: X(c), failing, fills this rank's own partials of the slot with NaN before R(c) reads them
(rows [rank][*] of its reduce-scatter region: only this rank's F writes them, so no late or
out-of-step peer can overwrite the NaN), so every row R(c) sums is NaN with no abort-word read in R;
G reads the abort word once per row, after it has issued the row's data loads (so the word's round
trip overlaps theirs). A peer that aborts while a row launch runs may leave that launch's rows wrong
rather than NaN: once an abort is under way a gate returns at once, so a finalize may write a slot
that a slow peer's row launch is still reading (the abort word read per row in R narrowed that
window before; R no longer reads it). The error word (the next call raises) is what says a call
failed. No wait is unbounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Optional

import torch
import triton

from fusion_bridge.kernels.launch_cache import KernelLauncher
from fusion_bridge.kernels.pdl import PDL_OPTIONS, pdl_ok
from fusion_bridge.kernels.quant import row_block, row_num_warps, sf_padding_items
from fusion_bridge.kernels.quant_codes import QUANT_NVFP4
from fusion_bridge.kernels.symm.protocol import SymmLayer, TwoshotSlots
from fusion_bridge.kernels.symm.twoshot_device import CHUNK, MAX_SLOTS, SLOTS
from fusion_bridge.kernels.records import RowForm, RowOutputs, RowSource
from fusion_bridge.kernels.symm.twoshot_kernels import (
    FLAG_ARRIVED,
    FLAG_REDUCED,
    Pipeline,
    SyncSteps,
    _finalize_kernel,
    _rows_kernel,
    _sync_kernel,
)
from fusion_bridge.kernels.symm.twoshot_streams import two_streams

__all__ = ["TwoshotConfig", "DEFAULT_CONFIG", "TwoshotLauncher", "call_plan"]

# each kernel's constexprs, by name, in the order the launches pass them
_F_CONSTS = ("PIPE", "FORM", "F_COLS")
_R_CONSTS = ("PIPE", "FORM", "GATHER", "LAST")
_S_CONSTS = ("PIPE", "STEPS", "NAN_BITS")
_LAUNCH_F = KernelLauncher(_finalize_kernel, _F_CONSTS)
_LAUNCH_R = KernelLauncher(_rows_kernel, _R_CONSTS)
_LAUNCH_S = KernelLauncher(_sync_kernel, _S_CONSTS)
# with programmatic dependent launch (TwoshotConfig.pdl, kernels/pdl.py): options are fixed per
# launcher, and USE_PDL (a constexpr of the key) is True exactly on these
_LAUNCH_F_PDL = KernelLauncher(_finalize_kernel, _F_CONSTS, options=PDL_OPTIONS)
_LAUNCH_R_PDL = KernelLauncher(_rows_kernel, _R_CONSTS, options=PDL_OPTIONS)
_LAUNCH_S_PDL = KernelLauncher(_sync_kernel, _S_CONSTS, options=PDL_OPTIONS)


# the pipeline's launch choices, each measured at world size 1 on one H200 against the
# alternatives the benchmark still builds (benchmarks/twoshot_local.py; docs/performance.md, "The
# current default"): the finalize items in 4 warps (as our standalone finalize), the row launches
# in our add+RMSNorm kernel's warps, the L2 hints with the read slot rows dropped (L2_HINTS 2;
# 1: the hints only, 0: none), the chunks' finalize launches on two side streams in turn, the
# row launches on a high-priority stream (a call of one chunk on the caller's stream: nothing
# overlaps, so the fork and join would only add time), each chunk's finalize gated right after
# the row launches that free its slot (V(c))
F_WARPS = 4
L2_HINTS = 2
F_STREAMS = 2


@dataclass(frozen=True)
class TwoshotConfig:
    """A launch config.

    chunk / slots: tokens per chunk and the slots chunks turn through (the workspace holds
    slots x [2][chunk][H]: 58.7 MB at 2 x 1024 or 4 x 512, H=7168 bf16; every call on one
    workspace must use the same slots). f_cols: the finalize item's columns (one row segment, as
    our standalone finalize's 1024; the CPU emulation takes narrower ones). pdl: every launch with
    programmatic dependent launch (sm_90+ GPUs only, else ignored): a launch's scheduling overlaps
    the tail of the launch before it on its stream, and every kernel waits for that launch's
    completion before its first memory access (kernels/pdl.py), so the flag protocol below is
    unchanged. That holds whatever an event wait across streams becomes under capture: every
    kernel waits for all the grids it depends on, programmatic or not."""

    chunk: int = CHUNK
    f_cols: int = 1024
    slots: int = SLOTS
    # on: faster at world size 1 on one H200, never slower beyond noise (docs/performance.md,
    # its PDL table of the two-shot)
    pdl: bool = True

    def __post_init__(self):
        if self.chunk < 1:
            raise ValueError(f"chunk: expected >= 1, got {self.chunk}")
        if not 2 <= self.slots <= MAX_SLOTS:
            raise ValueError(f"slots: expected 2..{MAX_SLOTS}, got {self.slots}")


DEFAULT_CONFIG = TwoshotConfig()


@dataclass(frozen=True)
class ChunkPlan:
    """One chunk's grids: finalize items, owned rows (R), other ranks' rows (G; 0 at W = 1)."""

    index: int
    f_items: int
    own_rows: int
    other_rows: int


def call_plan(tokens: int, world: int, rank: int, hidden: int, config: TwoshotConfig) -> list:
    """The chunks of a call and their grids (the kernel's own formulas, on the host)."""
    plans = []
    f_cols = min(config.f_cols, triton.next_power_of_2(hidden))
    for c in range(-(-tokens // config.chunk)):
        n_c = min(config.chunk, tokens - c * config.chunk)
        own = (n_c - rank + world - 1) // world if n_c > rank else 0
        items = world * -(-n_c // world) * -(-hidden // f_cols)
        plans.append(ChunkPlan(c, items, own, n_c - own))
    return plans


# the quiet NaN of each activation dtype as int16 bits (a failed wait poisons the slot rows with it)
_NAN_BITS = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}


class TwoshotLauncher:
    """The two-shot's calls of one layer (`layer`: a `SymmLayer`; the verbs of
    `layer.FamilyLauncher`). The layer's buffer holds slots laid out for the config's chunk and
    slots (`twoshot_device.buffer_bytes`), its header zeroed at creation."""

    def __init__(self, layer: SymmLayer):
        self.layer = layer

    def config_for(self, tokens: int) -> TwoshotConfig:
        """The config of a call that names none: `DEFAULT_CONFIG` at every T."""
        return DEFAULT_CONFIG

    def __call__(
        self, src: RowSource, out: RowOutputs, config: Optional[TwoshotConfig] = None
    ) -> None:
        """One call: `src` (`RowSource.of(inputs)`: gemm2_out [P, H], perm [T, K] int32, weights
        [T, K], shared [T, H] or None, residual [T, H], gamma [H]) into `out` (residual_out,
        norm_out [T, H]; q, sf: the FP8 / NVFP4 outputs as uint8, or empty). T == 0 launches
        nothing (on every rank)."""
        if src.perm.shape[0] == 0:
            return
        self.bound(src, out, config)()

    def bound(
        self, src: RowSource, out: RowOutputs, config: Optional[TwoshotConfig] = None
    ) -> Callable[[], None]:
        """The call's launches, decided and ordered, as one callable (benchmarks); T > 0."""
        calls = _call_launches(self.layer, config or DEFAULT_CONFIG, src, out, emulated=False)
        seq = _sequence(calls, split=False)
        device = src.residual.device
        if not src.residual.is_cuda:  # the interpreter: one launch after another
            return lambda: _in_order(seq)
        return lambda: two_streams(device, seq, len(calls.plans) > 1, F_STREAMS)


def _in_order(seq: list) -> None:
    """The launches of `_sequence` one after another on the current stream (the interpreter)."""
    for _, _, fn, _ in seq:
        fn()


def check_layout(layer: SymmLayer, config: TwoshotConfig) -> None:
    """Every call on one workspace must lay its slots out alike: the release counters count the
    uses of each slot, and slot regions of another chunk size overlap. The first call's (chunk,
    slots) is kept on the tensor that owns the workspace's state words (the state itself, or the
    tensor it is a view of), which lives as long as the workspace; another raises ValueError
    instead of a gate that times out or passes early."""
    layout = (config.chunk, config.slots)
    owner = layer.state if layer.state._base is None else layer.state._base
    first = getattr(owner, "_twoshot_layout", None)
    if first is None:
        owner._twoshot_layout = layout
    elif first != layout:
        raise ValueError(
            f"symm_twoshot: config (chunk, slots) must be {first}, the layout of the first call "
            f"on this workspace (its release counters count uses per slot); got {layout}"
        )


def _call_launches(
    layer: SymmLayer,
    config: TwoshotConfig,
    src: RowSource,
    out: RowOutputs,
    emulated: bool,
    *,
    l2: int = L2_HINTS,
    f_warps: int = F_WARPS,
    row_warps: int = 0,
):
    """A call's launches, not yet made: a namespace of the chunk plans, the world and callables
    f(p), r(p, gather) and sync(c, **what) (the `_sync_kernel` flags: signal, wait, release = the
    chunk released or None, advance, gate = (first chunk, count)). emulated: the CPU
    interpreter's poll-count timer (the test rig only). l2, f_warps, row_warps (0: our
    add+RMSNorm kernel's warps): the launch choices above, which only the benchmark's ablations
    change (benchmarks/twoshot_local.py)."""
    check_layout(layer, config)
    tokens, top_k = src.perm.shape
    world, rank, hidden = layer.world, layer.rank, layer.hidden
    quant = layer.quant
    sf = out.sf
    swz = quant.code == QUANT_NVFP4 and bool(quant.swizzled)
    sf_rows, sf_cols = (sf.shape[0], sf.shape[1]) if quant.code == QUANT_NVFP4 else (tokens, 0)
    residual = src.residual
    rb = row_block(hidden)
    f_cols = min(config.f_cols, triton.next_power_of_2(hidden))
    if not layer.own_addr:
        raise ValueError(
            "symm_twoshot: layer.own_addr must be this rank's buffer address (ptrs[rank]), got 0"
        )
    # the L2 hints need a GPU; dropping rows needs them on 128-byte lines
    l2 = min(l2, 1 if hidden % 64 else 2) if residual.is_cuda else 0
    pdl = bool(config.pdl) and pdl_ok(residual.device)
    launch_f, launch_r, launch_s = (
        (_LAUNCH_F_PDL, _LAUNCH_R_PDL, _LAUNCH_S_PDL) if pdl else (_LAUNCH_F, _LAUNCH_R, _LAUNCH_S)
    )
    # the call's records, bound once: each kernel's source leaves None what it does not read
    pipe = Pipeline(WORLD=world, SLOTS=config.slots, L2=l2, USE_PDL=pdl, EMU=emulated)
    form = RowForm(
        TOP_K=top_k, HAS_SHARED=src.shared is not None, QUANT=quant.code, SWIZZLED=swz,
        ROW_BLOCK=rb, HW_CVT=residual.is_cuda,
    )  # fmt: skip
    f_src = src.for_kernel()._replace(residual=None, gamma=None)
    r_src = RowSource(None, None, None, None, residual, src.gamma)
    slots = TwoshotSlots(hidden, config.chunk)
    # each kernel's scalars: what it reads (None: no parameter)
    f_scalars = layer.scalars._replace(eps=None, weight_bias=None, quant_scale=None)
    r_scalars = layer.scalars._replace(routed_scaling=None)
    row_warps = row_warps or row_num_warps(rb, quant.code)
    pad_items = sf_padding_items(tokens, sf_rows, sf_cols) if swz else 0
    plans = call_plan(tokens, world, rank, hidden, config)
    nchunks = len(plans)
    nan_bits = _NAN_BITS[residual.dtype]

    def f_launch(p):
        args = (layer.ptrs, layer.state, f_src, tokens, slots, p.index, rank, f_scalars)
        consts = (pipe, form, f_cols)
        return lambda: launch_f((p.f_items,), args, consts, f_warps)

    def r_launch(p, gather):
        rows = p.other_rows if gather else p.own_rows
        last = p.index == nchunks - 1 and (gather or world == 1)
        args = (layer.ptrs, layer.own_addr, r_src, out, tokens, slots, p.index, rank, r_scalars)
        args += (sf_rows, sf_cols, pad_items if last else 0)
        consts = (pipe, form, gather, last)
        return lambda: launch_r((max(1, rows),), args, consts, row_warps)

    def sync(c, signal=0, wait=0, release=None, advance=False, gate=(0, 0)):
        args = (layer.ptrs, layer.state, c, c if release is None else release, gate[0], gate[1])
        args += (nchunks, rank, layer.timeout_us, slots)
        steps = SyncSteps(
            SIGNAL=signal, WAIT=wait, RELEASE=release is not None, ADVANCE=advance,
            GATE=gate[1] > 0,
        )  # fmt: skip
        return lambda: launch_s((1,), args, (pipe, steps, nan_bits), 1)

    return SimpleNamespace(
        plans=plans, world=world, slots=config.slots, f=f_launch, r=r_launch, sync=sync
    )  # fmt: skip


def _sequence(calls, split: bool) -> list:
    """The call's launches in this rank's order: [(stage, chunk, callable, gated chunks)], gated:
    the chunks whose slot gate this launch holds (their F waits for it). split (emulated ranks in
    one global order, the test rig): every sync as its halves, each a launch of its own,
    the gates one per chunk."""
    n, world, sync, slots = len(calls.plans), calls.world, calls.sync, calls.slots
    if split:
        seq = []
        for p in calls.plans:
            c = p.index
            seq += [("Q", c, sync(c, gate=(c, 1)), [c]), ("F", c, calls.f(p), [])]
            seq += [("A", c, sync(c, signal=FLAG_ARRIVED), [])]
            seq += [("WA", c, sync(c, wait=FLAG_ARRIVED), []), ("R", c, calls.r(p, False), [])]
            if world > 1:
                seq += [("D", c, sync(c, signal=FLAG_REDUCED), [])]
                seq += [("WD", c, sync(c, wait=FLAG_REDUCED), []), ("G", c, calls.r(p, True), [])]
            seq += [("P", c, sync(c, release=c, advance=c == n - 1), [])]
        return seq
    first = min(slots, n)
    seq = [("Q", 0, sync(0, gate=(0, first)), list(range(first)))]
    seq += [("F", 0, calls.f(calls.plans[0]), [])]
    for p in calls.plans:
        c = p.index
        g = c - 1 + slots  # the chunk whose slot chunk c - 1 frees
        gated = [g] if c > 0 and g < n else []
        release = c - 1 if c > 0 else None
        # V(c): release chunk c - 1, gate chunk c - 1 + SLOTS, right after R(c - 1) / G(c - 1),
        # so F(c + 1) may start before F(c) is done; X(c) then only signals and waits
        if gated:
            seq += [("V", c, sync(c, release=release, gate=(g, 1)), gated)]
            release, gated = None, []
        if c + 1 < n:
            seq += [("F", c + 1, calls.f(calls.plans[c + 1]), [])]
        x = sync(c, FLAG_ARRIVED, FLAG_ARRIVED, release, False, (g, len(gated)))
        seq += [("X", c, x, gated), ("R", c, calls.r(p, False), [])]
        if world > 1:
            seq += [("Y", c, sync(c, FLAG_REDUCED, FLAG_REDUCED), [])]
            seq += [("G", c, calls.r(p, True), [])]
    return seq + [("Z", n - 1, sync(n - 1, release=n - 1, advance=True), [])]
