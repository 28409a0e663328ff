"""Test-only helpers."""

from __future__ import annotations

import torch

from fusion_bridge.io import EpilogueInputs


def clone_inputs(inputs: EpilogueInputs) -> EpilogueInputs:
    return EpilogueInputs(*(None if t is None else t.clone() for t in (
        inputs.gemm2_out, inputs.expanded_idx_to_permuted_idx, inputs.expert_weights,
        inputs.shared_output, inputs.residual, inputs.gamma)))


def inputs_equal(a: EpilogueInputs, b: EpilogueInputs) -> bool:
    pairs = [(a.gemm2_out, b.gemm2_out), (a.expanded_idx_to_permuted_idx, b.expanded_idx_to_permuted_idx),
             (a.expert_weights, b.expert_weights), (a.shared_output, b.shared_output),
             (a.residual, b.residual), (a.gamma, b.gamma)]
    return all((x is None and y is None) or (x is not None and y is not None and x.shape == y.shape
                                             and torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)))
               for x, y in pairs)
