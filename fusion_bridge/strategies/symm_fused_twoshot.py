"""`symm_fused_twoshot`: our own launches over PyTorch symmetric memory (no NVLink multicast) for
large T, the bandwidth path: finalize + shared add, reduce-scatter by token, residual add,
all-gather of the reduced rows, RMSNorm (+ FP8 / NVFP4), as a chunked pipeline.

Rows are cut into chunks that take a few fixed slots in turn, so the workspace has a fixed size
whatever T is (58.7 MB per rank at H=7168 in bf16, any W) and no T takes the overflow route.
Inside a chunk, row j belongs to rank j % W. Each rank finalizes its partial of chunk c into the
owners' slots (rounded once to the activation dtype) while it reduces chunk c - 1 (the W partials
of its own rows summed in rank order in fp32, plus the residual, rounded: residual_out, pushed to
every peer) and norms the rows the peers pushed. Every rank norms every row from the same rounded
residual_out bits with the same code, so all outputs are bitwise identical on every rank. Link
bytes per rank: 2 (W - 1) / W of T * H * elem (at W = 8 a quarter of a one-shot's). Error against
the fp32 oracle: 3 roundings (the partial, residual_out, norm_out).

One launch config, the two-shot pipeline (`kernels/symm/twoshot.py`: one launch per stage per chunk
of 1024 tokens in 2 slots, the chunks' finalize launches on two side streams in turn, a chunk's
arrival one flag per rank, L2 hints that keep a chunk's slot rows in L2 between its finalize and
its reduce, the row launches on a high-priority stream, a chunk's finalize free to start once its
slot is released). The earlier config, "f_after_x" (row launches on the caller's stream, the
finalize of chunk c + 1 only after that of chunk c), was a launch variant until issue 37 and is
now built by the benchmark alone (benchmarks/twoshot_local.py). How the default's local work
compares with our standalone finalize + add+RMSNorm, and with the earlier config:
docs/performance.md#the-large-t-two-shot-the-two-shot-pipeline.

It shares `symm_fused_oneshot`'s workspace handling (symmetric-memory rendezvous, the peers'
buffer pointers, the pinned error word, one workspace shared by every layer) and its safety rules:
waits are bounded; a peer that does not arrive makes the kernels write NaN rows and the error
word, and every later call raises until the bridge is rebuilt. The kernel modules' docstrings
carry the ordering and deadlock arguments.

Opt-in: auto neither prepares nor picks it until it has been measured on two GPUs (request it
by name).
"""

from __future__ import annotations

from fusion_bridge.kernels.symm.protocol import TWOSHOT
from fusion_bridge.strategies.base import DEFAULT_VARIANT, Step, required_stages
from fusion_bridge.strategies.symm_fused_oneshot import SymmFusedOneshotStrategy


class SymmFusedTwoshotStrategy(SymmFusedOneshotStrategy):
    name = "symm_fused_twoshot"
    summary = (
        "our launches over symmetric memory for large T: a chunked pipeline of "
        "finalize+shared, reduce-scatter by token, residual, all-gather of the rounded rows, "
        "RMSNorm (+fp8/nvfp4) in a fixed workspace of chunk slots"
    )
    workspace_layout = TWOSHOT  # the chunk slots' layout (kernels/symm/protocol.py)
    # Opt-in until it is measured on two GPUs: auto neither prepares it (no self-test at every
    # build) nor picks it; request it by name to use or measure it.
    opt_in = True

    @classmethod
    def steps(cls, spec, env):
        return [Step("triton.symm_twoshot_epilogue", required_stages(spec, env.world_size))]

    @classmethod
    def variants(cls, spec, env):
        """ "default" only: the two-shot pipeline's one launch config."""
        return (DEFAULT_VARIANT,)

    @classmethod
    def roundings(cls, spec, env):
        return 3  # the partial, residual_out (the norm reads it, on every rank) and each output

    def _launcher_class(self):
        from fusion_bridge.kernels.symm.twoshot import TwoshotLauncher

        return TwoshotLauncher
