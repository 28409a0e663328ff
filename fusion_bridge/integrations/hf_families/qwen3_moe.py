"""Qwen3-MoE (transformers.models.qwen3_moe).

Qwen3MoeTopKRouter: softmax over the logits in fp32, top-k, renormalised when norm_topk_prob,
cast back to the activation dtype. No shared expert, no routed scaling. Layers in
`mlp_only_layers` or off the `decoder_sparse_step` grid are dense.
"""

from __future__ import annotations

from fusion_bridge.integrations.hf_families.base import Family


class Qwen3Moe(Family):
    name = "Qwen3-MoE"
    model_types = ("qwen3_moe",)
    modeling = "qwen3_moe"

    def routing(self, block, x):
        _, qwen3_weights, ids = block.gate(x)  # bf16/fp16 weights, applied as they are
        return qwen3_weights, ids
