"""What every supported transformers MoE family tells the adapter, and the error for a model it
cannot patch.

A family is read from transformers' own modeling file of that family (the module named by
`Family.modeling`), not re-derived: the patch calls the block's own router module, its experts' own
`_apply_gate` and its shared expert's own weights, so routing and activation stay theirs bit for
bit. What a family states here is only what their code does *after* those modules and what the
bridge must do in its place: whether the router's weights already carry a routed scaling factor
(divided out here, applied by the bridge), where the shared expert is and whether a sigmoid gate
scales it, how the block hands its output to the decoder layer, and the RMSNorm's weight offset.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

BRIDGE_DTYPES = (torch.bfloat16, torch.float16)


class UnsupportedModelError(ValueError):
    """The model (or one of its layers) is not one the adapter knows how to patch."""


class Family:
    """One model family.

    name: how errors and reports name it. model_types: the `config.model_type` values of the
    language model it covers (an alias such as 'kimi_k2' included). wrappers: model types of
    multimodal models whose language model (`.model.language_model`) is this family; the patch
    moves that language model's MoE layers and leaves the vision tower alone. modeling: the
    transformers.models subpackage the MoE blocks' classes must come from (remote code is refused).
    router_attr: the block's router module (it returns router_logits, top-k weights, top-k ids).
    shared_expert_attr: the block's shared expert MLP, or None. weight_bias: the RMSNorm multiplies
    by (weight + weight_bias).
    """

    name = ""
    model_types: tuple[str, ...] = ()
    wrappers: tuple[str, ...] = ()
    modeling = ""
    router_attr = "gate"
    shared_expert_attr: Optional[str] = None
    weight_bias = 0.0

    def router(self, block: torch.nn.Module) -> torch.nn.Module:
        return getattr(block, self.router_attr)

    def top_k(self, block: torch.nn.Module) -> int:
        return int(self.router(block).top_k)

    def routing(self, block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's own router on x [T, H] -> (expert weights [T, K] as the bridge multiplies
        them before routed scaling, expert ids [T, K] int64). Every family writes its own: what
        the router returns differs (scaled or not, extra arguments)."""
        raise NotImplementedError

    def routed_scaling(self, block: torch.nn.Module) -> float:
        """The factor the bridge multiplies the weighted sum by (1.0: none)."""
        return 1.0

    def shared_output(
        self, block: torch.nn.Module, x: torch.Tensor, partial: torch.Tensor
    ) -> torch.Tensor:
        """This rank's share of the block's shared output, from its share of the shared expert's
        output (`partial`, [T, H]). An ungated shared expert is added as it is."""
        return partial

    def block_output(self, handoff: torch.Tensor):
        """What the patched block returns to its decoder layer in place of its output (families
        whose block returns a tuple wrap it as their layer unpacks it)."""
        return handoff


def scaling_factor(router: torch.nn.Module) -> float:
    """router.routed_scaling_factor as a float, refused where dividing it out would not be exact
    (zero, inf, nan)."""
    factor = float(router.routed_scaling_factor)
    if not math.isfinite(factor) or factor == 0:
        raise UnsupportedModelError(
            "patch_moe_epilogues: gate.routed_scaling_factor must be a nonzero finite number "
            "(the bridge applies it after dividing it out of the router's weights), got "
            f"{factor}"
        )
    return factor
