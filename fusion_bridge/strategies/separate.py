"""`separate`: every stage its own op, as model code writes it by hand today. Runs anywhere.

finalize (torch, rounded to the activation dtype) -> + shared (rounded) -> torch.distributed
all_reduce (NCCL on GPU, gloo on CPU, in the activation dtype) -> residual add + RMSNorm (torch,
fp32 inside) -> quant (torch).
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from fusion_bridge.epilogue_tensors import EpilogueInputs, EpilogueOutputs, deliver
from fusion_bridge.spec import Stage
from fusion_bridge.oracle.torch_math import finalize_fp32, residual_norm_outputs
from fusion_bridge.strategies.base import DEFAULT_VARIANT, Step, Strategy, required_stages


class SeparateStrategy(Strategy):
    marks_collective = True
    name = "separate"
    summary = "torch ops and torch.distributed all_reduce, one launch per stage"

    @classmethod
    def not_supported_reasons(cls, spec, env):
        return []

    @classmethod
    def steps(cls, spec, env):
        stages = required_stages(spec, env.world_size)
        steps = [Step("torch.finalize", (Stage.FINALIZE,))]
        if Stage.SHARED_ADD in stages:
            steps.append(Step("torch.shared_add", (Stage.SHARED_ADD,)))
        if Stage.ALL_REDUCE in stages:
            backend = "nccl" if env.device_type == "cuda" else "gloo"
            steps.append(Step(f"torch_distributed.all_reduce_{backend}", (Stage.ALL_REDUCE,)))
        steps.append(Step("torch.residual_rmsnorm", (Stage.RESIDUAL_NORM,)))
        if Stage.QUANT in stages:
            steps.append(Step(f"torch.quant_{spec.quant.kind.value}", (Stage.QUANT,)))
        return steps

    @classmethod
    def roundings(cls, spec, env):
        # finalize output, shared add, each hop of a ring all-reduce (world-1), norm output
        return 1 + int(spec.has_shared_output) + (env.world_size - 1) + 1

    def partial_dtype(self):
        return self.spec.dtype if self.env.world_size > 1 else None

    def run(
        self,
        inputs: EpilogueInputs,
        variant: str = DEFAULT_VARIANT,
        out: Optional[EpilogueOutputs] = None,
    ) -> EpilogueOutputs:
        partial = finalize_fp32(
            inputs.gemm2_out,
            inputs.expanded_idx_to_permuted_idx,
            inputs.expert_weights,
            self.spec.routed_scaling_factor,
        ).to(self.spec.dtype)
        if inputs.shared_output is not None:
            partial = partial + inputs.shared_output
        if self.env.world_size > 1:
            with self.collective():
                dist.all_reduce(partial, group=self.group)
        summed = inputs.residual.float() + partial.float()
        return deliver(out, residual_norm_outputs(summed, inputs.gamma, self.spec))
