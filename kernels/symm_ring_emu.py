"""Test-only entry point of the ring two-shot kernel (`symm_ring`): W ranks emulated under
TRITON_INTERPRET=1, every rank's buffer a row of one int16 tensor (header included), one launch per
(stage, chunk, rank, program) in the pipeline's own order (finalize c, reduce c - 1, gather c - 2),
so every wait finds what earlier launches wrote. The kernel body, the slot / ownership / item
formulas and the release counters are the production ones; only the peer pointers, the timer (a
poll count) and the end-of-call ticket differ (the caller-side base advance is done here).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton

from .symm_common import SENTINEL_BITS
from .symm_ring import (
    STAGE_FINALIZE,
    STAGE_GATHER,
    STAGE_REDUCE,
    STAGE_SF_PAD,
    RingShape,
    _args,
    _ring_kernel,
)
from .symm_ring_protocol import SLOTS, STATE_WORDS, buffer_bytes


class EmulatedRing:
    """W ranks' buffers, release counters, abort words and states, on the CPU."""

    def __init__(self, world: int, chunk: int, hidden: int, dtype=torch.bfloat16):
        elems = buffer_bytes(world, chunk, hidden, 2) // 2
        self.world, self.chunk, self.hidden, self.dtype = world, chunk, hidden, dtype
        self.bufs = torch.full((world, elems), SENTINEL_BITS, dtype=torch.int16)
        self.bufs[:, :128] = 0  # the header (counters live in `freed` here)
        self.freed = torch.zeros((world, SLOTS), dtype=torch.int64)
        self.aborts = torch.zeros(world, dtype=torch.int32)
        self.states = torch.zeros((world, STATE_WORDS), dtype=torch.int64)

    def data_all_sentinel(self) -> bool:
        return bool((self.bufs[:, 128:] == SENTINEL_BITS).all())

    def call(
        self,
        per_rank: Sequence[dict],
        *,
        quant: int,
        quant_scale: float,
        swizzled: bool,
        shape: RingShape,
        programs: int = 2,
        max_polls: int = 3,
        skip_rank: Optional[int] = None,
    ) -> None:
        """per_rank[r]: dict of rank r's tensors (gemm2_out, perm, weights, shared, residual, gamma,
        residual_out, norm_out, q, sf) and scalars (routed_scaling, eps, weight_bias)."""
        world, chunk, hidden = self.world, self.chunk, self.hidden
        tokens = per_rank[0]["perm"].shape[0]
        if tokens == 0:
            return
        nchunks = -(-tokens // chunk)
        cw = -(-chunk // world)
        f_cols = min(shape.f_cols, triton.next_power_of_2(hidden))
        r_cols = min(shape.r_cols, triton.next_power_of_2(hidden))
        bound = max(
            world * -(-cw // shape.f_rows) * -(-hidden // f_cols),
            -(-cw // shape.r_rows) * -(-hidden // r_cols),
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
        for stage, c in order:
            for rank in range(world):
                if rank == skip_rank:
                    continue
                io = dict(per_rank[rank])
                io.update(
                    ptrs=self.states, bufs=self.bufs, buf_elems=self.bufs.shape[1],
                    emu_abort=self.aborts, emu_freed=self.freed, state=self.states[rank],
                    chunk=chunk, rank=rank, timeout=max_polls, world=world,
                )  # fmt: skip
                args, constexprs = _args(None, io, quant, quant_scale, swizzled)
                constexprs.update(shape.constexprs(hidden))
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


def one_gpu_workspaces(world: int, chunk: int, hidden: int, timeout_s: float = 10.0, device=None):
    """W ranks' workspaces on ONE GPU (benchmarks and the emulated-ranks GPU test): each rank's
    buffer its own allocation, each rank's programs SMs / W (so every rank's programs are resident
    together when each rank launches on its own stream). Returns (workspaces, buffers)."""
    from types import SimpleNamespace

    from .symm_common import HEADER_BYTES

    dev = torch.device("cuda", 0) if device is None else device
    nbytes = buffer_bytes(world, chunk, hidden, 2)
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(world)]
    for b in bufs:
        b[:HEADER_BYTES].zero_()
        b[HEADER_BYTES:].view(torch.int16).fill_(SENTINEL_BITS)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = []
    for rank in range(world):
        err = torch.zeros(4, dtype=torch.int32).pin_memory()
        ptrs = torch.tensor(
            [b.data_ptr() for b in bufs] + [err.data_ptr()], dtype=torch.int64, device=dev
        )
        out.append(
            SimpleNamespace(
                ptrs=ptrs,
                state=torch.zeros(STATE_WORDS, dtype=torch.int64, device=dev),
                err=err,
                world=world,
                rank=rank,
                chunk=chunk,
                num_sms=sms // world,
                timeout_ns=int(timeout_s * 1e9),
                buffer=bufs[rank],
            )
        )
    torch.cuda.synchronize(dev)
    return out, bufs
