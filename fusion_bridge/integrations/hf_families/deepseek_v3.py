"""DeepSeek-V3, and the Kimi models built on it (transformers.models.deepseek_v3).

DeepseekV3TopkRouter: sigmoid scores over fp32 logits, the e_score_correction_bias added for the
choice only, top-2 sum per group, the best `topk_group` of `n_group` groups kept, top-k inside
them, the chosen sigmoid scores normalised when norm_topk_prob, then multiplied by
routed_scaling_factor; fp32 weights. DeepseekV3MoE adds `shared_experts(x)` (an MLP of
n_shared_experts * moe_intermediate_size) unscaled. The first `first_k_dense_replace` layers are
dense.

Kimi-K2 is published as this architecture with `model_type: "kimi_k2"` in its config.json, so a
DeepseekV3ForCausalLM built from it (and, at transformers 5.17, the language model inside Kimi-K2.5)
says 'kimi_k2'. Kimi-K2.5 (`kimi_k25`) is a vision-language wrapper whose language model
(`model.model.language_model`) is a DeepseekV3Model.
"""

from __future__ import annotations

from fusion_bridge.integrations.hf_families.base import Family, scaling_factor


class DeepseekV3(Family):
    name = "DeepSeek-V3"
    model_types = ("deepseek_v3", "kimi_k2")
    wrappers = ("kimi_k25",)
    modeling = "deepseek_v3"
    shared_expert_attr = "shared_experts"

    def routing(self, block, x):
        # The router multiplies its fp32 weights by routed_scaling_factor; the bridge applies the
        # factor itself (in fp32, after the top-k sum), so it is divided out here in fp32: w*s/s
        # is w within one fp32 rounding (2^-24 relative), far below the bf16 roundings that count.
        _, weights, ids = block.gate(x)
        return weights / self.routed_scaling(block), ids

    def routed_scaling(self, block):
        return scaling_factor(block.gate)
