"""DeepSeek-V2 (transformers.models.deepseek_v2).

DeepseekV2TopkRouter: softmax over fp32 logits, then top-k ('greedy') or top-k inside the best
`topk_group` groups by their max score ('group_limited_greedy'), never renormalised, then
multiplied by routed_scaling_factor; fp32 weights. DeepseekV2Moe adds `shared_experts(x)`
unscaled; the first `first_k_dense_replace` layers are dense.
"""

from __future__ import annotations

from fusion_bridge.integrations.hf_families.base import Family, scaling_factor


class DeepseekV2(Family):
    name = "DeepSeek-V2"
    model_types = ("deepseek_v2",)
    modeling = "deepseek_v2"
    shared_expert_attr = "shared_experts"

    def routing(self, block, x):
        # the router's weights carry routed_scaling_factor; divided out in fp32 (within one fp32
        # rounding of the router's own), the bridge applies it after the top-k sum
        _, scaled, ids = block.gate(x)
        return scaled / self.routed_scaling(block), ids

    def routed_scaling(self, block):
        return scaling_factor(block.gate)
