"""`symm_fused_twoshot`: our own single launch over PyTorch symmetric memory (multicast off) for
large T, the bandwidth path: finalize + shared add, reduce-scatter by token, residual add,
all-gather of the reduced rows, RMSNorm (+ FP8 / NVFP4).

A chunked pipeline over a ring of chunk slots (kernels/symm_ring.py): rows go in chunks of 256
tokens through 4 slots of a buffer whose size does not depend on T (29.4 MB per rank at H=7168,
bf16, any world size), so every T of the spec runs here (no overflow route). Within a chunk, row j
belongs to rank j % W. Each rank finalizes every row and stores it (rounded once) at its owner; the
owner sums the W partials of its rows in rank order in fp32, adds the residual, rounds (that is
residual_out) and pushes the row to every rank; every rank norms every row (+ quant) from the
rounded residual_out with the same code, so all outputs are bitwise identical on every rank. The
three steps run one chunk apart in every program, so the exchange of one chunk overlaps the local
work of the next. Link bytes per rank: 2 (W - 1) / W of T * H * elem (at W = 2 what a one-shot
moves; at W = 8 a quarter of it). Error against the fp32 oracle: 3 roundings (the partial,
residual_out, norm_out).

Like `symm_fused_oneshot`: the data carries its arrival, device-side state (no host state under CUDA
graphs), bounded waits with an error word (a missing peer gives NaN and a clear error, never a
hang). A slot is handed back to its writers through a release counter once every reader of every
rank is done with it.

Opt-in: auto neither prepares nor picks it until it has been measured on two GPUs (request it by
name).
"""

from __future__ import annotations

from .base import Step, required_stages
from .symm_fused_oneshot import SymmFusedOneshotStrategy


class SymmFusedTwoshotStrategy(SymmFusedOneshotStrategy):
    name = "symm_fused_twoshot"
    summary = (
        "one Triton launch over symmetric memory for large T: a chunked pipeline over a ring of "
        "chunk slots (workspace independent of T): finalize+shared, reduce-scatter by token, "
        "residual, all-gather of the rounded rows, RMSNorm (+fp8/nvfp4)"
    )
    workspace_kind = "twoshot"
    # Opt-in until it is measured on two GPUs: auto neither prepares it (no self-test at every
    # build) nor picks it; request it by name to use or measure it.
    opt_in = True

    @classmethod
    def steps(cls, spec, env):
        return [Step("triton.symm_twoshot_epilogue", required_stages(spec, env.world_size))]

    @classmethod
    def roundings(cls, spec, env):
        return 3  # the partial, residual_out (the norm reads it, on every rank) and each output

    def _kernel_module(self):
        from ..kernels import symm_ring

        return symm_ring
