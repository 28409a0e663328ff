"""`flashinfer_fused`: FlashInfer's trtllm_moe_finalize_allreduce_fusion (finalize + shared + AR +
residual + RMSNorm in one kernel). Not implemented yet: listed so the report shows it."""

from __future__ import annotations

from ..reasons import not_implemented
from ..spec import Stage
from .base import Step, Strategy, required_stages


class FlashInferFusedStrategy(Strategy):
    name = "flashinfer_fused"
    summary = "FlashInfer trtllm_moe_finalize_allreduce_fusion: finalize+shared+AR+residual+RMSNorm in one kernel"
    self_tested = True

    @classmethod
    def not_supported_reasons(cls, spec, env):
        return [not_implemented(cls.name)]

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
        return 2 * spec.top_k + 2
