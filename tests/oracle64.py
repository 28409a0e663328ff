"""An independent float64 oracle of the epilogue, for tests only.

Written apart from `fusion_bridge.oracle.torch_math` and `fusion_bridge.oracle.quant_ref` (it
imports nothing from
the package): plain loops over (token, slot), float64 arithmetic, and quantizers built from the
number
formats' definitions (a grid step per binade, `round` half-to-even) rather than from torch's fp8
cast
or a distance search. The swizzled scale layout is built by a reshape/permute of the padded
[rows, cols] scale matrix, not from the offset formula; the formula is restated separately
(`swizzle_offset`) and the two are checked against each other in tests.

The math (what every strategy must compute):
    routed[t]    = routed_scaling * sum_k w[t,k] * gemm2_out[perm[t,k]]   (perm[t,k] == -1 skipped)
    partial[t]   = routed[t] + shared[t]
    reduced      = sum over ranks of partial
    residual_out = residual + reduced
    norm_out     = residual_out / sqrt(mean(residual_out^2) + eps) * (gamma + weight_bias)
All of it in float64, unrounded. Quantization reads norm_out as the strategy rounded it, and follows
the quant conventions: fp8 q = e4m3_rne_satfinite(x / scale) with the quotient in fp32; nvfp4 per
16-element block FlashInfer's steps, each rounded to fp32: sf = e4m3(gs * (amax * (1/6))),
q = e2m1_rne_satfinite(x * (1 / (sf * (1/gs)))) (a multiplier of 0 where sf == 0), the sign bit x's
(-0.0: code 8; NaN: none), two codes per byte, low nibble first. Each fp32 step is taken in float64
and rounded once to fp32: exact for the products (at most 48 significant bits), and for the
divisions a correct rounding too (float64 has more than 2 * 24 + 2 bits, so rounding the float64
quotient to fp32 equals rounding the exact one).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

F64 = torch.float64
E4M3_MAX = 448.0
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # code i (sign in bit 3)


# ------------------------------------------------------------------ the epilogue
def finalize64(
    gemm2_out: torch.Tensor, perm: torch.Tensor, weights: torch.Tensor, routed_scaling: float
) -> torch.Tensor:
    """[T, H] float64; a skipped slot's row is never read (it may hold NaN)."""
    tokens, top_k = perm.shape
    out = torch.zeros(tokens, gemm2_out.shape[1], dtype=F64)
    g, p, w = gemm2_out.to(F64), perm.tolist(), weights.to(F64)
    for t in range(tokens):
        for k in range(top_k):
            if p[t][k] == -1:
                continue
            out[t] += w[t, k] * g[p[t][k]]
    return out * routed_scaling


def rmsnorm64(x: torch.Tensor, gamma: torch.Tensor, eps: float, weight_bias: float) -> torch.Tensor:
    """float64 throughout: |x| up to the bf16/fp16 maximum (~3.4e38) squares to ~1e77, far from
    float64's overflow, so no scaling is needed here."""
    x = x.to(F64)
    ms = torch.einsum("th,th->t", x, x) / x.shape[1]
    return x / torch.sqrt(ms + eps).unsqueeze(1) * (gamma.to(F64) + weight_bias)


def epilogue64(
    rank_inputs: Sequence,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    *,
    eps: float,
    weight_bias: float,
    routed_scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rank_inputs: one (gemm2_out, perm, weights, shared or None) per rank (perm and weights are
    the same on every rank in TP, but each rank's own are used). Returns (residual_out, norm_out)
    float64."""
    reduced = None
    for gemm2_out, perm, weights, shared in rank_inputs:
        partial = finalize64(gemm2_out, perm, weights, routed_scaling)
        if shared is not None:
            partial = partial + shared.to(F64)
        reduced = partial if reduced is None else reduced + partial
    residual_out = residual.to(F64) + reduced
    return residual_out, rmsnorm64(residual_out, gamma, eps, weight_bias)


def epilogue64_from(spec, per_rank_inputs: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from EpilogueInputs values (one per rank) and an EpilogueSpec (only its numbers
    read)."""
    first = per_rank_inputs[0]
    return epilogue64(
        [
            (i.gemm2_out, i.expanded_idx_to_permuted_idx, i.expert_weights, i.shared_output)
            for i in per_rank_inputs
        ],
        first.residual,
        first.gamma,
        eps=spec.eps,
        weight_bias=spec.weight_bias,
        routed_scaling=spec.routed_scaling_factor,
    )


def fp32_slack64(
    spec, per_rank_inputs: Sequence, rel: float = 2.0**-20
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute error that fp32 arithmetic may add before the one rounding of residual_out and
    norm_out: a sum of n <= 16 fp32 terms errs by at most n * 2^-24 <= 2^-20 (`rel`) times the sum
    of
    the terms' magnitudes (cancellation makes that much larger than the result); norm_out carries it
    through 1/rms * |gamma + weight_bias|, plus `rel` of its own value."""
    first = per_rank_inputs[0]
    magnitude = first.residual.to(F64).abs()
    for i in per_rank_inputs:
        magnitude = magnitude + finalize64(
            i.gemm2_out.abs(),
            i.expanded_idx_to_permuted_idx,
            i.expert_weights.abs(),
            abs(spec.routed_scaling_factor),
        )
        if i.shared_output is not None:
            magnitude = magnitude + i.shared_output.to(F64).abs()
    residual_exact, norm_exact = epilogue64_from(spec, per_rank_inputs)
    rms = torch.sqrt((residual_exact**2).mean(dim=1, keepdim=True) + spec.eps)
    scale = (first.gamma.to(F64) + spec.weight_bias).abs()
    return rel * magnitude, rel * magnitude / rms * scale + rel * norm_exact.abs()


# ------------------------------------------------------------------ rounding to the activation
# dtype
def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` (bf16: 8 significant bits, fp16: 11) at |x|, float64."""
    bits, min_exp = {torch.bfloat16: (8, -126), torch.float16: (11, -14)}[dtype]
    _, e = torch.frexp(x.to(F64).abs())  # |x| = m * 2^e, m in [0.5, 1)
    return torch.ldexp(
        torch.ones_like(x, dtype=F64), (torch.clamp(e - 1, min=min_exp) - (bits - 1))
    )


def check_rounded_once(
    got: torch.Tensor,
    exact: torch.Tensor,
    slack_rel: float = 0.0,
    slack_abs: Optional[torch.Tensor] = None,
) -> None:
    """Every element of `got` (activation dtype) within half an ulp of the exact value, plus
    `slack_rel` * |exact| and `slack_abs` (what fp32 arithmetic before the one rounding may add).
    Says where not."""
    g, e = got.to(F64), exact.to(F64)
    err = (g - e).abs()
    limit = (
        0.5 * ulp(e, got.dtype)
        + slack_rel * e.abs()
        + (0.0 if slack_abs is None else slack_abs.to(F64))
    )
    bad = ~(err <= limit)
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} elements more than half an ulp (+{slack_rel:g} "
            f"rel) from the float64 oracle, e.g. at {idx}: got "
            f"{[g[tuple(i)].item() for i in idx]}, "
            f"exact {[e[tuple(i)].item() for i in idx]}"
        )


def normwise_rel_err(got: torch.Tensor, exact: torch.Tensor) -> float:
    g, e = got.to(F64), exact.to(F64)
    if not torch.isfinite(g).all():
        return math.inf
    return ((g - e).norm() / e.norm()).item()


# ------------------------------------------------------------------ number formats
def _round_on_grid(a: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """a rounded to a multiple of step, ties to the even multiple (torch.round is half-to-even)."""
    return torch.round(a / step) * step


def e4m3_value(x: torch.Tensor) -> torch.Tensor:
    """float64 -> the nearest e4m3fn value (float64), ties to even mantissa, saturating at +-448.
    e4m3fn: 3 mantissa bits; normal binades 2^-6 .. 2^8; below 2^-6 a fixed step of 2^-9."""
    x = x.to(F64)
    a = x.abs().clamp(max=E4M3_MAX)
    _, e = torch.frexp(a)  # a in [2^(e-1), 2^e)
    binade = torch.clamp(e - 1, min=-6)
    step = torch.ldexp(torch.ones_like(a), binade - 3)
    r = _round_on_grid(a, step).clamp(
        max=E4M3_MAX
    )  # 448 = 1.75 * 2^8; rounding up from it saturates
    return torch.copysign(r, x)


def e4m3_code(v: torch.Tensor) -> torch.Tensor:
    """An e4m3fn value (float64, already on the grid) -> its byte, sign bit 0x80 (set for -0.0
    too)."""
    a = v.abs()
    _, e = torch.frexp(a)
    normal = a >= 2.0**-6
    exp_field = torch.where(normal, e - 1 + 7, torch.zeros_like(e))
    mant = torch.where(normal, (a / torch.ldexp(torch.ones_like(a), e - 1) - 1.0) * 8, a * 512.0)
    code = (exp_field.to(torch.int64) << 3) | mant.round().to(torch.int64)
    sign = torch.signbit(v).to(torch.int64) << 7
    return (code | sign).to(torch.uint8)


def e2m1_code(q: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """|quotient| (float64 >= 0) -> e2m1 code: steps 0.5 below 2, 1 below 4, 2 up to 6, ties to the
    even code, saturating at 6; bit 3 set where `negative`."""
    q = q.to(F64)
    step = torch.where(q < 2.0, 0.5, torch.where(q < 4.0, 1.0, 2.0)).to(F64)
    v = _round_on_grid(q, step).clamp(max=6.0)
    code = torch.zeros_like(v, dtype=torch.int64)
    for i, value in enumerate(E2M1_GRID):
        code = torch.where(v == value, i, code)
    return (code | (negative.to(torch.int64) << 3)).to(torch.uint8)


def fp32(x: torch.Tensor) -> torch.Tensor:
    """Round float64 to fp32 and back (the conventions compute some intermediates in fp32)."""
    return x.to(torch.float32).to(F64)


# ------------------------------------------------------------------ quantizers
def fp8_codes(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x [T, H] in the activation dtype -> [T, H] uint8 e4m3fn bytes of x / scale (fp32
    quotient)."""
    quotient = fp32(x.to(F64) / fp32(torch.tensor(scale, dtype=F64)))
    return e4m3_code(e4m3_value(quotient))


def swizzle_offset(m: int, k: int, blocks: int) -> int:
    """Flat offset of (row m, block k) in the 128x4 swizzled layout (FlashInfer SWIZZLED_128x4),
    with K4 = round_up(blocks, 4) / 4."""
    k4 = -(-blocks // 4)
    return (
        (m // 128) * (k4 * 512) + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + (k % 4)
    )


def swizzle(sf_rows: torch.Tensor) -> torch.Tensor:
    """[T, blocks] scale bytes -> the [round_up(T,128), round_up(blocks,4)] swizzled tensor, padding
    0.
    The layout, as tiles: rows split (tile of 128) x (4 groups of 32) x 32, columns (tile of 4) x 4;
    in memory the order is (row tile, column tile, row % 32, row group, column % 4)."""
    tokens, blocks = sf_rows.shape
    rows, cols = -(-tokens // 128) * 128, -(-blocks // 4) * 4
    padded = torch.zeros(rows, cols, dtype=torch.uint8)
    padded[:tokens, :blocks] = sf_rows
    tiled = padded.reshape(rows // 128, 4, 32, cols // 4, 4).permute(0, 3, 2, 1, 4).contiguous()
    return tiled.reshape(rows, cols)


def nvfp4(
    x: torch.Tensor, global_scale: float, swizzled: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] in the activation dtype -> (packed uint8 [T, H/2], scale bytes linear [T, H/16] or
    swizzled)."""
    tokens, hidden = x.shape
    gs = fp32(torch.tensor(global_scale, dtype=F64))
    blocks = x.to(F64).reshape(tokens, hidden // 16, 16)
    amax = blocks.abs().amax(dim=-1)
    sf = e4m3_value(fp32(gs * fp32(amax * fp32(torch.tensor(1.0 / 6.0, dtype=F64)))))  # >= 0
    encode = torch.where(sf == 0, 0.0, fp32(1.0 / fp32(sf * fp32(1.0 / gs)))).unsqueeze(-1)
    product = fp32(blocks * encode)
    negative = torch.signbit(blocks) & ~torch.isnan(blocks)
    magnitude = torch.where(torch.isnan(product), 0.0, product.abs())
    codes = e2m1_code(magnitude, negative).reshape(tokens, hidden).to(torch.int64)
    packed = torch.zeros(tokens, hidden // 2, dtype=torch.int64)
    for i in range(hidden // 2):
        packed[:, i] = codes[:, 2 * i] | (codes[:, 2 * i + 1] << 4)
    sf_bytes = e4m3_code(sf)
    return packed.to(torch.uint8), (swizzle(sf_bytes) if swizzled else sf_bytes)


def quantize(
    x: torch.Tensor, kind: str, scale: float, swizzled: bool = True
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """kind 'fp8' (scale: the divisor) or 'nvfp4' (scale: the global scale) -> (q bytes, sf bytes or
    None)."""
    if kind == "fp8":
        return fp8_codes(x, scale), None
    return nvfp4(x, scale, swizzled)


def dequantize_nvfp4(
    packed: torch.Tensor, sf_bytes_linear: torch.Tensor, global_scale: float
) -> torch.Tensor:
    """Linear-layout scales -> float64 values (for error measurements)."""
    tokens = packed.shape[0]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(tokens, -1).to(torch.int64)
    grid = torch.tensor(E2M1_GRID, dtype=F64)
    vals = torch.where((codes & 8) != 0, -grid[codes & 7], grid[codes & 7])
    sf = e4m3_decode(sf_bytes_linear)
    return (vals.reshape(tokens, -1, 16) * (sf / global_scale).unsqueeze(-1)).reshape(tokens, -1)


def e4m3_decode(b: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3fn bytes -> float64 values, from the format's definition."""
    b = b.to(torch.int64)
    exp_field, mant = (b >> 3) & 0xF, b & 7
    mag = torch.where(
        exp_field == 0,
        mant.to(F64) * 2.0**-9,
        (1.0 + mant.to(F64) / 8) * torch.ldexp(torch.ones_like(mant, dtype=F64), exp_field - 7),
    )
    return torch.where((b & 0x80) != 0, -mag, mag)


def unswizzle(sf: torch.Tensor, tokens: int, blocks: int) -> torch.Tensor:
    """Swizzled scale bytes -> [T, blocks], by the offset formula."""
    flat = sf.reshape(-1)
    return torch.tensor(
        [[int(flat[swizzle_offset(m, k, blocks)]) for k in range(blocks)] for m in range(tokens)],
        dtype=torch.uint8,
    ).reshape(tokens, blocks)
