"""The production oracle (`reference`) against cases computed by hand and against the independent
float64 oracle of tests/oracle64.py."""

import math

import pytest
import torch

from fusion_bridge import EpilogueSpec
from fusion_bridge.epilogue_tensors import EpilogueInputs
from fusion_bridge.strategies.reference import reference_epilogue
from fusion_bridge.oracle.synthetic import make_inputs
from tests import oracle64
from tests.helpers import scaled_inputs


def test_reference_matches_hand_computed_case():
    # H=4, K=2, T=2; token 1's second slot is -1 and points nowhere; row 3 is padding (NaN).
    spec = EpilogueSpec(
        hidden_size=4,
        top_k=2,
        dtype=torch.float16,
        eps=1e-6,
        weight_bias=1.0,
        routed_scaling_factor=2.0,
        has_shared_output=True,
    )
    gemm2_out = torch.tensor(
        [[1.0, 2.0, 3.0, 4.0], [0.5, 0.5, 0.5, 0.5], [-1.0, 0.0, 1.0, 2.0], [float("nan")] * 4],
        dtype=torch.float16,
    )
    perm = torch.tensor([[0, 2], [1, -1]], dtype=torch.int32)
    weights = torch.tensor([[0.5, 0.25], [1.0, 0.75]], dtype=torch.float32)
    shared = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]], dtype=torch.float16)
    residual = torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float16)
    gamma = torch.tensor([0.0, 1.0, 0.5, -0.5], dtype=torch.float16)  # scale = gamma + 1
    out = reference_epilogue(
        spec, EpilogueInputs(gemm2_out, perm, weights, shared, residual, gamma)
    )

    # token 0: routed = 2 * (0.5*[1,2,3,4] + 0.25*[-1,0,1,2]) = 2 * [0.25, 1, 1.75, 2.5] = [0.5, 2,
    # 3.5, 5]
    #          + shared [1,0,0,0] + residual [0,1,0,0] -> [1.5, 3, 3.5, 5]
    # token 1: routed = 2 * (1.0*[0.5]*4) = [1,1,1,1]; + shared [0,0,0,1] + residual [1]*4 -> [2, 2,
    # 2, 3]
    expected_residual = [[1.5, 3.0, 3.5, 5.0], [2.0, 2.0, 2.0, 3.0]]
    assert out.residual_out.tolist() == expected_residual
    scale = [1.0, 2.0, 1.5, 0.5]
    for row, values in enumerate(expected_residual):
        inv_rms = 1.0 / math.sqrt(sum(v * v for v in values) / 4 + 1e-6)
        expected = [v * inv_rms * s for v, s in zip(values, scale)]
        assert torch.allclose(
            out.norm_out[row].float(), torch.tensor(expected), rtol=2**-10, atol=0
        )
    assert out.quant is None and out.scale is None


def test_reference_matches_a_hand_computed_case_where_eps_dominates():
    # one token, H=2, no routing (slot skipped): x = residual = [0.03, -0.04]; mean(x^2) = 1.25e-3,
    # eps = 1e-2 -> rsqrt(1.125e-2) = 9.428; gamma + weight_bias = [0.5 + 0.25, 1 + 0.25]
    spec = EpilogueSpec(
        hidden_size=2,
        top_k=1,
        dtype=torch.float16,
        eps=1e-2,
        weight_bias=0.25,
        has_shared_output=False,
    )
    inp = EpilogueInputs(
        torch.full((1, 2), float("nan"), dtype=torch.float16),
        torch.tensor([[-1]], dtype=torch.int32),
        torch.ones(1, 1),
        None,
        torch.tensor([[0.03, -0.04]], dtype=torch.float16),
        torch.tensor([0.5, 1.0], dtype=torch.float16),
    )
    out = reference_epilogue(spec, inp)
    x = [float(v) for v in inp.residual[0].float()]
    inv = 1.0 / math.sqrt((x[0] ** 2 + x[1] ** 2) / 2 + 1e-2)
    expected = [x[0] * inv * 0.75, x[1] * inv * 1.25]
    assert torch.allclose(out.norm_out[0].float(), torch.tensor(expected), rtol=2**-10, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shared", [True, False])
def test_reference_rounds_the_float64_oracle_once(dtype, shared):
    """The production oracle against the independent one: every element within half an ulp of the
    exact value plus fp32's error before the rounding, eps / weight_bias / scaling all
    observable."""
    spec = EpilogueSpec(
        hidden_size=160,
        top_k=4,
        dtype=dtype,
        eps=1e-2,
        weight_bias=0.5,
        routed_scaling_factor=2.5,
        has_shared_output=shared,
    )
    inp = scaled_inputs(make_inputs(spec, 9, seed=11), 0.05)
    out = reference_epilogue(spec, inp)
    residual_exact, norm_exact = oracle64.epilogue64_from(spec, [inp])
    residual_slack, norm_slack = oracle64.fp32_slack64(spec, [inp])
    oracle64.check_rounded_once(out.residual_out, residual_exact, slack_abs=residual_slack)
    oracle64.check_rounded_once(out.norm_out, norm_exact, slack_abs=norm_slack)


def test_reference_sums_partials_of_every_rank_like_the_oracle():
    """world_size > 1 without a process group is not possible in one process; the sum over ranks is
    checked here at the math level: the oracle's sum of two ranks equals residual + p0 + p1."""
    spec = EpilogueSpec(hidden_size=96, top_k=2)
    r0, r1 = make_inputs(spec, 3, rank=0, seed=4), make_inputs(spec, 3, rank=1, seed=4)
    residual_exact, _ = oracle64.epilogue64_from(spec, [r0, r1])
    p = [
        oracle64.finalize64(i.gemm2_out, i.expanded_idx_to_permuted_idx, i.expert_weights, 1.0)
        + i.shared_output.double()
        for i in (r0, r1)
    ]
    assert torch.allclose(residual_exact, r0.residual.double() + p[0] + p[1], rtol=1e-12, atol=0)
