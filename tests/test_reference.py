"""The oracle against a case small enough to compute by hand."""

import math

import torch

from fusion_bridge import EpilogueInputs, EpilogueSpec
from fusion_bridge.strategies.reference import reference_epilogue


def test_reference_matches_hand_computed_case():
    # H=4, K=2, T=2; token 1's second slot is -1 and points nowhere; row 3 is padding (NaN).
    spec = EpilogueSpec(hidden_size=4, top_k=2, dtype=torch.float16, eps=1e-6, weight_bias=1.0,
                        routed_scaling_factor=2.0, has_shared_output=True)
    gemm2_out = torch.tensor([[1.0, 2.0, 3.0, 4.0],
                              [0.5, 0.5, 0.5, 0.5],
                              [-1.0, 0.0, 1.0, 2.0],
                              [float("nan")] * 4], dtype=torch.float16)
    perm = torch.tensor([[0, 2], [1, -1]], dtype=torch.int32)
    weights = torch.tensor([[0.5, 0.25], [1.0, 0.75]], dtype=torch.float32)
    shared = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]], dtype=torch.float16)
    residual = torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float16)
    gamma = torch.tensor([0.0, 1.0, 0.5, -0.5], dtype=torch.float16)   # scale = gamma + 1
    out = reference_epilogue(spec, EpilogueInputs(gemm2_out, perm, weights, shared, residual, gamma))

    # token 0: routed = 2 * (0.5*[1,2,3,4] + 0.25*[-1,0,1,2]) = 2 * [0.25, 1, 1.75, 2.5] = [0.5, 2, 3.5, 5]
    #          + shared [1,0,0,0] + residual [0,1,0,0] -> [1.5, 3, 3.5, 5]
    # token 1: routed = 2 * (1.0*[0.5]*4) = [1,1,1,1]; + shared [0,0,0,1] + residual [1]*4 -> [2, 2, 2, 3]
    expected_residual = [[1.5, 3.0, 3.5, 5.0], [2.0, 2.0, 2.0, 3.0]]
    assert out.residual_out.tolist() == expected_residual
    scale = [1.0, 2.0, 1.5, 0.5]
    for row, values in enumerate(expected_residual):
        inv_rms = 1.0 / math.sqrt(sum(v * v for v in values) / 4 + 1e-6)
        expected = [v * inv_rms * s for v, s in zip(values, scale)]
        assert torch.allclose(out.norm_out[row].float(), torch.tensor(expected), rtol=2 ** -10, atol=0)
    assert out.quant is None and out.scale is None
