"""`flashinfer_fused_fp4`: the same FlashInfer MoE-finalize kernel, letting it quantize
to NVFP4 itself.

Rejected for flashinfer <= 0.7.2.post1 on every SM (the binding never sets the global scale; on H200
it wrote all-zero FP4 without an error) and below SM100 (no FP4 conversion compiled). A newer
FlashInfer that passes the static checks is adopted only if it also passes the self-test
against the oracle.
"""

from __future__ import annotations

from fusion_bridge.reasons import Reason, collect
from fusion_bridge.spec import QuantKind, SFLayout
from fusion_bridge.strategies import flashinfer_common as fic
from fusion_bridge.strategies.base import Step, required_stages
from fusion_bridge.strategies.flashinfer_fused import FlashInferFusedStrategy


class FlashInferFusedFp4Strategy(FlashInferFusedStrategy):
    name = "flashinfer_fused_fp4"
    fused_fp4 = True  # FlashInfer gets the quant buffers and writes NVFP4 itself
    summary = (
        "FlashInfer trtllm_moe_finalize_allreduce_fusion with its own fused NVFP4 quantization"
    )

    @classmethod
    def not_supported_reasons(cls, spec, env):
        if spec.quant.kind is not QuantKind.NVFP4:
            # it does not apply to this spec at all: the one reason that matters, not every other
            # check too
            return [
                Reason(
                    "quant_not_nvfp4",
                    f"{cls.name} only applies to quant=nvfp4, the spec has "
                    f"quant={spec.quant.kind.value}",
                    "flashinfer_fused covers the other quant modes",
                )
            ]
        swizzled_only = (
            None
            if spec.quant.sf_layout is SFLayout.SWIZZLED_128x4
            else Reason(
                "sf_layout_fixed",
                f"{cls.name}: FlashInfer fixes the scale layout to swizzled_128x4, the spec asks "
                f"for {spec.quant.sf_layout.value}",
                "use flashinfer_fused, which quantizes with our kernel",
            )
        )
        return collect(
            super().not_supported_reasons(spec, env),
            swizzled_only,
            fic.fp4_fusion_reasons(spec, env, cls.name),
        )

    @classmethod
    def steps(cls, spec, env):
        return [
            Step(
                "flashinfer.moe_finalize_ar_residual_rmsnorm_fp4",
                required_stages(spec, env.world_size),
            )
        ]
