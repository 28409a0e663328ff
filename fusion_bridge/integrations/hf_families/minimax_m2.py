"""MiniMax-M2 (transformers.models.minimax_m2).

MiniMaxM2TopKRouter takes the block's `e_score_correction_bias` as an argument: sigmoid scores
over fp32 logits, the bias added for the choice only, top-k, the chosen sigmoid scores always
renormalised; fp32 weights. No shared expert, no routed scaling; every layer is MoE.
"""

from __future__ import annotations

from fusion_bridge.integrations.hf_families.base import Family


class MiniMaxM2(Family):
    name = "MiniMax-M2"
    model_types = ("minimax_m2",)
    modeling = "minimax_m2"

    def routing(self, block, x):
        # the block owns the correction bias and hands it to its router, as its forward does
        _, weights, ids = block.gate(x, block.e_score_correction_bias)
        return weights, ids
