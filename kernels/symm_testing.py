"""Entry points for tests and benchmarks only (never imported by the product): the symmetric-memory
kernels with their hooks set, and W ranks emulated in one process: the one-shot's (`kind`
"oneshot", the only kind `emulated_group` builds) and the two-shot ring's, which runs stage by
stage (`EmulatedRing`, `ring_layers_on_one_gpu` at the end).

The hooks are the two constexprs `symm_protocol` documents: PHASES (which parts of a call run) and
EMULATED (interpreter: the timeout counts polls, no inline PTX). Everything else a test reaches here
is the production kernel body: peer pointers (a table of host addresses under the interpreter),
tickets and the epoch advance, the bounded waits, the error report, which blocks a program walks and
which slot it clears.

Emulated ranks: each rank's buffer is its own allocation laid out as on the GPU (header with the
abort word, then the slots), each rank has its own device state and error word, and every rank's
ptrs table lists all buffers. On CPU (TRITON_INTERPRET=1) a call runs part by part (`call_parts`),
each part on every rank in turn, so every wait finds what the earlier launches wrote; on one GPU the
ranks run concurrently on their own streams with the production launch (tests/test_gpu_symm_*).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional, Sequence

import torch

from . import symm_oneshot
from . import symm_protocol as P
from .quant_codes import QuantArgs, quant_args
from .symm_ring import (
    STAGE_FINALIZE,
    STAGE_GATHER,
    STAGE_REDUCE,
    STAGE_SF_PAD,
    RingShape,
    _ring_kernel,
)
from .symm_ring import call_args as ring_call_args
from .symm_ring_device import CHUNK, FREED_BYTE, SLOTS, STATE_WORDS, buffer_bytes

# the kernels that take the PHASES / EMULATED hooks (the ring has its own: EmulatedRing below)
KERNELS = {"oneshot": symm_oneshot}


def _kernel(kind: str):
    if kind not in KERNELS:
        raise ValueError(
            f"kind: expected one of {sorted(KERNELS)}, got {kind!r} (the two-shot ring: "
            "EmulatedRing, ring_layers_on_one_gpu)"
        )
    return KERNELS[kind]


def call_parts(kind: str) -> tuple[int, ...]:
    """The parts of one call in the order the CPU emulation runs them (each on every rank)."""
    _kernel(kind)
    return (P.PUBLISH | P.FINALIZE, P.CLEAR, P.REDUCE | P.NORM, P.EPOCH)


def launch_with_hooks(
    kind: str,
    layer: P.SymmLayer,
    *,
    shape=None,
    phases: int = P.ALL_PHASES,
    emulated: bool = False,
    programs: Optional[int] = None,
    **tensors,
) -> None:
    """One launch of `kind`'s production kernel with the hooks set (benchmark ablations: phases;
    CPU emulation: emulated). programs: the grid (default: the production launch's)."""
    if tensors["perm"].shape[0] == 0:
        return
    kernel = _kernel(kind)
    if layer.world == 1:  # the local kernel: no exchange, no hooks
        kernel.launch(layer, shape=shape, **tensors)
        return
    grid, args, constexprs = kernel.call_args(layer, shape, **tensors)
    if emulated:
        _interpreter_loop_bounds()
    kernel.KERNEL[(programs or grid,)](*args, **constexprs, PHASES=phases, EMULATED=emulated)


@dataclass
class EmulatedGroup:
    """W ranks' buffers (uint8, each laid out as on the GPU), device states (int32 [W,
    STATE_WORDS]), error words (int32 [W, 4]; pinned host memory on a GPU) and layers."""

    kind: str
    bufs: list
    states: torch.Tensor
    errs: torch.Tensor
    layers: list

    def data(self, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank `rank`'s slots, as the activation dtype (past the header)."""
        return self.bufs[rank][P.HEADER_BYTES :].view(dtype)

    def slot(self, rank: int, slot: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank `rank`'s slot `slot`: [W, cap, H] (source, token)."""
        world, cap, hidden = len(self.bufs), self.layers[0].cap, self.layers[0].hidden
        n = P.slot_elems(world, cap, hidden)
        return self.data(rank, dtype)[slot * n : (slot + 1) * n].view(world, cap, hidden)

    def abort_word(self, rank: int) -> torch.Tensor:
        return self.bufs[rank][:4].view(torch.int32)

    def call(self, inputs, outputs, parts=None, skip_rank=None, programs=None, shape=None) -> None:
        """CPU: one call, part by part on every rank (skip_rank makes none of its launches).
        inputs / outputs: per rank, EpilogueInputs and (residual_out, norm_out, q, sf)."""
        for phases in parts if parts is not None else call_parts(self.kind):
            for r, layer in enumerate(self.layers):
                if r == skip_rank:
                    continue
                launch_with_hooks(
                    self.kind,
                    layer,
                    shape=shape,
                    phases=phases,
                    emulated=True,
                    programs=programs,
                    **call_tensors(inputs[r], outputs[r]),
                )


def call_tensors(inp, out) -> dict:
    """The launch keywords from EpilogueInputs and (residual_out, norm_out, q, sf)."""
    residual_out, norm_out, q, sf = out
    return dict(
        residual_out=residual_out,
        norm_out=norm_out,
        q=q,
        sf=sf,
        gemm2_out=inp.gemm2_out,
        perm=inp.expanded_idx_to_permuted_idx,
        weights=inp.expert_weights,
        shared=inp.shared_output,
        residual=inp.residual,
        gamma=inp.gamma,
    )


def emulated_group(
    kind: str,
    spec,
    world: int,
    cap: int,
    device="cpu",
    timeout: int = 3,
    num_sms: Optional[int] = None,
    quant: Optional[QuantArgs] = None,
) -> EmulatedGroup:
    """W ranks' buffers and layers for `spec`. timeout: polls (CPU emulation) or microseconds (a
    GPU). num_sms: each rank's share of the SMs on a GPU (every program of every rank resident).
    quant: overrides the spec's (tests pick scales that exercise the codes)."""
    _kernel(kind)
    device = torch.device(device)
    elem = torch.finfo(spec.dtype).bits // 8
    nbytes = P.buffer_bytes(kind, world, cap, spec.hidden_size, elem)
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(world)]
    for b in bufs:
        b[: P.HEADER_BYTES].zero_()
        P.fill_sentinel(b[P.HEADER_BYTES :].view(torch.int16))
    errs = torch.zeros((world, 4), dtype=torch.int32)
    if device.type == "cuda":
        errs = errs.pin_memory()
    states = torch.zeros((world, P.STATE_WORDS), dtype=torch.int32, device=device)
    if num_sms is None:
        num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count // world
            if device.type == "cuda"
            else 3
        )
    layers = []
    for rank in range(world):
        ptrs = torch.tensor(
            [b.data_ptr() for b in bufs] + [errs[rank].data_ptr()],
            dtype=torch.int64,
            device=device,
        )
        layers.append(
            P.SymmLayer(
                ptrs=ptrs,
                state=states[rank],
                world=world,
                rank=rank,
                cap=cap,
                data_off=P.HEADER_BYTES // 2,
                num_sms=num_sms,
                timeout_us=timeout,
                hidden=spec.hidden_size,
                routed_scaling=float(spec.routed_scaling_factor),
                eps=float(spec.eps),
                weight_bias=float(spec.weight_bias),
                quant=quant if quant is not None else quant_args(spec),
            )
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return EmulatedGroup(kind, bufs, states, errs, layers)


def _interpreter_loop_bounds() -> None:
    """Triton 3.6's interpreter turns a loop bound into an int with int() of a 1-element array,
    which numpy >= 2.4 refuses; the kernels' grid-stride loops (`range(pid, n, nprog)`) need it.
    Patch that one conversion (idempotent; interpreter only)."""
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor
    if getattr(original, "fusion_bridge_compat", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.fusion_bridge_compat = True
    interp._patch_lang_tensor = patched


# ---- the two-shot ring (kernels/symm_ring) ------------------------------------------------------
# Its emulation runs one launch per (stage, chunk, rank, program) in the pipeline's own order
# (finalize c, reduce c - 1, gather c - 2), so every wait finds what earlier launches wrote. The
# kernel body, the slot / ownership / item formulas, the release counters, the abort words and the
# error reports are the production ones (pointers: a table of host addresses); the timer counts
# polls and the end-of-call ticket's base advance is done here.
def _ring_layer(
    ptrs, state, world, rank, num_sms, timeout_us, hidden, spec_scalars, quant
) -> P.SymmLayer:
    routed_scaling, eps, weight_bias = spec_scalars
    return P.SymmLayer(
        ptrs=ptrs, state=state, world=world, rank=rank, cap=0, data_off=P.HEADER_BYTES // 2,
        num_sms=num_sms, timeout_us=timeout_us, hidden=hidden, routed_scaling=routed_scaling,
        eps=eps, weight_bias=weight_bias, quant=quant,
    )  # fmt: skip


class EmulatedRing:
    """W ranks' buffers (abort words and release counters in their headers), states and error
    words, on the CPU. region: int16 elements between the header and the slots (the staged
    pipeline's place in the two-shot workspace)."""

    def __init__(self, world: int, chunk: int, hidden: int, region: int = 0):
        elems = buffer_bytes(world, hidden, 2, chunk) // 2 + region
        self.world, self.chunk, self.hidden = world, chunk, hidden
        self.bufs = torch.full((world, elems), P.SENTINEL_BITS, dtype=torch.int16)
        self.bufs[:, : P.HEADER_BYTES // 2] = 0
        self.states = torch.zeros((world, STATE_WORDS), dtype=torch.int64)
        self.errors = torch.zeros((world, 4), dtype=torch.int32)
        self.ptrs = [
            torch.tensor(
                [int(b.data_ptr()) for b in self.bufs] + [int(self.errors[r].data_ptr())],
                dtype=torch.int64,
            )
            for r in range(world)
        ]

    @property
    def aborts(self) -> torch.Tensor:
        """int32 [W]: each rank's abort word (a view into its header)."""
        return self.bufs[:, :2].view(torch.int32)[:, 0]

    @property
    def freed(self) -> torch.Tensor:
        """int64 [W, SLOTS]: each rank's release counters (a view into its header)."""
        lo = FREED_BYTE // 2
        return self.bufs[:, lo : lo + 4 * SLOTS].view(torch.int64)

    def flags(self, byte: int) -> torch.Tensor:
        """int64 [W, SLOTS]: each rank's header words at `byte` (the staged pipeline's flags)."""
        return self.bufs[:, byte // 2 : byte // 2 + 4 * SLOTS].view(torch.int64)

    def data_all_sentinel(self) -> bool:
        return bool((self.bufs[:, P.HEADER_BYTES // 2 :] == P.SENTINEL_BITS).all())

    def call(
        self,
        per_rank: Sequence[dict],
        *,
        spec_scalars: tuple[float, float, float],
        quant: QuantArgs,
        shape: RingShape,
        programs: int = 2,
        max_polls: int = 3,
        skip_rank: Optional[int] = None,
    ) -> None:
        """per_rank[r]: rank r's tensors as symm_ring.launch takes them; spec_scalars: (routed
        scaling, eps, weight_bias)."""
        world, chunk, hidden = self.world, self.chunk, self.hidden
        tokens = per_rank[0]["perm"].shape[0]
        if tokens == 0:
            return
        _interpreter_loop_bounds()  # the streamed row stages loop over columns up to H
        nchunks = -(-tokens // chunk)
        cw = -(-chunk // world)
        consts = shape.constexprs(hidden)
        bound = max(  # loop bounds only: the kernel's own formulas decide which items run
            world * cw * -(-hidden // consts["F_COLS"]),
            chunk,
            (tokens + 255) // 32 * -(-hidden // 2048) + 8,  # swizzled scale padding items
        )
        items = -(-bound // programs) + 1
        order = []
        for it in range(nchunks + 2):
            for stage, c in ((STAGE_FINALIZE, it), (STAGE_REDUCE, it - 1), (STAGE_GATHER, it - 2)):
                if 0 <= c < nchunks:
                    order.append((stage, c))
        order.append((STAGE_SF_PAD, 0))
        layers = [
            _ring_layer(
                self.ptrs[r], self.states[r], world, r, 1, max_polls, hidden, spec_scalars, quant
            )
            for r in range(world)
        ]
        for stage, c in order:
            for rank in range(world):
                if rank == skip_rank:
                    continue
                args, constexprs = ring_call_args(
                    layers[rank], shape, chunk=chunk, **per_rank[rank]
                )
                for pid in range(programs):
                    _ring_kernel[(1,)](
                        *args,
                        EMU=True,
                        EMU_PID=pid,
                        EMU_NPROG=programs,
                        EMU_STAGE=stage,
                        EMU_CHUNK=c,
                        EMU_ITEMS=items,
                        num_warps=4,
                        **constexprs,
                    )
        for rank in range(world):
            if rank != skip_rank:  # what the GPU's last ticket does
                self.states[rank, 0] += nchunks


def ring_launch_ablated(layer: P.SymmLayer, phases: int, shape: RingShape, **tensors) -> None:
    """Benchmarks only: the GPU ring kernel with its PHASES hook (symm_protocol.RING_*; results
    are wrong unless phases == RING_ALL), the production grid."""
    from .symm_ring import _OCCUPANCY, launch, occupancy_key

    args, constexprs = ring_call_args(layer, shape, **tensors)
    key = occupancy_key(constexprs, shape, tensors["residual"].device)
    if key not in _OCCUPANCY:  # once, eager: compiles the production variant, fills _OCCUPANCY
        launch(layer, shape=shape, **tensors)
    programs = layer.num_sms * min(shape.programs_per_sm, _OCCUPANCY[key])
    _ring_kernel[(programs,)](*args, PHASES=phases, **shape.options(), **constexprs)


def ring_layers_on_one_gpu(
    world: int,
    hidden: int,
    spec,
    timeout_s: float = 10.0,
    device=None,
    chunk: int = CHUNK,
    nbytes: Optional[int] = None,
):
    """W ranks' layers on ONE GPU: each rank's buffer its own allocation, each rank's programs on
    SMs / W (so all ranks' programs are resident together when each rank launches on its own
    stream). chunk: the buffers' layout (the staged pipeline's StagedShape.chunk); nbytes: a
    buffer size other than that layout's (the two-shot workspace's, `symm_protocol.buffer_bytes`).
    Returns a
    namespace of layers, errs (pinned int32 [4] per rank) and buffers: keep it alive while its
    layers are used (the layers hold raw pointers into the buffers)."""
    dev = torch.device("cuda", 0) if device is None else device
    nbytes = nbytes or buffer_bytes(world, hidden, 2, chunk)
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(world)]
    for b in bufs:
        b[: P.HEADER_BYTES].zero_()
        P.fill_sentinel(b[P.HEADER_BYTES :].view(torch.int16))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    layers, errs = [], []
    for rank in range(world):
        err = torch.zeros(4, dtype=torch.int32).pin_memory()
        ptrs = torch.tensor(
            [b.data_ptr() for b in bufs] + [err.data_ptr()], dtype=torch.int64, device=dev
        )
        state = torch.zeros(STATE_WORDS, dtype=torch.int64, device=dev)
        scalars = (float(spec.routed_scaling_factor), float(spec.eps), float(spec.weight_bias))
        layers.append(
            _ring_layer(
                ptrs,
                state,
                world,
                rank,
                sms // world,
                int(timeout_s * 1e6),
                hidden,
                scalars,
                quant_args(spec),
            )  # fmt: skip
        )
        errs.append(err)
    torch.cuda.synchronize(dev)
    return SimpleNamespace(layers=layers, errs=errs, buffers=bufs)
