"""GLM-4-MoE (the GLM-4.5 and GLM-4.6 models; transformers.models.glm4_moe).

Glm4MoeTopkRouter is DeepSeek-V3's router: sigmoid scores, e_score_correction_bias for the
choice, grouped top-k, normalised when norm_topk_prob, times routed_scaling_factor (fp32).
Glm4MoeMoE adds `shared_experts(x)` unscaled; the first `first_k_dense_replace` layers are dense.
"""

from __future__ import annotations

from fusion_bridge.integrations.hf_families.base import Family, scaling_factor


class Glm4Moe(Family):
    name = "GLM-4-MoE"
    model_types = ("glm4_moe",)
    modeling = "glm4_moe"
    shared_expert_attr = "shared_experts"

    def routing(self, block, x):
        # routed_scaling_factor is in the router's fp32 weights; the bridge applies it instead
        _, glm_weights, ids = block.gate(x)
        return glm_weights / self.routed_scaling(block), ids

    def routed_scaling(self, block):
        return scaling_factor(block.gate)
