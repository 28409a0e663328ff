"""`separate` (and `local_fused` under the Triton interpreter) against the fp32 oracle on CPU, one
process, over awkward shapes. Each strategy's bound is its own (see Strategy.error_bound)."""

import itertools

import pytest
import torch

from fusion_bridge import EpilogueSpec, FusionBridge, QuantSpec
from fusion_bridge.numerics import compare, failures
from fusion_bridge.synthetic import make_inputs

SEPARATE_GRID = list(itertools.product(
    [0, 1, 3, 64],            # T
    [256, 2880, 7168],        # H (2880: not a power of two, not a multiple of 256)
    [1, 2, 8],                # K
))


def run(bridge, inp):
    return bridge.finalize_epilogue(inp.gemm2_out, inp.expanded_idx_to_permuted_idx, inp.expert_weights,
                                    inp.shared_output, inp.residual, inp.gamma)


def check(bridge, spec, inp, name):
    got = bridge.run_strategy(name, inp)
    ref = bridge.run_strategy("reference", inp)
    bound = {s.name: s.error_bound for s in bridge.statuses}[name]
    assert not failures(spec, compare(spec, got, ref), ref, bound)
    return got


@pytest.mark.parametrize("tokens,hidden,top_k", SEPARATE_GRID)
def test_separate_matches_reference(tokens, hidden, top_k):
    variants = [  # (weight dtype, shared, weight_bias, routed scaling)
        (torch.float32, True, 0.0, 1.0), (torch.bfloat16, False, 1.0, 2.5), (torch.bfloat16, True, 1.0, 0.5)]
    for weight_dtype, shared, weight_bias, scaling in variants:
        spec = EpilogueSpec(hidden_size=hidden, top_k=top_k, has_shared_output=shared, weight_bias=weight_bias,
                            routed_scaling_factor=scaling)
        with FusionBridge(spec) as bridge:
            assert bridge.strategy_for(max(tokens, 1)) == "separate"
            inp = make_inputs(spec, tokens, seed=tokens + top_k, weight_dtype=weight_dtype)
            got = run(bridge, inp)
            assert got.norm_out.shape == (tokens, hidden) and got.residual_out.dtype == torch.bfloat16
            check(bridge, spec, inp, "separate")


@pytest.mark.parametrize("quant", [QuantSpec.fp8(0.02), QuantSpec.nvfp4(448.0), QuantSpec.nvfp4(448.0, "linear")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_strategies_match_reference(quant, dtype):
    spec = EpilogueSpec(hidden_size=2048, top_k=8, dtype=dtype, quant=quant)
    with FusionBridge(spec) as bridge:
        for tokens in (1, 5, 33):
            inp = make_inputs(spec, tokens, seed=tokens)
            for name in ("separate", "local_fused"):
                got = check(bridge, spec, inp, name)
                assert got.quant is not None and (got.scale is not None) == (quant.kind.value == "nvfp4")


@pytest.mark.parametrize("tokens,hidden,top_k", [(0, 256, 8), (1, 2880, 1), (3, 256, 8), (17, 2880, 2)])
def test_local_fused_under_the_interpreter_matches_reference(tokens, hidden, top_k):
    spec = EpilogueSpec(hidden_size=hidden, top_k=top_k, routed_scaling_factor=2.5, weight_bias=1.0)
    with FusionBridge(spec) as bridge:
        assert bridge.strategy_for(max(tokens, 1)) == "separate"  # auto never picks the interpreter path
        for weight_dtype in (torch.float32, torch.bfloat16):
            check(bridge, spec, make_inputs(spec, tokens, seed=tokens, weight_dtype=weight_dtype), "local_fused")


def test_zero_tokens_returns_empty_outputs_of_every_kind():
    for quant, q_shape, sf_shape in [(QuantSpec.none(), None, None), (QuantSpec.fp8(1.0), (0, 64), None),
                                     (QuantSpec.nvfp4(1.0), (0, 32), (0, 4)),
                                     (QuantSpec.nvfp4(1.0, "linear"), (0, 32), (0, 4))]:
        spec = EpilogueSpec(hidden_size=64, top_k=2, quant=quant)
        with FusionBridge(spec) as bridge:
            out = run(bridge, make_inputs(spec, 0))
            assert out.residual_out.shape == out.norm_out.shape == (0, 64)
            assert (None if out.quant is None else tuple(out.quant.shape)) == q_shape
            assert (None if out.scale is None else tuple(out.scale.shape)) == sf_shape
