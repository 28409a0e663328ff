"""Test-only helpers."""

from __future__ import annotations

import torch

from fusion_bridge.epilogue_tensors import EpilogueInputs


def clone_inputs(inputs: EpilogueInputs) -> EpilogueInputs:
    return EpilogueInputs(
        *(
            None if t is None else t.clone()
            for t in (
                inputs.gemm2_out,
                inputs.expanded_idx_to_permuted_idx,
                inputs.expert_weights,
                inputs.shared_output,
                inputs.residual,
                inputs.gamma,
            )
        )
    )


def inputs_equal(a: EpilogueInputs, b: EpilogueInputs) -> bool:
    pairs = [
        (a.gemm2_out, b.gemm2_out),
        (a.expanded_idx_to_permuted_idx, b.expanded_idx_to_permuted_idx),
        (a.expert_weights, b.expert_weights),
        (a.shared_output, b.shared_output),
        (a.residual, b.residual),
        (a.gamma, b.gamma),
    ]
    return all(
        (x is None and y is None)
        or (
            x is not None
            and y is not None
            and x.shape == y.shape
            and torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))
        )
        for x, y in pairs
    )


def cpu_strategy_names(world_size: int = 1) -> list[str]:
    """The registered strategies that run in this CPU test setup (our Triton kernels under the
    interpreter included: conftest sets TRITON_INTERPRET=1), found by building a bridge, so a
    renamed strategy is still covered; with world_size > 1, those whose capability checks also pass
    at that world size (a world-size-1 path drops out). Fails unless the three kinds the suite
    relies on are all there: the oracle, the torch path and a path through our kernels."""
    from fusion_bridge import EpilogueSpec, FusionBridge
    from fusion_bridge.registry import strategy_class

    spec = EpilogueSpec(hidden_size=64, top_k=2)
    with FusionBridge(spec) as bridge:
        names = [s.name for s in bridge.statuses if s.available]
        env = bridge.env.replace(world_size=world_size)
    names = [n for n in names if not strategy_class(n).not_supported_reasons(spec, env)]
    assert (
        "reference" in names
        and "separate" in names
        and any(n.startswith("local_fused") for n in names)
    ), names
    return names


def scaled_inputs(inputs: EpilogueInputs, factor: float) -> EpilogueInputs:
    """gemm2_out, shared_output and residual times `factor` (rounded to their dtype): small rows,
    where
    eps is observable. Routing, weights and gamma unchanged."""

    def scale(t):
        return None if t is None else (t.float() * factor).to(t.dtype)

    return inputs._replace(
        gemm2_out=scale(inputs.gemm2_out),
        shared_output=scale(inputs.shared_output),
        residual=scale(inputs.residual),
    )
