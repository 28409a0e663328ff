"""Qwen3.5-MoE (transformers.models.qwen3_5_moe).

Qwen3_5MoeTopKRouter: softmax over the logits in fp32, top-k, always renormalised, cast back to
the activation dtype. Qwen3_5MoeSparseMoeBlock adds `sigmoid(shared_expert_gate(x)) *
shared_expert(x)`; every decoder layer is MoE, its token mixer either full attention or a gated
DeltaNet (linear attention), which the patch never touches. Qwen3_5MoeRMSNorm is zero-centred: it
multiplies by (1 + weight) in fp32 and rounds once. `qwen3_5_moe` checkpoints are the
vision-language wrapper (its language model at `model.model.language_model`, model type
`qwen3_5_moe_text`); Qwen3_5MoeForCausalLM is the language model alone.
"""

from __future__ import annotations

import torch

from fusion_bridge.integrations.hf_families.base import Family


class Qwen3_5Moe(Family):
    name = "Qwen3.5-MoE"
    model_types = ("qwen3_5_moe_text",)
    wrappers = ("qwen3_5_moe",)
    modeling = "qwen3_5_moe"
    shared_expert_attr = "shared_expert"
    weight_bias = 1.0

    def routing(self, block, x):
        _, weights, ids = block.gate(x)  # renormalised bf16/fp16 weights, applied as they are
        return weights, ids

    def shared_output(self, block, x, partial):
        # a per-token scalar gate: gating each rank's partial sums to the gated whole
        gate = torch.sigmoid(block.shared_expert_gate(x))
        return gate * partial
