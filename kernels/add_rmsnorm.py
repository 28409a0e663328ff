"""Fused residual add + RMSNorm (+ FP8 or NVFP4 quantization, see quant.py; dynamic FP8 per
token group or per token, see quant_dynamic.py), one program per token row.

x            = residual + reduced                       (fp32)
residual_out = round(x)
norm_out     = round(x * rsqrt(mean(x^2) + eps) * (gamma + weight_bias))  (overflow-safe, see below)
quant        = quantize(norm_out)                       (reads the rounded norm_out)
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from fusion_bridge.kernels import quant_codes as QC
from fusion_bridge.kernels.launch_cache import KernelLauncher
from fusion_bridge.kernels.quant import QUANT_NVFP4, launch_rows, quantize_row, row_launch_shape
from fusion_bridge.kernels.quant_dynamic import quantize_span_fp8_dynamic
from fusion_bridge.kernels.records import RowOutputs
from fusion_bridge.kernels.rounding import round_to


@triton.jit
def rms_apply(x, g, sum_sq, hidden, eps):
    """x * rsqrt(sum_sq / hidden + eps) * g in fp32: the norm of a row (or of a part of it) whose
    sum of squares is known. The one formula `rms_norm_row` and the split-row kernel share."""
    return x * tl.rsqrt(sum_sq / hidden + eps) * g


@triton.jit
def overflow_scale(amax_exp):
    """The power of two s bringing a row whose largest magnitude has the biased fp32 exponent
    amax_exp into [2^31, 2^32) (see `rms_norm_row`)."""
    return ((tl.minimum(tl.maximum(285 - amax_exp, 1), 254)) << 23).to(tl.float32, bitcast=True)


@triton.jit
def rms_norm_row(x, g, hidden, eps):
    """The building block (every kernel of ours that norms a whole row calls it): fp32 x [BLOCK]
    (0 past H), g = gamma + weight_bias (0 past H) -> x * rsqrt(mean(x^2) + eps) * g in fp32, not
    rounded.

    Overflow-safe: a finite row with |x| >~ 1.8e19 (bf16 holds up to 3.4e38) overflows the fp32
    sum of squares, and rsqrt(inf) = 0 would zero the row. Such a row is scaled by the power of two
    s bringing its largest magnitude into [2^31, 2^32) (exact), with eps*s^2 in place of eps. The
    branch is uniform over the program and taken only then; every other row computes the plain
    formula (a branch-free form, two more row reductions for every row, measured slower in the
    world-size-1 kernel: docs/performance.md#world-size-1-fused_tp1)."""
    sum_sq = tl.sum(x * x, axis=0)
    y = rms_apply(x, g, sum_sq, hidden, eps)
    if sum_sq == float("inf"):
        s = overflow_scale((tl.max(tl.abs(x), axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF)
        x_s = x * s
        y = rms_apply(x_s, g, tl.sum(x_s * x_s, axis=0), hidden, eps * s * s)
    return y


@triton.jit
def _add_rmsnorm_kernel(
    residual_ptr,
    reduced_ptr,
    gamma_ptr,
    out,
    tokens,
    hidden,
    eps,
    weight_bias,
    quant_scale,
    sf_cols,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    BLOCK: tl.constexpr,
    HW_CVT: tl.constexpr,
    GROUP: tl.constexpr = 0,
    SCALE_LAYOUT: tl.constexpr = 0,
):
    """One program per row (and per swizzled scale padding row, or TMA scale padding row): residual
    + reduced -> out (a `records.RowOutputs`). GROUP, SCALE_LAYOUT: the dynamic FP8 kinds'
    (`records.RowForm`); sf_cols is then their scales' stride."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    # programs past T only write the swizzled scale padding; vector form of `row < tokens` because
    # the interpreter rejects a scalar-bool mask
    mask = (cols < hidden) & ((cols * 0 + row) < tokens)
    offs = row * hidden + cols
    x = tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(reduced_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out.residual_out + offs, round_to(x, out.residual_out.dtype.element_ty), mask=mask)
    g = tl.load(gamma_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32) + weight_bias
    y = round_to(rms_norm_row(x, g, hidden, eps), out.norm_out.dtype.element_ty)
    tl.store(out.norm_out + offs, y, mask=mask)
    if QUANT >= QC.QUANT_FP8_GROUP:
        quantize_span_fp8_dynamic(
            y, row, 0, 0, BLOCK, tokens, hidden, out, sf_cols,
            GROUP=GROUP, LAYOUT=SCALE_LAYOUT, HW_CVT=HW_CVT, WINDOW=False,
        )  # fmt: skip
    else:
        quantize_row(
            y,
            row,
            0,
            BLOCK,
            tokens,
            hidden,
            out,
            quant_scale,
            sf_cols,
            QUANT=QUANT,
            SWIZZLED=SWIZZLED,
            HW_CVT=HW_CVT,
            WINDOW=False,
        )


@triton.jit
def norm_quant_row(x, g, row, lo, hi, tokens, hidden, out, scalars, sf_cols, FORM: tl.constexpr):
    """x: fp32 [ROW_BLOCK], the whole row (0 past H, row < tokens); g: gamma + weight_bias; out: a
    `records.RowOutputs`, scalars: `records.LayerScalars` (eps, quant_scale read), FORM:
    `records.RowForm`. Stores norm_out = round(rms_norm_row(x)) and its FP8 / NVFP4 codes for
    columns [lo, hi) only (multiples of 64): the programs that share a row each compute the whole
    row's norm and store their part."""
    cols = tl.arange(0, FORM.ROW_BLOCK)
    in_row = cols < hidden
    y = round_to(rms_norm_row(x, g, hidden, scalars.eps), out.norm_out.dtype.element_ty)
    tl.store(out.norm_out + row * hidden + cols, y, mask=in_row & (cols >= lo) & (cols < hi))
    if FORM.QUANT == QC.QUANT_NVFP4:
        y = tl.where(in_row, y, 0.0)  # a NaN row (failed wait) stays NaN only inside the row
    quantize_row(
        y,
        row,
        lo,
        hi,
        tokens,
        hidden,
        out,
        scalars.quant_scale,
        sf_cols,
        QUANT=FORM.QUANT,
        SWIZZLED=FORM.SWIZZLED,
        HW_CVT=FORM.HW_CVT,
        WINDOW=True,
    )


_LAUNCH = KernelLauncher(
    _add_rmsnorm_kernel, ("QUANT", "SWIZZLED", "BLOCK", "HW_CVT", "GROUP", "SCALE_LAYOUT")
)


def add_rmsnorm_into(
    residual_out: torch.Tensor,
    norm_out: torch.Tensor,
    q: torch.Tensor,
    sf: torch.Tensor,
    residual: torch.Tensor,
    reduced: torch.Tensor,
    gamma: torch.Tensor,
    *,
    eps: float,
    weight_bias: float,
    quant: int,
    quant_scale: float,
    swizzled: bool,
    group: int = 0,
    scale_layout: int = QC.SCALE_ROW_MAJOR,
    num_warps: Optional[int] = None,
) -> None:
    """Launch into preallocated outputs. q: uint8 view ([T, H] fp8 codes or [T, H/2] packed fp4);
    sf: uint8 scales (nvfp4), or the fp32 scale view of a dynamic FP8 kind (group: the spec's
    group size, 0 per token; scale_layout: quant_codes.SCALE_*). Unused q/sf may be any tensor.
    T == 0 launches nothing. num_warps overrides the launch shape (benchmark sweeps)."""
    tokens, hidden = residual.shape
    if tokens == 0:
        return
    constexprs, warps = row_launch_shape(hidden, quant, swizzled, residual.is_cuda, num_warps)
    rows = launch_rows(quant, swizzled, tokens, sf)
    sf_cols = sf.shape[1] if quant == QUANT_NVFP4 else 0
    dynamic = (0, QC.SCALE_ROW_MAJOR)
    if QC.is_dynamic(quant):
        rows, sf_cols = QC.dynamic_scale_dims(tokens, hidden, group, scale_layout)
        dynamic = (group or constexprs[2], scale_layout)  # per token: the row's block
    _LAUNCH(
        (rows,),
        (
            residual,
            reduced,
            gamma,
            RowOutputs(residual_out, norm_out, q, sf),
            tokens,
            hidden,
            float(eps),
            float(weight_bias),
            float(quant_scale),
            sf_cols,
        ),
        constexprs + dynamic,
        warps,
    )
