"""Our Triton kernels against the pure-torch references, under TRITON_INTERPRET=1 on CPU (on a GPU
machine the same tests run on the GPU). Outputs are poisoned first and checked fully written."""

import pytest
import torch

from fusion_bridge import EpilogueSpec, SFLayout
from fusion_bridge.quant_ref import quantize_fp8, quantize_nvfp4, sf_shape
from fusion_bridge.strategies.base import rounding_error_bound
from fusion_bridge.numerics import rel_err
from fusion_bridge.synthetic import make_inputs
from fusion_bridge.torch_math import finalize_fp32, rmsnorm_fp32
from fusion_bridge.kernels.add_rmsnorm import add_rmsnorm_into
from fusion_bridge.kernels.finalize_add import finalize_add_into
from fusion_bridge.kernels.quant import QUANT_FP8, QUANT_NONE, QUANT_NVFP4, quantize_into

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISON = 0xFF


def poisoned(shape, dtype):
    t = torch.empty(shape, dtype=dtype, device=DEVICE)
    t.view(torch.uint8).fill_(POISON)  # NaN for float dtypes
    return t


@pytest.mark.parametrize("tokens", [0, 1, 3, 17])
@pytest.mark.parametrize("hidden,top_k", [(80, 1), (256, 8), (2880, 2)])
@pytest.mark.parametrize("dtype,weight_dtype,shared", [
    (torch.bfloat16, torch.float32, True), (torch.bfloat16, torch.bfloat16, False),
    (torch.float16, torch.float32, True)])
def test_finalize_add_matches_fp32_reference(tokens, hidden, top_k, dtype, weight_dtype, shared):
    spec = EpilogueSpec(hidden_size=hidden, top_k=top_k, dtype=dtype, has_shared_output=shared,
                        routed_scaling_factor=2.5)
    inp = make_inputs(spec, tokens, seed=tokens + hidden, device=DEVICE, weight_dtype=weight_dtype)
    out = poisoned((tokens, hidden), dtype)
    finalize_add_into(out, inp.gemm2_out, inp.expanded_idx_to_permuted_idx, inp.expert_weights,
                      inp.shared_output, 2.5)
    ref = finalize_fp32(inp.gemm2_out, inp.expanded_idx_to_permuted_idx, inp.expert_weights, 2.5)
    if shared:
        ref = ref + inp.shared_output.float()
    # one rounding in the kernel and one in rounding the reference for comparison; skipped slots
    # point at NaN rows, so any read of them shows up as a non-finite output
    assert torch.isfinite(out).all()
    assert rel_err(out, ref.to(dtype)) <= rounding_error_bound(dtype, 2)


@pytest.mark.parametrize("tokens", [1, 3, 130])
@pytest.mark.parametrize("hidden", [80, 2880])
@pytest.mark.parametrize("quant,layout", [(QUANT_NONE, SFLayout.LINEAR), (QUANT_FP8, SFLayout.LINEAR),
                                          (QUANT_NVFP4, SFLayout.SWIZZLED_128x4), (QUANT_NVFP4, SFLayout.LINEAR)])
def test_add_rmsnorm_quant_matches_reference(tokens, hidden, quant, layout):
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(tokens * 31 + hidden)
    residual = torch.randn(tokens, hidden, generator=g).to(dtype).to(DEVICE)
    reduced = (3 * torch.randn(tokens, hidden, generator=g)).to(dtype).to(DEVICE)
    gamma = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    scale = {QUANT_NONE: 1.0, QUANT_FP8: 0.02, QUANT_NVFP4: 448 * 6 / 6.0}[quant]
    residual_out, norm_out = poisoned((tokens, hidden), dtype), poisoned((tokens, hidden), dtype)
    q_shape = {QUANT_NONE: (0,), QUANT_FP8: (tokens, hidden), QUANT_NVFP4: (tokens, hidden // 2)}[quant]
    q = poisoned(q_shape, torch.uint8)
    sf = poisoned(sf_shape(tokens, hidden, layout) if quant == QUANT_NVFP4 else (0,), torch.uint8)
    add_rmsnorm_into(residual_out, norm_out, q, sf, residual, reduced, gamma, 1e-6, 0.5, quant, scale,
                     layout is SFLayout.SWIZZLED_128x4)
    x = residual.float() + reduced.float()
    assert torch.equal(residual_out, x.to(dtype))  # one RNE rounding of the same fp32 sum
    ref_norm = rmsnorm_fp32(x, gamma, 1e-6, 0.5)
    assert torch.isfinite(norm_out).all()
    assert rel_err(norm_out, ref_norm.to(dtype)) <= rounding_error_bound(dtype, 2)
    # quantization reads the kernel's own rounded norm_out: then it must match the reference bit for bit
    if quant == QUANT_FP8:
        assert torch.equal(q, quantize_fp8(norm_out, scale).view(torch.uint8))
    if quant == QUANT_NVFP4:
        ref_q, ref_sf = quantize_nvfp4(norm_out, scale, layout)
        assert torch.equal(q, ref_q)
        assert torch.equal(sf, ref_sf)  # includes the zeroed swizzle padding (was poisoned)


@pytest.mark.parametrize("quant", [QUANT_FP8, QUANT_NVFP4])
def test_standalone_quantize_matches_reference(quant):
    x = (2 * torch.randn(5, 96, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16).to(DEVICE)
    scale = 0.01 if quant == QUANT_FP8 else 100.0
    if quant == QUANT_FP8:
        q = poisoned((5, 96), torch.uint8)
        quantize_into(q, torch.empty(0, dtype=torch.uint8, device=DEVICE), x, quant, scale, False)
        assert torch.equal(q, quantize_fp8(x, scale).view(torch.uint8))
    else:
        q, sf = poisoned((5, 48), torch.uint8), poisoned(sf_shape(5, 96, SFLayout.SWIZZLED_128x4), torch.uint8)
        quantize_into(q, sf, x, quant, scale, True)
        ref_q, ref_sf = quantize_nvfp4(x, scale, SFLayout.SWIZZLED_128x4)
        assert torch.equal(q, ref_q) and torch.equal(sf, ref_sf)


def test_custom_ops_allocate_empty_outputs_for_zero_tokens():
    import fusion_bridge.kernels.ops  # noqa: F401
    empty = torch.empty(0, 64, dtype=torch.bfloat16, device=DEVICE)
    out = torch.ops.fusion_bridge.finalize_add(torch.empty(4, 64, dtype=torch.bfloat16, device=DEVICE),
                                               torch.empty(0, 2, dtype=torch.int32, device=DEVICE),
                                               torch.empty(0, 2, device=DEVICE), None, 1.0)
    assert out.shape == (0, 64)
    r, n, q, sf = torch.ops.fusion_bridge.add_rmsnorm_quant(empty, empty, torch.ones(64, dtype=torch.bfloat16,
                                                            device=DEVICE), 1e-6, 0.0, QUANT_NVFP4, 1.0, True)
    assert r.shape == n.shape == (0, 64) and q.shape == (0, 32) and sf.shape == (0, 4)
