"""Test and benchmark entry points of the two-shot (`symm_twoshot`): W ranks' buffers on the CPU
(`EmulatedTwoshot`) or on one GPU (`twoshot_layers_on_one_gpu`), one rank's launches of a call
(the syncs split into their signal and wait halves), and a call of W emulated ranks in one global
order (CPU interpreter or one GPU). Like `symm_oneshot_rig`, reached by no production module."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Sequence

import torch

from fusion_bridge.kernels.symm import protocol as P
from fusion_bridge.kernels.quant_codes import QuantArgs, quant_args
from fusion_bridge.kernels.symm.protocol import TWOSHOT_STATE_WORDS
from fusion_bridge.kernels.symm.twoshot_device import FREED_BYTE, MAX_SLOTS, buffer_bytes
from fusion_bridge.testing.symm_oneshot_rig import _interpreter_loop_bounds


def twoshot_layer(
    ptrs, state, world, rank, num_sms, timeout_us, hidden, spec_scalars, quant: QuantArgs
) -> P.SymmLayer:
    """One emulated rank's layer; spec_scalars: (routed scaling, eps, weight_bias). ptrs: the
    int64 table of the W buffers' addresses and the error word's (CPU or device)."""
    routed_scaling, eps, weight_bias = spec_scalars
    return P.SymmLayer(
        ptrs=ptrs, state=state, world=world, rank=rank, cap=0, data_off=P.HEADER_BYTES // 2,
        num_sms=num_sms, timeout_us=timeout_us, hidden=hidden, routed_scaling=routed_scaling,
        eps=eps, weight_bias=weight_bias, quant=quant, own_addr=int(ptrs[rank]),
    )  # fmt: skip


class EmulatedTwoshot:
    """W ranks' buffers (abort words, release counters and flags in their headers, then `slots`
    slots of `chunk` tokens), states and error words, on the CPU."""

    def __init__(self, world: int, chunk: int, hidden: int, slots: int = MAX_SLOTS):
        elems = buffer_bytes(world, hidden, 2, chunk, slots) // 2
        self.world, self.chunk, self.hidden, self.slots = world, chunk, hidden, slots
        self.bufs = torch.full((world, elems), P.SENTINEL_BITS, dtype=torch.int16)
        self.bufs[:, : P.HEADER_BYTES // 2] = 0
        self.states = torch.zeros((world, TWOSHOT_STATE_WORDS), dtype=torch.int64)
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
        """int64 [W, MAX_SLOTS]: each rank's release counters (a view into its header)."""
        return self.flags(FREED_BYTE)

    def flags(self, byte: int) -> torch.Tensor:
        """int64 [W, MAX_SLOTS]: each rank's header words at `byte` (the arrival flags)."""
        return self.bufs[:, byte // 2 : byte // 2 + 4 * MAX_SLOTS].view(torch.int64)


def twoshot_layers_on_one_gpu(
    world: int, hidden: int, spec, timeout_s: float = 10.0, device=None, config=None
):
    """W ranks' layers on ONE GPU: each rank's buffer its own allocation, laid out for `config`
    (a symm_twoshot.TwoshotConfig; None: the default). Returns a namespace of layers, errs (pinned
    int32 [4] per rank) and buffers: keep it alive while its layers are used (the layers hold raw
    pointers into the buffers)."""
    from fusion_bridge.kernels.symm import twoshot as symm_twoshot

    config = config or symm_twoshot.DEFAULT_CONFIG
    dev = torch.device("cuda", 0) if device is None else device
    nbytes = buffer_bytes(world, hidden, 2, config.chunk, config.slots)
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(world)]
    for b in bufs:
        b[: P.HEADER_BYTES].zero_()
        P.fill_sentinel(b[P.HEADER_BYTES :].view(torch.int16))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    scalars = (float(spec.routed_scaling_factor), float(spec.eps), float(spec.weight_bias))
    layers, errs = [], []
    for rank in range(world):
        err = torch.zeros(4, dtype=torch.int32).pin_memory()
        ptrs = torch.tensor(
            [b.data_ptr() for b in bufs] + [err.data_ptr()], dtype=torch.int64, device=dev
        )
        state = torch.zeros(TWOSHOT_STATE_WORDS, dtype=torch.int64, device=dev)
        layers.append(
            twoshot_layer(
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


_STAGE_ORDER = {s: i for i, s in enumerate(("Q", "F", "A", "WA", "R", "D", "WD", "G", "P"))}


def twoshot_launches(
    layer: P.SymmLayer,
    records: tuple,
    config=None,
    emulated: bool = False,
    split: bool = True,
) -> list:
    """One rank's launches of one twoshot call, not made: [(stage letter, chunk, callable)] in the
    rank's order; records: the call's (RowSource, RowOutputs) (`call_records`); split: every sync
    as its halves (per chunk: Q gate, F finalize, A / WA signal / wait arrived, R reduce, D / WD
    signal / wait reduced, G gather, P release), else the production sequence
    (`symm_twoshot._sequence`). emulated: the interpreter's poll-count timer."""
    from fusion_bridge.kernels.symm import twoshot as symm_twoshot

    config = config or symm_twoshot.DEFAULT_CONFIG
    calls = symm_twoshot._call_launches(layer, config, *records, emulated)
    return [(stage, c, fn) for stage, c, fn, _ in symm_twoshot._sequence(calls, split=split)]


def twoshot_call(
    layers: Sequence[P.SymmLayer],
    per_rank: Sequence[tuple],
    config=None,
    emulated: bool = False,
    skip_rank: Optional[int] = None,
) -> None:
    """One call of the two-shot pipeline on W emulated ranks (CPU interpreter or one GPU): every
    rank's launches in ONE global order on the current stream, chunk by chunk and stage by stage
    (every rank's signals before any rank's wait), so every wait is for a launch made before it
    and no spinning launch holds SMs that an earlier one of a peer needs. per_rank[r]: rank r's
    (RowSource, RowOutputs) (`call_records`); skip_rank makes none of its launches."""
    queue = []
    for rank, (layer, records) in enumerate(zip(layers, per_rank)):
        if rank != skip_rank:
            for stage, c, fn in twoshot_launches(layer, records, config, emulated, True):
                queue.append(((c, _STAGE_ORDER[stage], rank), fn))
    if emulated:
        _interpreter_loop_bounds()
    for _, fn in sorted(queue, key=lambda item: item[0]):
        fn()
