"""`symm_fused_twoshot`: our own single launch over PyTorch symmetric memory (no NVLink multicast)
for large T, the bandwidth path: finalize + shared add, reduce-scatter by token, residual add,
all-gather of the reduced rows, RMSNorm (+ FP8 / NVFP4).

Rows are dealt to ranks in blocks of W (row t belongs to rank t % W). Each rank finalizes every row,
pushes the rows other ranks own to their owners as soon as they are finalized (rounded once to the
activation dtype), keeps its own rows' partials in registers, sums the W partials of each owned row
in
rank order in fp32, adds the residual, rounds (that is residual_out) and pushes the rounded row to
every
peer; every rank computes norm_out (+ quant) from the rounded residual_out with the same code, so
all
outputs are bitwise identical on every rank. Link bytes per rank: 2 (W - 1) / W of T * H * elem (at
W = 2
what a one-shot moves; at W = 8 a quarter of it). Error against the fp32 oracle: 3 roundings (the
partial, residual_out, norm_out).

It shares `symm_fused_oneshot`'s protocol (data carries its arrival, three rotating slots cleared
one
call behind, device-side epoch, bounded waits with an error word, no host state under CUDA graphs)
and
its safety rules; see kernels/symm_twoshot.py for the ordering and deadlock arguments. Calls with
more
tokens than the workspace holds take the planner's overflow route.

Opt-in: auto neither prepares nor picks it until it has been measured on two GPUs (request it by
name).
"""

from __future__ import annotations

from .base import Step, required_stages
from .symm_fused_oneshot import SymmFusedOneshotStrategy


class SymmFusedTwoshotStrategy(SymmFusedOneshotStrategy):
    name = "symm_fused_twoshot"
    summary = (
        "one Triton launch over symmetric memory for large T: finalize+shared, reduce-scatter by "
        "token, "
        "residual, all-gather of the rounded rows, RMSNorm (+fp8/nvfp4)"
    )
    workspace_kind = "twoshot"
    # Opt-in until it is measured on two GPUs: auto neither prepares it (no 352 MB workspace at
    # H=7168, no
    # self-test at every build) nor picks it; request it by name to use or measure it.
    opt_in = True

    @classmethod
    def steps(cls, spec, env):
        return [Step("triton.symm_twoshot_epilogue", required_stages(spec, env.world_size))]

    @classmethod
    def roundings(cls, spec, env):
        return 3  # the partial, residual_out (the norm reads it, on every rank) and each output

    def _kernel_module(self):
        from ..kernels import symm_twoshot

        return symm_twoshot
