"""Mixtral (transformers.models.mixtral).

MixtralTopKRouter: softmax over the logits in fp32, top-k, always renormalised; fp32 weights. No
shared expert, no routed scaling; every layer is MoE. Router jitter noise applies in training
only, which the patch refuses.
"""

from __future__ import annotations

from fusion_bridge.integrations.hf_families.base import Family


class Mixtral(Family):
    name = "Mixtral"
    model_types = ("mixtral",)
    modeling = "mixtral"

    def routing(self, block, x):
        _, mixtral_weights, ids = block.gate(x)  # renormalised fp32 weights
        return mixtral_weights, ids
