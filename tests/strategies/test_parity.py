"""Every strategy that runs on CPU (reference, separate, our kernels under the Triton interpreter)
against the independent float64 oracle (tests/oracle64.py), one process, with every parameter made
observable: eps = 1e-2 on small rows, weight_bias != 0, routed_scaling_factor != 1.

Bounds:
- `reference` rounds each output once from fp32: every element within half an ulp of the exact value
  plus the fp32 error before that rounding (2^-20 of the summed terms' magnitudes:
  oracle64.fp32_slack64).
- the others: their own norm-wise bound (Strategy.error_bound: sqrt(roundings + 1) * u), now against
  the exact value rather than another rounded result.
- quantized outputs: codes (and scales) bit for bit equal to the float64 oracle's quantizer applied
  to the strategy's own norm_out, and the dequantized error against the exact norm_out within a
  bound
  taken from the measured distribution (see FP8_DEQUANT_BOUND).
"""

import pytest
import torch

from fusion_bridge import EpilogueSpec, FusionBridge, QuantSpec
from fusion_bridge.oracle.synthetic import make_inputs
from tests import oracle64
from tests.helpers import cpu_strategy_names, quant_problems, scaled_inputs

STRATEGIES = cpu_strategy_names()
# Dequantized quant output vs the exact norm_out, norm-wise, measured with `separate` over 40 seeds
# x
# T in {5, 9} x bf16/fp16 at H=256, K=8 (weight_bias 0.5, scaling 2.5): fp8 (scale 0.02) mean
# 0.0268,
# max 0.0279; nvfp4 (global scale 448) mean 0.0950, max 0.0994. Bounds: the max + 15%. (Theory: fp8
# 2^-4/sqrt(3) = 0.036; nvfp4 depends on the block scales.) Valid for T >= 5 at H = 256: fewer
# elements spread more (T=1: fp8 up to 0.0305, nvfp4 up to 0.1075).
FP8_DEQUANT_BOUND = 0.0279 * 1.15
NVFP4_DEQUANT_BOUND = 0.0994 * 1.15

VARIANTS = {  # name: (EpilogueSpec overrides, input magnitude factor, weight dtype)
    "eps_observable": (
        dict(eps=1e-2, weight_bias=0.0, routed_scaling_factor=1.0),
        0.01,
        torch.float32,
    ),
    "weight_bias": (dict(eps=1e-6, weight_bias=0.5, routed_scaling_factor=1.0), 1.0, torch.float32),
    "scaling_bf16_weights": (
        dict(eps=1e-6, weight_bias=0.0, routed_scaling_factor=2.5),
        1.0,
        torch.bfloat16,
    ),
    "all_no_shared": (
        dict(eps=1e-2, weight_bias=-0.25, routed_scaling_factor=0.5, has_shared_output=False),
        0.01,
        torch.float32,
    ),
}


def check_against_oracle(bridge, spec, inp, name):
    got = bridge.run_strategy(name, inp)
    residual_exact, norm_exact = oracle64.epilogue64_from(spec, [inp])
    assert torch.isfinite(got.norm_out).all() and torch.isfinite(got.residual_out).all()
    if name == "reference":
        residual_slack, norm_slack = oracle64.fp32_slack64(spec, [inp])
        oracle64.check_rounded_once(got.residual_out, residual_exact, slack_abs=residual_slack)
        oracle64.check_rounded_once(got.norm_out, norm_exact, slack_abs=norm_slack)
    else:
        bound = {s.name: s.error_bound for s in bridge.statuses}[name]
        for output, exact in (("residual_out", residual_exact), ("norm_out", norm_exact)):
            err = oracle64.normwise_rel_err(getattr(got, output), exact)
            assert err <= bound, f"{name} {output}: rel err {err:.3g} > bound {bound:.3g}"
    return got, norm_exact


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("tokens,hidden,top_k", [(1, 96, 1), (3, 160, 2), (9, 256, 8)])
@pytest.mark.parametrize("name", STRATEGIES)
def test_strategy_matches_the_float64_oracle(name, tokens, hidden, top_k, variant):
    overrides, magnitude, weight_dtype = VARIANTS[variant]
    spec = EpilogueSpec(hidden_size=hidden, top_k=top_k, **overrides)
    inp = scaled_inputs(
        make_inputs(spec, tokens, seed=tokens + top_k, weight_dtype=weight_dtype), magnitude
    )
    with FusionBridge(spec) as bridge:
        check_against_oracle(bridge, spec, inp, name)


OBSERVED = {
    "eps_observable": ("eps",),
    "weight_bias": ("weight_bias",),
    "scaling_bf16_weights": ("routed_scaling_factor",),
    "all_no_shared": ("eps", "weight_bias", "routed_scaling_factor"),
}
NEUTRAL = {
    "eps": 1e-12,
    "weight_bias": 0.0,
    "routed_scaling_factor": 1.0,
}  # what a dropped parameter gives


def test_the_variants_make_each_parameter_observable():
    """Dropping the parameter a variant is about moves the exact norm_out far beyond any strategy's
    bound (1.8e-2 at most), so a strategy that ignores it cannot pass."""
    for variant, (overrides, magnitude, _) in VARIANTS.items():
        spec = EpilogueSpec(hidden_size=160, top_k=2, **overrides)
        inp = scaled_inputs(make_inputs(spec, 3, seed=5), magnitude)
        _, norm = oracle64.epilogue64_from(spec, [inp])
        for field in OBSERVED[variant]:
            other = EpilogueSpec(**{**spec.__dict__, field: NEUTRAL[field]})
            _, other_norm = oracle64.epilogue64_from(other, [inp])
            assert oracle64.normwise_rel_err(other_norm, norm) > 0.05, (variant, field)


@pytest.mark.parametrize(
    "quant",
    [QuantSpec.fp8(0.02), QuantSpec.nvfp4(448.0), QuantSpec.nvfp4(448.0, "linear")],
    ids=["fp8", "nvfp4_swizzled", "nvfp4_linear"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_outputs_match_the_oracle_bit_for_bit(quant, dtype):
    spec = EpilogueSpec(
        hidden_size=256,
        top_k=8,
        dtype=dtype,
        quant=quant,
        weight_bias=0.5,
        routed_scaling_factor=2.5,
    )
    kind, scale = (
        quant.kind.value,
        (quant.scale if quant.kind.value == "fp8" else quant.global_scale),
    )
    swizzled = quant.sf_layout.value != "linear" if kind == "nvfp4" else False
    # swizzled NVFP4: T=5 only. Within one 128-row tile T=5 and T=9 run the same lines with the
    # same launch configs (at H=256 finalize_add.block_h_for is 256 up to T=32 and tp1_config whole
    # rows at every T; 128 row programs, padding rows included) and each T costs our kernels about
    # 3 s of interpreted programs; T=9 is checked in the fp8 and linear NVFP4 cases.
    token_counts = (5,) if kind == "nvfp4" and swizzled else (5, 9)
    with FusionBridge(spec) as bridge:
        for tokens in token_counts:
            inp = make_inputs(spec, tokens, seed=tokens)
            for name in STRATEGIES:
                got, norm_exact = check_against_oracle(bridge, spec, inp, name)
                q, sf = oracle64.quantize(got.norm_out, kind, scale, swizzled)
                assert torch.equal(got.quant.view(torch.uint8), q), name
                if kind == "fp8":
                    assert got.scale is None
                    deq, bound = oracle64.e4m3_decode(q) * scale, FP8_DEQUANT_BOUND
                else:
                    assert torch.equal(got.scale, sf), name
                    linear = oracle64.unswizzle(sf, tokens, 256 // 16) if swizzled else sf
                    deq, bound = oracle64.dequantize_nvfp4(q, linear, scale), NVFP4_DEQUANT_BOUND
                err = oracle64.normwise_rel_err(deq, norm_exact)
                assert err <= bound, f"{name} {kind}: dequantized rel err {err:.4f} > {bound:.4f}"


@pytest.mark.parametrize(
    "quant", [QuantSpec.fp8(0.02), QuantSpec.nvfp4(448.0, "linear")], ids=["fp8", "nvfp4"]
)
def test_a_nan_row_stays_nan_in_every_strategys_quantized_outputs(quant):
    """A residual row of NaN at world size 1 (what the peers of a failing rank get; measured on a
    GPU: fused_tp1 and local_fused_nccl wrote its fp8 codes finite and its NVFP4 scales not NaN):
    every strategy's norm_out row is NaN and its quantized row quant_ref's of it, NaN codes or NaN
    block scales; the other rows finite. Linear scales: a swizzled launch of the whole-row kernels
    is 128 programs under the interpreter (tests/kernels/test_quant_ranges.py has the swizzled
    layout's NaN rows)."""
    spec = EpilogueSpec(hidden_size=64, top_k=2, quant=quant)
    inp = make_inputs(spec, 3, seed=4)
    inp.residual[1] = float("nan")
    problems = {}
    with FusionBridge(spec, self_test=False) as bridge:
        for name in STRATEGIES:
            got = bridge.run_strategy(name, inp)
            problems[name] = quant_problems(quant, got.norm_out, got.quant, got.scale, [1])
            if not torch.isfinite(got.norm_out[[0, 2]]).all():
                problems[name].append("rows 0 and 2 not finite")
    assert not any(problems.values()), problems


def test_tokens_above_max_tokens_are_rerouted_and_computed_correctly():
    spec = EpilogueSpec(
        hidden_size=96, top_k=2, max_tokens=8, weight_bias=0.5, routed_scaling_factor=2.5
    )
    inp = make_inputs(spec, 11, seed=3)
    with FusionBridge(spec) as bridge:
        out = bridge(*inp)
        assert bridge.reroutes == 1
        overflow = bridge.plan.overflow
        direct = bridge.run_strategy(overflow, inp)
    assert torch.equal(out.norm_out, direct.norm_out) and torch.equal(
        out.residual_out, direct.residual_out
    )
    _, norm_exact = oracle64.epilogue64_from(spec, [inp])
    bound = {s.name: s.error_bound for s in bridge.statuses}[overflow]
    assert oracle64.normwise_rel_err(out.norm_out, norm_exact) <= bound


def test_zero_tokens_returns_empty_outputs_of_every_kind():
    for quant, q_shape, sf_shape in [
        (QuantSpec.none(), None, None),
        (QuantSpec.fp8(1.0), (0, 64), None),
        (QuantSpec.nvfp4(1.0), (0, 32), (0, 4)),
        (QuantSpec.nvfp4(1.0, "linear"), (0, 32), (0, 4)),
    ]:
        spec = EpilogueSpec(hidden_size=64, top_k=2, quant=quant)
        with FusionBridge(spec) as bridge:
            out = bridge(*make_inputs(spec, 0))
            assert out.residual_out.shape == out.norm_out.shape == (0, 64)
            assert (None if out.quant is None else tuple(out.quant.shape)) == q_shape
            assert (None if out.scale is None else tuple(out.scale.shape)) == sf_shape


@pytest.mark.parametrize(
    "quant",
    [
        QuantSpec.fp8_per_token_group(64, "row_major"),
        QuantSpec.fp8_per_token_group(32, "column_major"),
        QuantSpec.fp8_per_token_group(16, "column_major_tma"),
        QuantSpec.fp8_per_token(),
    ],
    ids=lambda q: f"{q.kind.value}-{q.scale_layout.value if q.scale_layout else 'row'}",
)
def test_dynamic_fp8_outputs_match_the_reference_bit_for_bit(quant):
    """Every CPU strategy with the dynamic FP8 kinds (H=192: not a power of two, several groups per
    row; T=1 and 9): codes and scales quant_ref's of its own norm_out bit for bit (the layout's
    view, the TMA padding zeros), the dequantized output within FP8_DEQUANT_BOUND of the exact
    norm_out (the same e4m3 step relative to each group's amax; per group it is finer than the
    static scale's); a NaN row NaN scales and 0x7F codes."""
    spec = EpilogueSpec(hidden_size=192, top_k=2, quant=quant, routed_scaling_factor=2.5)
    problems = {}
    with FusionBridge(spec, self_test=False) as bridge:
        for tokens in (1, 9):
            inp = make_inputs(spec, tokens, seed=tokens)
            for name in STRATEGIES:
                got, norm_exact = check_against_oracle(bridge, spec, inp, name)
                problems[(name, tokens)] = quant_problems(quant, got.norm_out, got.quant, got.scale)
                group = quant.group_size or 192
                deq = got.quant.float() * got.scale.repeat_interleave(group, dim=1)
                err = oracle64.normwise_rel_err(deq.double(), norm_exact)
                if not err <= FP8_DEQUANT_BOUND:
                    problems[(name, tokens)].append(f"dequantized rel err {err:.4f}")
        inp = make_inputs(spec, 3, seed=4)
        inp.residual[1] = float("nan")
        for name in STRATEGIES:
            got = bridge.run_strategy(name, inp)
            problems[(name, "nan")] = quant_problems(quant, got.norm_out, got.quant, got.scale, [1])
    assert not any(problems.values()), problems
