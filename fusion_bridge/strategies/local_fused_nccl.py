"""`local_fused_nccl`: our Triton finalize+shared-add kernel, then torch.distributed all_reduce
(NCCL on GPU, gloo on CPU), then our residual add + RMSNorm (+ FP8 / NVFP4) kernel.

Three launches, any T (no workspace), any world size: it is the route for T above the FlashInfer
workspace. With world size 1 there is no all-reduce. On CPU it runs under TRITON_INTERPRET=1 only
(tests, `parity`); auto never picks it there.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from fusion_bridge.epilogue_tensors import EpilogueInputs, EpilogueOutputs, deliver
from fusion_bridge.reasons import collect, require_sm_at_least, require_triton
from fusion_bridge.spec import QuantKind, Stage
from fusion_bridge.strategies.base import (
    DEFAULT_VARIANT,
    Step,
    Strategy,
    kernel_quant_args,
    required_stages,
)
from fusion_bridge.strategies.local_common import (
    finalize_partial,
    finalize_step,
    hidden_fits,
    needs_device,
)


class LocalFusedNcclStrategy(Strategy):
    marks_collective = True
    name = "local_fused_nccl"
    summary = (
        "our Triton finalize+shared-add kernel, NCCL all-reduce, our add+RMSNorm(+quant) kernel"
    )
    self_tested = True

    @classmethod
    def not_supported_reasons(cls, spec, env):
        return collect(
            require_triton(env, cls.name),
            needs_device(env, cls.name),
            require_sm_at_least(env, cls.name, 80, why=" (Triton 3 targets SM80+)"),
            hidden_fits(spec, cls.name),
        )

    @classmethod
    def is_auto_selectable(cls, spec, env):
        return env.device_type == "cuda"

    @classmethod
    def steps(cls, spec, env):
        stages = required_stages(spec, env.world_size)
        steps = [finalize_step(spec, env)]
        if Stage.ALL_REDUCE in stages:
            backend = "nccl" if env.device_type == "cuda" else "gloo"
            steps.append(Step(f"torch_distributed.all_reduce_{backend}", (Stage.ALL_REDUCE,)))
        norm = "local.add_rmsnorm" + (
            "" if spec.quant.kind is QuantKind.NONE else f"_{spec.quant.kind.value}"
        )
        steps.append(
            Step(norm, tuple(s for s in stages if s in (Stage.RESIDUAL_NORM, Stage.QUANT)))
        )
        return steps

    @classmethod
    def roundings(cls, spec, env):
        return (
            1 + (env.world_size - 1) + 1
        )  # finalize_add output, ring all-reduce hops, norm output

    def prepare(self) -> None:
        from fusion_bridge.kernels import ops  # registers the custom ops; Triton compiles lazily

        self._ops = ops.direct_when_eager
        self._quant = kernel_quant_args(self.spec)
        self._kind = self.spec.quant.kind

    def partial_dtype(self):
        return self.spec.dtype if self.env.world_size > 1 else None

    def run(
        self,
        inputs: EpilogueInputs,
        variant: str = DEFAULT_VARIANT,
        out: Optional[EpilogueOutputs] = None,
    ) -> EpilogueOutputs:
        spec = self.spec
        partial = finalize_partial(self._ops, spec, inputs)
        if self.env.world_size > 1:
            with self.collective():
                dist.all_reduce(partial, group=self.group)
        residual_out, norm_out, q, sf = self._ops.add_rmsnorm_quant(
            inputs.residual, partial, inputs.gamma, spec.eps, spec.weight_bias, *self._quant
        )
        return deliver(out, EpilogueOutputs.for_quant(self._kind, residual_out, norm_out, q, sf))
