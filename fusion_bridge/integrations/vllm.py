"""vLLM's deferred-finalize MoE output into the bridge.

vLLM 0.34.0 (`vllm/model_executor/layers/fused_moe/moe_output.py`) ends a MoE layer that runs
un-reduced with a `MoEOutput(routed, shared_output, routed_scaling_factor)`, whose `routed` is an
`UnfinalizedMoEOutput(gemm2_permuted [P, H], expert_weights [T, K], expanded_idx_to_permuted_idx
[T, K] int32 (-1: expert not on this rank), route_major)` when the kernel stopped after GEMM2. That
is the bridge's input, and one call finishes the layer:

    from fusion_bridge.integrations.vllm import finalize_moe_output

    out = finalize_moe_output(bridge, moe_output, residual, norm=next_layer.input_layernorm)
    hidden, residual = out.norm_out, out.residual_out

What comes from `moe_output`, never from the caller's word:

- the routed scale: `MoEOutput.routed_scaling_factor` is the factor still to apply (1.0 where the
  routing method folded the model's factor into the weights), and the bridge's
  `spec.routed_scaling_factor` must be exactly that; a spec built with the model's factor for
  folded weights would scale twice, and is refused;
- the shared output: vLLM's `shared_output` is this rank's un-reduced partial, summed over the
  ranks with the routed partials;
- the index map's direction: `expanded_idx_to_permuted_idx` is (token, slot) -> row, the bridge's;
  a route-major output's rows are one per route (P = T*K), which is checked.

A `routed` that is already a tensor (finalized: its top-k sum is taken) is refused: there is no
finalize left for the bridge to fuse. The norm: engine_norms.py (`norm=` vLLM's `RMSNorm` or
`GemmaRMSNorm`, or `norm_weight=` / `applied_gamma=`). Duck-typed on vLLM's field names; vLLM is
never imported.
"""

from __future__ import annotations

from typing import Optional

import torch

from fusion_bridge import EpilogueOutputs, FusionBridge
from fusion_bridge.integrations.engine_handoff import ExpandedToPermuted, finalize_handoff
from fusion_bridge.integrations.engine_norms import HandoffError

WHO = "vllm.finalize_moe_output"
MOE_OUTPUT_FIELDS = ("routed", "shared_output", "routed_scaling_factor")
UNFINALIZED_FIELDS = ("gemm2_permuted", "expert_weights", "expanded_idx_to_permuted_idx")


def _missing(obj: object, fields: tuple) -> list:
    return [f for f in fields if not hasattr(obj, f)]


def finalize_moe_output(
    bridge: FusionBridge,
    moe_output: object,
    residual: torch.Tensor,
    *,
    norm: Optional[torch.nn.Module] = None,
    norm_weight: Optional[torch.Tensor] = None,
    applied_gamma: Optional[torch.Tensor] = None,
    out: Optional[EpilogueOutputs] = None,
) -> EpilogueOutputs:
    """Finalize + shared add + all-reduce + residual add + RMSNorm (+ quant) of a vLLM
    `MoEOutput` whose `routed` is an `UnfinalizedMoEOutput`; collective over the bridge's group.

    residual: [T, H] act dtype (T: the MoE's token count). The norm: exactly one of `norm` (vLLM's
    RMSNorm / GemmaRMSNorm module), `norm_weight` ([H], spec.weight_bias added) or
    `applied_gamma` ([H], the multiplier as applied; spec.weight_bias must be 0). Returns the
    bridge's EpilogueOutputs (residual_out, norm_out [T, H]; quant/scale when the spec quantizes;
    unpacks as `norm_out, residual_out`), written into `out` when given (preallocated outputs, as
    FusionBridge.finalize_epilogue takes them: never over the residual).
    Raises HandoffError (an EpilogueInputError) naming what does not fit and the fix."""
    if hasattr(moe_output, "shared_is_replicated"):
        raise HandoffError(
            f"{WHO}: moe_output must be vLLM's MoEOutput, got {type(moe_output).__name__} with "
            "shared_is_replicated (SGLang's); pass it to "
            "fusion_bridge.integrations.sglang.finalize_moe_output"
        )
    missing = _missing(moe_output, MOE_OUTPUT_FIELDS)
    if missing:
        raise HandoffError(
            f"{WHO}: moe_output must be vLLM's MoEOutput (fields {', '.join(MOE_OUTPUT_FIELDS)}), "
            f"got {type(moe_output).__name__} without {', '.join(missing)}"
        )
    routed = moe_output.routed
    if isinstance(routed, torch.Tensor):
        raise HandoffError(
            f"{WHO}: moe_output.routed must be an UnfinalizedMoEOutput (the kernel stopped after "
            f"GEMM2), got a finalized tensor {list(routed.shape)}: its top-k sum is already "
            "taken, so there is no finalize for the bridge to fuse; run vLLM's own all-reduce "
            "and norm for it, or let the MoE defer its finalize"
        )
    missing = _missing(routed, UNFINALIZED_FIELDS)
    if missing:
        raise HandoffError(
            f"{WHO}: moe_output.routed must be an UnfinalizedMoEOutput (fields "
            f"{', '.join(UNFINALIZED_FIELDS)}), got {type(routed).__name__} without "
            f"{', '.join(missing)}"
        )
    index_map = ExpandedToPermuted.from_2d(routed.expanded_idx_to_permuted_idx)
    if getattr(routed, "route_major", False):
        tokens, top_k = index_map.map.shape
        rows = routed.gemm2_permuted
        if isinstance(rows, torch.Tensor) and rows.dim() == 2 and rows.shape[0] != tokens * top_k:
            raise HandoffError(
                f"{WHO}: a route-major UnfinalizedMoEOutput's gemm2_permuted must have one row per "
                f"route, T * top_k = {tokens * top_k}, got {rows.shape[0]} rows"
            )
    return finalize_handoff(
        bridge,
        routed.gemm2_permuted,
        index_map,
        routed.expert_weights,
        moe_output.shared_output,
        residual,
        scale_to_apply=moe_output.routed_scaling_factor,
        shared_replicated=False,
        norm=norm,
        norm_weight=norm_weight,
        applied_gamma=applied_gamma,
        out=out,
        who=WHO,
        scale_source="moe_output.routed_scaling_factor",
    )
