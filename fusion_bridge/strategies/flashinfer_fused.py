"""`flashinfer_fused`: FlashInfer's trtllm_moe_finalize_allreduce_fusion (pattern
kMoEFinalizeARResidualRMSNorm): finalize + shared add + all-reduce + residual + RMSNorm in one
kernel; for a quantized spec, our quant kernel as a second step (FlashInfer's fused FP4 is unusable
in 0.7.2.post1 -- see flashinfer_fused_fp4 for the variant that would use it).

Traps guarded (measured on 2x H200; docs/upstream.md):
- correct only when hidden % 256 == 0 (FlashInfer checks % 8): H=2880 gave inf, NaN, then a hang;
- reads expert weights in the activation dtype without a check: we cast them;
- one-shot Lamport only, world sizes 2/4/8/16, SM >= 90 (below, the kernel body is empty);
- int32 row offsets: gemm2_out with >= 2^31 elements is rerouted (never reaches the kernel);
- a call with more tokens than the workspace holds corrupts memory: rerouted or raised.
"""

from __future__ import annotations

from typing import Optional

import torch

from fusion_bridge.epilogue_tensors import (
    EpilogueInputs,
    EpilogueOutputs,
    allocate_outputs,
    deliver,
)
from fusion_bridge.reasons import collect, refuse_dynamic_fp8, require_hidden_multiple
from fusion_bridge.spec import QuantKind, Stage
from fusion_bridge.strategies import flashinfer_calls, flashinfer_common as fic
from fusion_bridge.strategies.base import (
    DEFAULT_VARIANT,
    Step,
    Strategy,
    kernel_quant_args,
    required_stages,
)

INT32_LIMIT = 2**31


class FlashInferFusedStrategy(Strategy):
    marks_collective = True
    name = "flashinfer_fused"
    summary = (
        "FlashInfer trtllm_moe_finalize_allreduce_fusion: finalize+shared+AR+residual+RMSNorm in "
        "one "
        "kernel (+ our quant kernel)"
    )
    self_tested = True
    fused_fp4 = False  # the flashinfer_fused_fp4 subclass lets FlashInfer quantize to FP4 itself

    @classmethod
    def not_supported_reasons(cls, spec, env):
        return collect(
            fic.common_reasons(spec, env, cls.name),
            refuse_dynamic_fp8(
                spec,
                cls.name,
                "FlashInfer's fused MoE-finalize kernel writes no such format, and our quant "
                "step after it is not built: it can only be checked on two GPUs",
            ),
            require_hidden_multiple(
                spec,
                cls.name,
                256,
                "hidden_not_multiple_of_256",
                " (H/8 a whole number of warps; at H=2880 we measured inf, NaN and a hang "
                "although FlashInfer checks only % 8)",
            ),
        )

    @classmethod
    def steps(cls, spec, env):
        stages = required_stages(spec, env.world_size)
        fused = tuple(s for s in stages if s is not Stage.QUANT)
        steps = [Step("flashinfer.moe_finalize_ar_residual_rmsnorm", fused)]
        if Stage.QUANT in stages:
            steps.append(Step(f"local.quant_{spec.quant.kind.value}", (Stage.QUANT,)))
        return steps

    @classmethod
    def roundings(cls, spec, env):
        # FlashInfer accumulates the top-k sum in the activation dtype: each product is rounded and
        # each add is rounded (2K), then shared add, the all-reduce output, residual add and
        # the norm output.
        return 2 * spec.top_k + int(spec.has_shared_output) + 3

    @classmethod
    def max_tokens_per_call(cls, spec, env):
        return fic.max_tokens_for(spec, env.world_size)

    def this_rank_resource_reasons(self):
        return collect(fic.memory_reason(self.spec, self.env.world_size, self.device, self.name))

    def prepare(self) -> None:
        import flashinfer.comm as fi_comm
        from fusion_bridge.kernels import ops

        self._ops = ops.direct_when_eager  # our quant kernel
        self._fi = fi_comm
        self._workspace = fic.acquire_workspace(self.group, self.spec, self.env.world_size)
        self._rank = torch.distributed.get_rank(self.group)
        self._moe = (
            flashinfer_calls.MoeFinalizeCall(  # pre-bound; the public wrapper if internals differ
                fi_comm,
                self._workspace,
                world_size=self.env.world_size,
                rank=self._rank,
                eps=self.spec.eps,
                routed_scaling_factor=self.spec.routed_scaling_factor,
                weight_bias=self.spec.weight_bias,
            )
        )

    @property
    def workspace_bytes(self) -> int:
        ws = getattr(self, "_workspace", None)
        return fic.workspace_bytes(ws) if ws is not None else 0

    def accepts(self, inputs: EpilogueInputs) -> bool:
        """Shape-only per-call check (no sync): FlashInfer indexes rows with int32 offsets."""
        return inputs.gemm2_out.numel() < INT32_LIMIT

    def run(
        self,
        inputs: EpilogueInputs,
        variant: str = DEFAULT_VARIANT,
        out: Optional[EpilogueOutputs] = None,
    ) -> EpilogueOutputs:
        spec, given = self.spec, out
        if out is None and self.fused_fp4:
            out = allocate_outputs(spec, inputs.tokens, inputs.residual.device)
        residual_out, norm_out = (
            (out.residual_out, out.norm_out)
            if out is not None
            else (torch.empty_like(inputs.residual), torch.empty_like(inputs.residual))
        )
        # the caller's quant buffers only where FlashInfer's call writes them (fused NVFP4)
        quant_out, scale_out = (out.quant, out.scale) if self.fused_fp4 else (None, None)
        if (
            scale_out is not None
        ):  # swizzled padding must read 0; not verified that FlashInfer writes it
            scale_out.zero_()
        weights = inputs.expert_weights
        if weights.dtype != spec.dtype:  # FlashInfer reads them as the activation dtype, unchecked
            weights = weights.to(spec.dtype)
        with self.collective():
            self._moe(
                inputs.gemm2_out,
                inputs.residual,
                inputs.gamma,
                inputs.expanded_idx_to_permuted_idx,
                norm_out,
                residual_out,
                quant_out,
                scale_out,
                inputs.shared_output,
                weights,
            )
        kind = spec.quant.kind
        if quant_out is None and kind is not QuantKind.NONE:
            quant_out, scale_out = self._ops.quantize(norm_out, *kernel_quant_args(spec))
        result = EpilogueOutputs.for_quant(kind, residual_out, norm_out, quant_out, scale_out)
        return deliver(given, result)

    def close(self) -> None:
        workspace, self._workspace = getattr(self, "_workspace", None), None
        if workspace is not None:
            fic.release_workspace(self.group, self.spec, self.env.world_size, workspace)
