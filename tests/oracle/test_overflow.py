"""Overflow-safe RMSNorm. bf16 holds values up to ~3.4e38, but the fp32 sum of squares of a row
overflows once |x| >~ 1.8e19; rsqrt(inf) = 0 then turns a finite row into a norm_out of zeros.
Every path we own that computes RMSNorm scales such a row by a power of two first: torch math for
`reference` and `separate`, our add+RMSNorm kernel for `local_fused`, the world-size-1 kernel
(`fused_tp1`, among the CPU strategies below), the one-shot and two-shot symmetric-memory kernels
(here with emulated ranks under the interpreter; compiled, in
tests/kernels/test_symm_oneshot_emulated_on_one_gpu.py)
and the two-shot (tests/kernels/test_symm_twoshot.py, its own emulation). Checked against the
float64 oracle (which squares in float64: no overflow below ~1e154), and normal rows checked bit
for bit against the previous formula.
"""

import pytest
import torch

from fusion_bridge.epilogue_tensors import EpilogueInputs

from fusion_bridge import EpilogueSpec, FusionBridge
from fusion_bridge.oracle.synthetic import make_inputs
from fusion_bridge.oracle.torch_math import rmsnorm_fp32
from fusion_bridge.kernels.add_rmsnorm import add_rmsnorm_into
from tests import oracle64
from tests.helpers import cpu_strategy_names

NAN = float("nan")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 error before the one rounding, relative (see test_kernels_cpu): 2^-20
SLACK = 2.0**-20
FP32_MIN_NORMAL = 2.0**-126


def previous_formula(x, gamma, eps, weight_bias):
    """RMSNorm as it was before the overflow fix."""
    x = x.float()
    return (
        x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * (gamma.float() + weight_bias)
    )


def huge_rows(hidden, seed=0):
    """bf16 rows whose sum of squares overflows fp32 (and one that just does not)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(6, hidden, generator=g)
    scales = torch.tensor([1e18, 2e19, 1e25, 1e30, 1e36, 1e37]).unsqueeze(
        1
    )  # 1e18: no overflow (control)
    return (base * scales).to(torch.bfloat16)


def test_the_huge_rows_really_overflow_the_old_formula():
    x = huge_rows(256).float()
    gamma = torch.ones(256)
    old = previous_formula(x, gamma, 1e-6, 0.0)
    assert old[0].abs().sum() > 0  # 1e18: fine before
    assert (old[1:] == 0).all()  # the others: a row of zeros, the bug being fixed


@pytest.mark.parametrize("weight_bias", [0.0, 0.5])
def test_torch_math_handles_huge_rows(weight_bias):
    x = huge_rows(256).float()
    gamma = (1 + 0.1 * torch.randn(256, generator=torch.Generator().manual_seed(1))).to(
        torch.bfloat16
    )
    got = rmsnorm_fp32(x, gamma, 1e-6, weight_bias).to(torch.bfloat16)
    exact = oracle64.rmsnorm64(x, gamma, 1e-6, weight_bias)
    oracle64.check_rounded_once(got, exact, SLACK)
    # one huge element among ordinary ones: the row normalizes to ~sqrt(H) there, ~0 elsewhere
    spike = torch.randn(2, 256, generator=torch.Generator().manual_seed(2))
    spike[0, 7], spike[1, 100] = 3e38, -1e20
    spike = spike.to(torch.bfloat16).float()
    oracle64.check_rounded_once(
        rmsnorm_fp32(spike, gamma, 1e-6, weight_bias).to(torch.bfloat16),
        oracle64.rmsnorm64(spike, gamma, 1e-6, weight_bias),
        SLACK,
    )


def test_normal_rows_are_bit_identical_to_the_previous_formula():
    g = torch.Generator().manual_seed(3)
    # magnitudes from tiny to just below the overflow threshold (sum of squares < 3.4e38 at H=512)
    scales = (
        torch.tensor([1e-30, 1e-10, 1e-3, 1.0, 1e3, 1e10, 5e17]).repeat_interleave(4).unsqueeze(1)
    )
    x = (torch.randn(scales.shape[0], 512, generator=g) * scales).to(torch.bfloat16).float()
    gamma = (1 + 0.1 * torch.randn(512, generator=g)).to(torch.bfloat16)
    for eps, wb in [(1e-6, 0.0), (1e-2, 1.0), (1e-5, -0.5)]:
        assert torch.equal(rmsnorm_fp32(x, gamma, eps, wb), previous_formula(x, gamma, eps, wb))


def _kernel_norm(x_bf16, gamma, eps, weight_bias):
    tokens, hidden = x_bf16.shape
    residual = x_bf16.to(DEVICE)
    zeros = torch.zeros_like(residual)
    # poisoned: an element the kernel leaves unwritten shows as NaN
    residual_out, norm_out = torch.full_like(residual, NAN), torch.full_like(residual, NAN)
    none = torch.empty(0, dtype=torch.uint8, device=DEVICE)
    add_rmsnorm_into(
        residual_out,
        norm_out,
        none,
        none,
        residual,
        zeros,
        gamma.to(DEVICE),
        eps=eps,
        weight_bias=weight_bias,
        quant=0,
        quant_scale=1.0,
        swizzled=False,
    )
    return norm_out.cpu()


@pytest.mark.parametrize("weight_bias", [0.0, 0.5])
def test_kernel_handles_huge_rows(weight_bias):
    x = huge_rows(160)
    gamma = (1 + 0.1 * torch.randn(160, generator=torch.Generator().manual_seed(1))).to(
        torch.bfloat16
    )
    got = _kernel_norm(x, gamma, 1e-6, weight_bias)
    oracle64.check_rounded_once(got, oracle64.rmsnorm64(x.float(), gamma, 1e-6, weight_bias), SLACK)
    assert torch.equal(got, rmsnorm_fp32(x.float(), gamma, 1e-6, weight_bias).to(torch.bfloat16))


def test_kernel_handles_a_single_huge_element():
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(2))
    x[0, 7], x[1, 50] = 3e38, -1e20
    x = x.to(torch.bfloat16)
    gamma = torch.ones(96, dtype=torch.bfloat16)
    got = _kernel_norm(x, gamma, 1e-6, 0.0)
    exact = oracle64.rmsnorm64(x.float(), gamma, 1e-6, 0.0)
    assert abs(got[0, 7].item() - 96**0.5) < 0.05 and abs(got[1, 50].item() + 96**0.5) < 0.05
    # the other elements of row 0 land near fp32's smallest normals (~1e-38); below 2^-126 the
    # interpreter's subnormal arithmetic is not IEEE-exact (measured: up to ~40 bf16 ulps off
    # there),
    # so compare the normal-range elements only
    normal = exact.abs() >= FP32_MIN_NORMAL
    oracle64.check_rounded_once(got[normal], exact[normal], SLACK)


def test_normal_rows_are_bit_identical_in_the_kernel():
    g = torch.Generator().manual_seed(4)
    scales = torch.tensor([1e-20, 1e-3, 1.0, 1e6, 1e17]).repeat_interleave(2).unsqueeze(1)
    x = (torch.randn(scales.shape[0], 256, generator=g) * scales).to(torch.bfloat16)
    gamma = (1 + 0.1 * torch.randn(256, generator=g)).to(torch.bfloat16)
    got = _kernel_norm(x, gamma, 1e-2, 0.25)
    want = previous_formula(x.float(), gamma, 1e-2, 0.25).to(torch.bfloat16)
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    else:  # FMA contraction on the GPU: at most one ulp
        assert (
            (got.double() - want.double()).abs() <= oracle64.ulp(want.double(), torch.bfloat16)
        ).all()


@pytest.mark.parametrize("strategy", cpu_strategy_names())
def test_every_cpu_strategy_normalizes_a_huge_row(strategy):
    spec = EpilogueSpec(hidden_size=96, top_k=2, weight_bias=0.5)
    inp = make_inputs(spec, 3, seed=5)
    residual = inp.residual.clone()
    residual[1] = (residual[1].float() * 1e25).to(torch.bfloat16)
    inp = inp._replace(residual=residual)
    # our kernels run on the GPU where there is one (TRITON_INTERPRET is set only without CUDA)
    ours = strategy in ("local_fused_nccl", "fused_tp1")
    device = "cuda" if ours and torch.cuda.is_available() else "cpu"
    with FusionBridge(
        spec, strategy="reference" if strategy == "reference" else "auto", device=device
    ) as bridge:
        out = bridge.run_strategy(
            strategy, EpilogueInputs(*(None if t is None else t.to(device) for t in inp))
        )
        out = type(out)(
            *(
                None if t is None else t.cpu()
                for t in (out.residual_out, out.norm_out, out.quant, out.scale)
            )
        )
    residual_exact, norm_exact = oracle64.epilogue64_from(spec, [inp])
    assert out.norm_out[1].abs().sum() > 0
    # residual_out and norm_out: within the strategy's roundings of the exact value; with a 1e25 row
    # the routed/shared terms (~1) vanish below one ulp of the row, so one rounding bounds it
    oracle64.check_rounded_once(out.residual_out[1:2], residual_exact[1:2], SLACK)
    oracle64.check_rounded_once(out.norm_out[1:2], norm_exact[1:2], SLACK)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="interpreter emulation; tests/kernels/test_symm_oneshot_emulated_on_one_gpu.py covers "
    "the compiled kernels",
)
def test_symmetric_memory_kernels_normalize_huge_rows():
    """The one-shot symmetric-memory kernel's norm on rows scaled by 1e18 (control), 2e19, 1e25 and
    1e36, two emulated ranks (kernels/symm_testing runs the production kernel body; the
    two-shot
    one's is in tests/kernels/test_symm_twoshot.py). Mutant killed: the norm building block without
    its
    overflow-safe scaling (an all-zero norm_out)."""
    from fusion_bridge.testing.symm_oneshot_rig import emulated_group

    spec = EpilogueSpec(hidden_size=96, top_k=2, weight_bias=0.5)
    world, tokens = 2, 5
    inputs = [make_inputs(spec, tokens, rank=r, seed=6) for r in range(world)]
    residual = inputs[0].residual.clone()
    for row, scale in zip((1, 2, 3, 4), (1e18, 2e19, 1e25, 1e36)):
        residual[row] = (residual[row].float() * scale).to(torch.bfloat16)
    inputs = [i._replace(residual=residual, gamma=inputs[0].gamma) for i in inputs]
    group = emulated_group(spec, world, tokens)
    none = torch.empty(0, dtype=torch.uint8)
    outs = [
        (
            torch.full_like(residual, float("nan")),
            torch.full_like(residual, float("nan")),
            none,
            none,
        )
        for _ in range(world)
    ]
    group.call(inputs, outs, programs=2)
    assert group.errs[:, 0].tolist() == [0] * world
    residual_exact, norm_exact = oracle64.epilogue64_from(spec, inputs)
    for residual_out, norm_out, _, _ in outs:
        assert (norm_out[2:].abs().sum(1) > 0).all()
        # rows 2..4: the routed/shared terms (~1) vanish below one ulp of the row, so one rounding
        # bounds both outputs (as for the strategies above)
        oracle64.check_rounded_once(residual_out[2:], residual_exact[2:], SLACK)
        oracle64.check_rounded_once(norm_out[2:], norm_exact[2:], SLACK)
