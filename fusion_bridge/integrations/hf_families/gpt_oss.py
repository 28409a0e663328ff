"""gpt-oss (transformers.models.gpt_oss).

GptOssTopKRouter (`mlp.router`, with a bias): top-k of the logits, then a softmax over those k in
the activation dtype. GptOssExperts store transposed weights (gate_up_proj [E, H, 2I], down_proj
[E, I, H]) with biases, gate and up interleaved, and their own `_apply_gate` (clamped gate and up,
gate * sigmoid(alpha * gate) * (up + 1)); the adapter's expert path reads those flags and calls
that method. No shared expert, no routed scaling; every layer is MoE. GptOssMLP returns
(output, router_scores) and the decoder layer unpacks the pair.
"""

from __future__ import annotations

from fusion_bridge.integrations.hf_families.base import Family


class GptOss(Family):
    name = "gpt-oss"
    model_types = ("gpt_oss",)
    modeling = "gpt_oss"
    router_attr = "router"

    def routing(self, block, x):
        _, scores, ids = block.router(x)  # softmax over the top-k logits, bf16/fp16
        return scores, ids

    def block_output(self, handoff):
        # the layer runs `hidden_states, _ = self.mlp(hidden_states)`; nobody reads the scores
        return handoff, None
