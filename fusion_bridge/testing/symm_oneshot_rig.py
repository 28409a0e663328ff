"""Entry points for tests and benchmarks only (never imported by the product): the symmetric-memory
kernels with their hooks set, and W ranks emulated in one process: the one-shot exchange kernel's
(world size >= 2; the two-shot's rig is `symm_twoshot_rig`).

The hooks are the two constexprs `protocol` documents: PHASES (which parts of a call run) and
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
from typing import Optional

import torch

from fusion_bridge.kernels.symm import oneshot as symm_oneshot
from fusion_bridge.kernels.symm import protocol as P
from fusion_bridge.kernels.quant_codes import QuantArgs, quant_args
from fusion_bridge.kernels.records import RowOutputs, RowSource


def call_parts() -> tuple[int, ...]:
    """The parts of one call in the order the CPU emulation runs them (each on every rank)."""
    return (P.PUBLISH | P.FINALIZE, P.CLEAR, P.REDUCE | P.NORM, P.EPOCH)


def launch_with_hooks(
    layer: P.SymmLayer,
    src: RowSource,
    out: RowOutputs,
    *,
    config=None,
    phases: int = P.ALL_PHASES,
    emulated: bool = False,
    programs: Optional[int] = None,
) -> None:
    """One launch of the one-shot exchange kernel with the hooks set (benchmark ablations: phases;
    CPU emulation: emulated). programs: the grid (default: the production launch's)."""
    if src.perm.shape[0] == 0:
        return
    grid, args, constexprs, warps = symm_oneshot.call_args(layer, config, src, out)
    if emulated:
        _interpreter_loop_bounds()
    named = dict(zip(("WORLD", "FORM", "BLOCK1"), constexprs))
    symm_oneshot.KERNEL[(programs or grid,)](
        *args, **named, num_warps=warps, PHASES=phases, EMULATED=emulated
    )


@dataclass
class EmulatedGroup:
    """W ranks' buffers (uint8, each laid out as on the GPU), device states (int32 [W,
    ONESHOT_STATE_WORDS]), error words (int32 [W, 4]; pinned host memory on a GPU) and layers."""

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

    def call(self, inputs, outputs, parts=None, skip_rank=None, programs=None, config=None) -> None:
        """CPU: one call, part by part on every rank (skip_rank makes none of its launches).
        inputs / outputs: per rank, EpilogueInputs and (residual_out, norm_out, q, sf)."""
        for phases in parts if parts is not None else call_parts():
            for r, layer in enumerate(self.layers):
                if r == skip_rank:
                    continue
                launch_with_hooks(
                    layer,
                    *call_records(inputs[r], outputs[r]),
                    config=config,
                    phases=phases,
                    emulated=True,
                    programs=programs,
                )


def call_records(inp, out) -> tuple[RowSource, RowOutputs]:
    """A launcher's records from EpilogueInputs and (residual_out, norm_out, q, sf)."""
    return RowSource.of(inp), RowOutputs(*out)


def emulated_group(
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
    if world < 2:
        raise ValueError(f"world: the exchange kernel needs at least 2 ranks, got {world}")
    device = torch.device(device)
    elem = torch.finfo(spec.dtype).bits // 8
    nbytes = P.ONESHOT.buffer_bytes(world, cap, spec.hidden_size, elem)
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(world)]
    for b in bufs:
        b[: P.HEADER_BYTES].zero_()
        P.fill_sentinel(b[P.HEADER_BYTES :].view(torch.int16))
    errs = torch.zeros((world, 4), dtype=torch.int32)
    if device.type == "cuda":
        errs = errs.pin_memory()
    states = torch.zeros((world, P.ONESHOT_STATE_WORDS), dtype=torch.int32, device=device)
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
    return EmulatedGroup(bufs, states, errs, layers)


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
