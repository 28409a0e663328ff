"""`fused_tp1`: one Triton launch at world size 1: finalize + shared add + residual add + RMSNorm
(+ FP8 / NVFP4), the path for MoE models on one GPU and for layers whose TP group is one rank.

It is the one-shot symmetric-memory kernel (kernels/symm/oneshot.py) specialised for a world of one:
the same building blocks (top-k finalize of a row, rounding, RMSNorm, quant), with the exchange left
out. Each program keeps its part of the row's partial in registers (no round trip through memory):
whole rows, one program per row, or for few rows the row's columns split over several programs
that exchange only their sums of squares inside the launch (kernels/row_epilogue.py). The partial
is rounded once to the activation dtype, as the two-launch path stores it, so residual_out is that
path's bit for bit; norm_out follows from it (its sum of squares, for split rows, in another order).
Error against the fp32 oracle: the partial's rounding + the output's rounding (+ the oracle's).

A strategy of its own rather than a variant of `symm_fused_oneshot`: at world size 1 it needs none
of that strategy's capability (symmetric memory, multicast settings, peers; its only device state is
the split rows' arrival words, one set per CUDA stream), and it runs under the Triton interpreter,
so the CPU parity tests cover it.
"""

from __future__ import annotations

from typing import Optional

import torch

from fusion_bridge.epilogue_tensors import EpilogueInputs, EpilogueOutputs
from fusion_bridge.reasons import Reason, collect, require_sm_at_least, require_triton
from fusion_bridge.strategies.base import DEFAULT_VARIANT, Step, Strategy, required_stages
from fusion_bridge.kernels.records import RowOutputs
from fusion_bridge.strategies.kernel_call import FamilyCall, _row_source
from fusion_bridge.strategies.local_common import needs_device

MAX_HIDDEN = 16384  # a whole row (next power of two) in registers, as the one-shot kernel holds it


class FusedTp1Strategy(FamilyCall, Strategy):
    name = "fused_tp1"
    summary = (
        "world size 1: one Triton launch, finalize+shared in registers, residual+RMSNorm "
        "(+fp8/nvfp4)"
    )
    self_tested = True

    @classmethod
    def not_supported_reasons(cls, spec, env):
        world = None
        if env.world_size != 1:
            world = Reason(
                "world_size_unsupported",
                f"{cls.name} runs at world size 1 only (no exchange), but the group has "
                f"{env.world_size} ranks",
                "use symm_fused_oneshot or an NCCL-based strategy",
            )
        wide = None
        if spec.hidden_size > MAX_HIDDEN:
            wide = Reason(
                "hidden_too_large",
                f"{cls.name} holds a whole row in registers: hidden_size <= {MAX_HIDDEN} "
                f"required, got {spec.hidden_size}",
                "use local_fused_nccl",
            )
        return collect(
            world,
            require_triton(env, cls.name),
            needs_device(env, cls.name),
            require_sm_at_least(env, cls.name, 80, why=" (Triton 3 targets SM80+)"),
            wide,
        )

    @classmethod
    def is_auto_selectable(cls, spec, env):
        return env.device_type == "cuda"

    @classmethod
    def steps(cls, spec, env):
        return [Step("triton.fused_tp1_epilogue", required_stages(spec, env.world_size))]

    @classmethod
    def roundings(cls, spec, env):
        return 2  # the partial (as the two-launch path stores it) and each output

    def prepare(self) -> None:
        from fusion_bridge.kernels.layer import LayerRecord
        from fusion_bridge.kernels.tp1.launcher import Tp1Launcher

        num_sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda"
            else 0  # the interpreter: whole rows (tests/kernels/test_tp1.py runs the split)
        )
        self.bind_launcher(Tp1Launcher(LayerRecord.of(self.spec), num_sms, self.device))

    def check_error(self) -> None:
        """Raise (once) if an earlier call's split rows gave up waiting for their partner programs:
        that call's norm_out (and quantized) rows were written NaN. Reads pinned memory; no sync."""
        if self._launcher.take_error():
            raise RuntimeError(
                "fused_tp1: an earlier call's split rows timed out waiting for the other programs "
                "of their row (other work held the GPU's SMs for about a second), so that call's "
                "norm_out rows were written NaN (residual_out is correct). If this recurs, keep "
                "fused_tp1 out of auto with FUSION_BRIDGE_EXCLUDE=fused_tp1."
            )

    def run(
        self,
        inputs: EpilogueInputs,
        variant: str = DEFAULT_VARIANT,
        out: Optional[EpilogueOutputs] = None,
    ) -> EpilogueOutputs:
        """variant: the declared "default" (the launch config per T). `check_error` and
        `call_records`, written out: the error word read in place (the launcher's pinned word,
        `check_error` when it is set), then the outputs and the launch of their records."""
        if self._launcher._error_word[0]:
            self.check_error()
        if out is None:
            out = self._allocate(inputs.residual.shape[0])
        self._launcher(_row_source(inputs), RowOutputs.of(out, self._unused))
        return out
