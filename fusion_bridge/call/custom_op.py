"""`finalize_epilogue` as one opaque custom op for torch.compile.

Under torch.compile the whole epilogue appears as one node, `fusion_bridge::finalize_epilogue`,
whose implementation finds its bridge by name (as serving engines do for their fused communication
ops) and runs the eager path; its fake implementation allocates the outputs from the bridge's spec,
so tracing needs no data and no collective. Eager calls never go through the dispatcher (its
per-call cost would be added to every eager call; docs/performance.md has the figure).

The op always returns four tensors (quant and scale are empty when the spec has none), so its output
types are fixed; `FusionBridge.finalize_epilogue` turns them back into EpilogueOutputs.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch

from fusion_bridge.epilogue_tensors import EpilogueOutputs, allocate_outputs

_BRIDGES: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()
_NAMES = itertools.count()


def register_bridge(bridge) -> str:
    """A process-unique name under which the op finds `bridge` (held weakly)."""
    name = f"bridge{next(_NAMES)}"
    _BRIDGES[name] = bridge
    return name


def _bridge(name: str):
    bridge = _BRIDGES.get(name)
    if bridge is None:
        raise RuntimeError(
            f"fusion_bridge::finalize_epilogue: no live FusionBridge named {name!r} (closed or "
            "garbage-collected while a compiled graph still calls it)"
        )
    return bridge


@torch.library.custom_op("fusion_bridge::finalize_epilogue", mutates_args=())
def finalize_epilogue_op(
    gemm2_out: torch.Tensor,
    expanded_idx_to_permuted_idx: torch.Tensor,
    expert_weights: torch.Tensor,
    shared_output: Optional[torch.Tensor],
    residual: torch.Tensor,
    gamma: torch.Tensor,
    bridge: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out = _bridge(bridge).finalize_epilogue(
        gemm2_out, expanded_idx_to_permuted_idx, expert_weights, shared_output, residual, gamma
    )
    empty = residual.new_empty(0, dtype=torch.uint8)
    return (
        out.residual_out,
        out.norm_out,
        out.quant if out.quant is not None else empty,
        out.scale if out.scale is not None else empty.clone(),
    )


@finalize_epilogue_op.register_fake
def _(
    gemm2_out, expanded_idx_to_permuted_idx, expert_weights, shared_output, residual, gamma, bridge
):
    out = allocate_outputs(_bridge(bridge).spec, residual.shape[0], residual.device)
    empty = residual.new_empty(0, dtype=torch.uint8)
    return (
        out.residual_out,
        out.norm_out,
        out.quant if out.quant is not None else empty,
        out.scale if out.scale is not None else empty.clone(),
    )


def outputs_from_op(spec, result) -> EpilogueOutputs:
    return EpilogueOutputs.for_quant(spec.quant.kind, *result)
