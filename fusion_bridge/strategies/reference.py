"""`reference`: the fp32 oracle. Always available, never auto-selected; every strategy is
judged by it."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from fusion_bridge.epilogue_tensors import EpilogueInputs, EpilogueOutputs, deliver
from fusion_bridge.spec import Stage
from fusion_bridge.oracle.torch_math import finalize_fp32, residual_norm_outputs
from fusion_bridge.strategies.base import DEFAULT_VARIANT, Step, Strategy, required_stages


class ReferenceStrategy(Strategy):
    marks_collective = True
    name = "reference"
    summary = "pure torch, fp32 throughout, one rounding per output (the oracle)"
    auto_selectable = False

    @classmethod
    def not_supported_reasons(cls, spec, env):
        return []

    @classmethod
    def steps(cls, spec, env):
        stages = required_stages(spec, env.world_size)
        upto_reduce = tuple(s for s in stages if s in (Stage.FINALIZE, Stage.SHARED_ADD))
        steps = [Step("torch.finalize_shared_fp32", upto_reduce)]
        if Stage.ALL_REDUCE in stages:
            steps.append(Step("torch_distributed.all_reduce_fp32", (Stage.ALL_REDUCE,)))
        steps.append(Step("torch.residual_rmsnorm_fp32", (Stage.RESIDUAL_NORM,)))
        if Stage.QUANT in stages:
            steps.append(Step(f"torch.quant_{spec.quant.kind.value}", (Stage.QUANT,)))
        return steps

    @classmethod
    def roundings(cls, spec, env):
        return 1  # each output is rounded once; fp32 sums in another order differ by ~1e-7

    @classmethod
    def error_bound(cls, spec, env):
        return (
            1e-5  # fp32 reassociation only (the all-reduce order), far below one bf16/fp16 rounding
        )

    def partial_dtype(self):
        return torch.float32 if self.env.world_size > 1 else None

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
        )
        if inputs.shared_output is not None:
            partial = partial + inputs.shared_output.float()
        if self.env.world_size > 1:
            with self.collective():
                dist.all_reduce(partial, group=self.group)
        summed = inputs.residual.float() + partial
        return deliver(out, residual_norm_outputs(summed, inputs.gamma, self.spec))


def reference_epilogue(
    spec, inputs: EpilogueInputs, group=None, world_size: int = 1
) -> EpilogueOutputs:
    """The oracle as a function, for tests and the self-test."""
    from fusion_bridge.environment import Environment

    strategy = ReferenceStrategy(
        spec,
        Environment(world_size=world_size),
        group,
        inputs.residual.device if isinstance(inputs.residual, torch.Tensor) else None,
    )
    return strategy.run(inputs)
