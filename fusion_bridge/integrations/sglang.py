"""SGLang's deferred-finalize MoE handoffs into the bridge.

SGLang 0.5.23 hands the next layer's fused norm a `MoeDeferredFinalize(routed_output,
expert_weights, permuted_indices [m, K], gated_shared_output | None, m, finish)`
(`sglang/srt/layers/layer_boundary/fusions/moe_finalize.py`), built by `from_flashinfer` from
FlashInfer's deferred buffers (1-D index and weight buffers, viewed as [-1, top_k][:m], possibly
longer than m*K). A MoE block asked for its pieces returns SGLang's `MoEOutput(routed, shared,
experts, routed_scaling_factor, shared_is_replicated)` (`sglang/srt/models/deepseek_v2.py`), whose
`routed` may be those FlashInfer buffers (`gemm2_out, expert_weights, expanded_idx_to_permuted_idx,
top_k`). One call finishes the layer:

    from fusion_bridge.integrations.sglang import finalize_deferred

    out = finalize_deferred(bridge, handoff, residual, norm=next_layer.input_layernorm)
    hidden, residual = out.norm_out, out.residual_out

SGLang's conventions, which the adapter applies and checks:

- the routed scale: SGLang's deferred finalize applies no factor (`moe_finalize_fuse_shared`
  takes none; the routing kernels fold `routed_scaling_factor` into the weights), so the bridge's
  `spec.routed_scaling_factor` must be 1.0. A spec built with the model's factor would scale twice,
  and is refused. `MoEOutput.routed_scaling_factor` is the model's value, which SGLang applies only
  to a finalized `routed`; it is not read for deferred buffers.
- the shared output: `gated_shared_output` is this rank's gated partial (SGLang defers the finalize
  only for a tensor-parallel shared expert). `MoEOutput.shared` with `shared_is_replicated=True` is
  the whole shared expert's output on every rank, which SGLang adds once, after the sum: the
  bridge adds it exactly once too, when its spec says so (`shared_output_replicated=True`, with
  has_shared_output=True: rank 0 adds it, the others add zeros). A spec that does not say which
  the handoff carries is refused (a replicated output summed W times, or a partial added once).
- the norm: SGLang's fused consumers take `fused_norm_gamma(norm)`, the multiplier as applied
  (`1 + w` for `GemmaRMSNorm`). Pass the module (`norm=`: its stored weight and the class's
  offset are used), or that multiplier as `applied_gamma=` (the spec's weight_bias must then be 0;
  with weight_bias=1 it is refused, since the offset would be added twice).

A `routed` that is a tensor (finalized) is refused. The index buffers: engine_handoff.py. Duck-typed
on SGLang's field names; SGLang is never imported.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch

from fusion_bridge import EpilogueOutputs, FusionBridge
from fusion_bridge.integrations.engine_handoff import (
    ExpandedToPermuted,
    finalize_handoff,
    token_rows,
)
from fusion_bridge.integrations.engine_norms import HandoffError

DEFERRED_FIELDS = (
    "routed_output",
    "expert_weights",
    "permuted_indices",
    "gated_shared_output",
    "m",
)
FLASHINFER_FIELDS = ("gemm2_out", "expert_weights", "expanded_idx_to_permuted_idx", "top_k")
MOE_OUTPUT_FIELDS = ("routed", "shared", "routed_scaling_factor", "shared_is_replicated")
# SGLang's deferred finalize applies no routed scale: the weights carry it
DEFERRED_SCALE = 1.0


def _check_fields(who: str, name: str, obj: object, kind: str, fields: tuple) -> None:
    missing = [f for f in fields if not hasattr(obj, f)]
    if missing:
        raise HandoffError(
            f"{who}: {name} must be {kind} (fields {', '.join(fields)}), got "
            f"{type(obj).__name__} without {', '.join(missing)}"
        )


def _index_map(who: str, indices: torch.Tensor, tokens: int, top_k: int) -> ExpandedToPermuted:
    """SGLang's `permuted_indices` / FlashInfer's `expanded_idx_to_permuted_idx`: (token, slot) ->
    row, 2-D [>= m, K] or FlashInfer's 1-D buffer."""
    if isinstance(indices, torch.Tensor) and indices.dim() == 1:
        return ExpandedToPermuted.from_flat(indices, tokens, top_k)
    return ExpandedToPermuted.from_2d(indices, tokens)


def finalize_deferred(
    bridge: FusionBridge,
    handoff: object,
    residual: torch.Tensor,
    *,
    norm: Optional[torch.nn.Module] = None,
    norm_weight: Optional[torch.Tensor] = None,
    applied_gamma: Optional[torch.Tensor] = None,
    out: Optional[EpilogueOutputs] = None,
) -> EpilogueOutputs:
    """Finalize + shared add + all-reduce + residual add + RMSNorm (+ quant) of SGLang's
    `MoeDeferredFinalize`; collective over the bridge's group.

    handoff: routed_output [P, H] (or rows packed at H), expert_weights and permuted_indices
    [>= m, K] (or 1-D of >= m*K), gated_shared_output [m, H] or None, m. residual: [m, H] act
    dtype. The norm: exactly one of `norm` (SGLang's RMSNorm / GemmaRMSNorm), `norm_weight` or
    `applied_gamma` (SGLang's fused_norm_gamma(); spec.weight_bias must be 0). out: preallocated
    outputs (FusionBridge.finalize_epilogue's `out`: SGLang allocates residual_out apart from the
    residual, and so must a caller here). Returns the bridge's EpilogueOutputs (`out` when given;
    unpacks as `norm_out, residual_out`). Raises HandoffError naming what does not fit and the
    fix."""
    who = "sglang.finalize_deferred"
    _check_fields(who, "handoff", handoff, "SGLang's MoeDeferredFinalize", DEFERRED_FIELDS)
    m, top_k = handoff.m, bridge.spec.top_k
    if not isinstance(m, numbers.Integral) or isinstance(m, bool) or m < 0:
        raise HandoffError(f"{who}: handoff.m must be an int >= 0, got {m!r}")
    return finalize_handoff(
        bridge,
        handoff.routed_output,
        _index_map(who, handoff.permuted_indices, int(m), top_k),
        token_rows(who, "handoff.expert_weights", handoff.expert_weights, int(m), top_k),
        handoff.gated_shared_output,
        residual,
        scale_to_apply=DEFERRED_SCALE,
        shared_replicated=False,
        norm=norm,
        norm_weight=norm_weight,
        applied_gamma=applied_gamma,
        out=out,
        who=who,
        scale_source="SGLang's deferred finalize applies none",
    )


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
    """The same for SGLang's `MoEOutput` whose `routed` is FlashInfer's deferred buffers (or a
    MoeDeferredFinalize); a replicated `shared` is added once (module docstring). T is the
    residual's row count ([T, H] act dtype), the buffers' first T tokens are read. Returns the
    bridge's EpilogueOutputs; raises HandoffError."""
    who = "sglang.finalize_moe_output"
    _check_fields(who, "moe_output", moe_output, "SGLang's MoEOutput", MOE_OUTPUT_FIELDS)
    routed, replicated = moe_output.routed, moe_output.shared_is_replicated
    if isinstance(routed, torch.Tensor):
        raise HandoffError(
            f"{who}: moe_output.routed must be deferred (FlashInfer's deferred buffers or a "
            f"MoeDeferredFinalize), got a finalized tensor {list(routed.shape)}: its top-k sum "
            "is already taken, so there is no finalize for the bridge to fuse"
        )
    if not isinstance(replicated, bool):
        raise HandoffError(
            f"{who}: moe_output.shared_is_replicated must be a bool, got {replicated!r}"
        )
    if replicated and moe_output.shared is not None and not bridge.spec.has_shared_output:
        raise HandoffError(
            f"{who}: the bridge's spec.has_shared_output must be True for a replicated shared "
            "output (it is added once, in rank 0's partial), got False; build the bridge's "
            "EpilogueSpec with has_shared_output=True"
        )
    if hasattr(routed, "routed_output"):  # a MoeDeferredFinalize: its gated shared is its own
        raise HandoffError(
            f"{who}: a MoEOutput whose routed is a MoeDeferredFinalize carries two shared "
            "outputs (the handoff's gated_shared_output and MoEOutput.shared); pass the handoff "
            "to sglang.finalize_deferred"
        )
    _check_fields(
        who, "moe_output.routed", routed, "FlashInfer's deferred buffers", FLASHINFER_FIELDS
    )
    top_k = bridge.spec.top_k
    if int(routed.top_k) != top_k:
        raise HandoffError(
            f"{who}: moe_output.routed.top_k must be the spec's top_k ({top_k}), got "
            f"{routed.top_k!r}"
        )
    if not (isinstance(residual, torch.Tensor) and residual.dim() == 2):
        raise HandoffError(f"{who}: residual must be a 2-D tensor [T, H], got {residual!r}")
    tokens = residual.shape[0]
    return finalize_handoff(
        bridge,
        routed.gemm2_out,
        _index_map(who, routed.expanded_idx_to_permuted_idx, tokens, top_k),
        token_rows(who, "moe_output.routed.expert_weights", routed.expert_weights, tokens, top_k),
        moe_output.shared,
        residual,
        scale_to_apply=DEFERRED_SCALE,
        shared_replicated=replicated,
        norm=norm,
        norm_weight=norm_weight,
        applied_gamma=applied_gamma,
        out=out,
        who=who,
        scale_source="SGLang's deferred finalize applies none",
    )
