"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B; transformers.models.qwen2_moe).

Qwen2MoeTopKRouter: softmax over the logits in fp32, top-k, renormalised when norm_topk_prob,
cast back to the activation dtype. Qwen2MoeSparseMoeBlock adds a shared expert scaled per token by
a sigmoid gate: `sigmoid(shared_expert_gate(x)) * shared_expert(x)`. Layers in `mlp_only_layers`
or off the `decoder_sparse_step` grid are dense.
"""

from __future__ import annotations

import torch

from fusion_bridge.integrations.hf_families.base import Family


class Qwen2Moe(Family):
    name = "Qwen2-MoE"
    model_types = ("qwen2_moe",)
    modeling = "qwen2_moe"
    shared_expert_attr = "shared_expert"

    def routing(self, block, x):
        _, weights, ids = block.gate(x)  # bf16/fp16 weights, applied as they are
        return weights, ids

    def shared_output(self, block, x, partial):
        # the gate is a per-token scalar, so gating each rank's partial sums to the gated whole;
        # the same ops in the same dtype as the block's own forward
        return torch.sigmoid(block.shared_expert_gate(x)) * partial
