"""The epilogue's math as plain torch ops, shared by the `reference` and `separate` strategies."""

from __future__ import annotations

from typing import Optional

import torch

from fusion_bridge.oracle import quant_ref
from fusion_bridge.epilogue_tensors import EpilogueOutputs
from fusion_bridge.spec import EpilogueSpec, QuantKind


def finalize_fp32(
    gemm2_out: torch.Tensor, perm: torch.Tensor, weights: torch.Tensor, routed_scaling_factor: float
) -> torch.Tensor:
    """routed[t] = scaling * sum_k w[t,k] * gemm2_out[perm[t,k]], skipping perm == -1. Returns fp32
    [T, H]."""
    tokens, hidden = perm.shape[0], gemm2_out.shape[1]
    valid = perm >= 0
    if gemm2_out.shape[0] == 0:  # then every index is -1 (validated); shape-only test, no host sync
        return torch.zeros(tokens, hidden, dtype=torch.float32, device=gemm2_out.device)
    rows = (
        gemm2_out.index_select(0, perm.clamp(min=0).reshape(-1).long())
        .reshape(tokens, perm.shape[1], hidden)
        .float()
    )
    # where, not a zero weight: a skipped slot may point at a padding row holding NaN
    weighted = torch.where(valid.unsqueeze(-1), rows * weights.float().unsqueeze(-1), 0.0)
    return weighted.sum(dim=1) * routed_scaling_factor


def overflow_scale(x: torch.Tensor, mean_sq: torch.Tensor) -> torch.Tensor:
    """Per row: 1.0, or, where the fp32 mean of squares overflowed (a finite row with |x| >~ 1.8e19,
    which bf16 can hold), the power of two 2^(31 - floor(log2(amax))) that brings the
    row's largest magnitude into [2^31, 2^32). Computed without a host sync (graph-safe)."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    _, e = torch.frexp(amax)  # amax in [2^(e-1), 2^e)
    # the power of two built from its exponent bits: exact, and normal for every finite fp32 amax
    power = ((127 + 32 - e).clamp(1, 254).to(torch.int32) << 23).view(torch.float32)
    return torch.where(mean_sq == float("inf"), power, torch.ones_like(power))


def rmsnorm_fp32(
    x: torch.Tensor, gamma: torch.Tensor, eps: float, weight_bias: float
) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * (gamma + weight_bias) in fp32.

    Overflow-safe: a row whose sum of squares overflows fp32 is first scaled by a power of two s
    (then x*s, and eps*s^2 in place of eps: the same value up to rounding). Every other row has
    s = 1 and computes exactly the unscaled formula, bit for bit."""
    x = x.float()
    mean_sq = x.pow(2).mean(dim=-1, keepdim=True)
    s = overflow_scale(x, mean_sq)
    xs = x * s
    inv_rms = torch.rsqrt(xs.pow(2).mean(dim=-1, keepdim=True) + eps * s * s)
    return xs * inv_rms * (gamma.float() + weight_bias)


def quantize(
    norm_out: torch.Tensor, spec: EpilogueSpec
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Quantize the already-rounded norm_out as the spec says. Returns (quant, scale)."""
    q = spec.quant
    if q.kind is QuantKind.FP8:
        return quant_ref.quantize_fp8(norm_out, q.scale), None
    if q.kind is QuantKind.NVFP4:
        return quant_ref.quantize_nvfp4(norm_out, q.global_scale, q.sf_layout)
    if q.kind is QuantKind.FP8_PER_TOKEN_GROUP:
        codes, scales = quant_ref.quantize_fp8_per_token_group(norm_out, q.group_size)
        return codes, quant_ref.fp8_scale_view(scales, q.scale_layout)
    if q.kind is QuantKind.FP8_PER_TOKEN:
        return quant_ref.quantize_fp8_per_token(norm_out)
    return None, None


def residual_norm_outputs(
    summed_fp32: torch.Tensor, gamma: torch.Tensor, spec: EpilogueSpec
) -> EpilogueOutputs:
    """From residual + reduced (fp32) to the rounded outputs, quantized from the
    rounded norm_out."""
    residual_out = summed_fp32.to(spec.dtype)
    norm_out = rmsnorm_fp32(summed_fp32, gamma, spec.eps, spec.weight_bias).to(spec.dtype)
    quant, scale = quantize(norm_out, spec)
    return EpilogueOutputs(residual_out, norm_out, quant, scale)
