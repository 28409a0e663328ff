"""The quant mode as our kernels take it (an int constexpr) and as the spec names it: the one map.

Imports no Triton, so strategies and capability code can use it without loading a kernel.

    code 0 none; 1 fp8 (scale is the divisor); 2 nvfp4 (scale is the global scale);
    3 fp8 per token group (`group` elements per scale, scales in `scale_layout`: SCALE_ROW_MAJOR /
    SCALE_COLUMN_MAJOR / SCALE_COLUMN_MAJOR_TMA); 4 fp8 per token (one scale per row, [T, 1])
"""

from __future__ import annotations

from typing import NamedTuple

from fusion_bridge.spec import EpilogueSpec, QuantKind, ScaleLayout, SFLayout

QUANT_NONE, QUANT_FP8, QUANT_NVFP4 = 0, 1, 2
QUANT_FP8_GROUP, QUANT_FP8_TOKEN = 3, 4  # dynamic FP8 (vLLM's _per_token_group_quant_fp8)
SCALE_ROW_MAJOR, SCALE_COLUMN_MAJOR, SCALE_COLUMN_MAJOR_TMA = 0, 1, 2  # ScaleLayout, in order

# the number formats' special values, as the kernels read them (`quant_codes.E4M3_MAX` inside a
# kernel: a module attribute, which Triton folds at compile time without re-checking it per
# launch, unlike a constexpr global; the launch cache needs that)
E4M3_MAX = 448.0  # the largest finite e4m3 magnitude (satfinite clamps to it)
E4M3_NAN = 0x7F  # e4m3's NaN code (| the sign bit 0x80)
# fp32(1 / 6), exactly (6: the largest e2m1 magnitude): an NVFP4 block's scale is
# global_scale * (amax * E2M1_MAX_RECIP), a product as FlashInfer's kernels take it (no division)
E2M1_MAX_RECIP = 0.16666667163372040
# fp32(1 / 448), exactly: a dynamic FP8 group's scale is max(amax, FP8_AMAX_EPS) * E4M3_MAX_RECIP,
# a product as vLLM's kernel takes it (no division); FP8_AMAX_EPS is fp32(1e-10) as written
E4M3_MAX_RECIP = 0.0022321429569274187
FP8_AMAX_EPS = 1e-10
_CODE = {
    QuantKind.NONE: QUANT_NONE,
    QuantKind.FP8: QUANT_FP8,
    QuantKind.NVFP4: QUANT_NVFP4,
    QuantKind.FP8_PER_TOKEN_GROUP: QUANT_FP8_GROUP,
    QuantKind.FP8_PER_TOKEN: QUANT_FP8_TOKEN,
}
_KIND = {code: kind for kind, code in _CODE.items()}
_LAYOUT = {layout: i for i, layout in enumerate(ScaleLayout)}


class QuantArgs(NamedTuple):
    """What a kernel needs of the spec's quantization: code, scale, swizzled NVFP4 scales?, and
    for the dynamic FP8 kinds the group size (0 per token or without them) and the scale layout
    (SCALE_ROW_MAJOR ...)."""

    code: int
    scale: float
    swizzled: bool
    group: int = 0
    scale_layout: int = SCALE_ROW_MAJOR


def quant_args(spec: EpilogueSpec) -> QuantArgs:
    q = spec.quant
    scale = {QuantKind.FP8: q.scale, QuantKind.NVFP4: q.global_scale}.get(q.kind, 1.0)
    return QuantArgs(
        _CODE[q.kind],
        float(scale),
        q.sf_layout is SFLayout.SWIZZLED_128x4,
        q.group_size or 0,
        _LAYOUT.get(q.scale_layout, SCALE_ROW_MAJOR),
    )


def is_dynamic(code: int) -> bool:
    """The code of a dynamic FP8 kind (scales computed per group or per token)."""
    return code in (QUANT_FP8_GROUP, QUANT_FP8_TOKEN)


def dynamic_scale_dims(tokens: int, hidden: int, group: int, scale_layout: int) -> tuple[int, int]:
    """(rows a whole-row launch covers, the scales' stride between rows or groups) of a dynamic
    FP8 kind: row_major (T, G: a row's scales are contiguous); column_major (T, T: a group's);
    column_major_tma (round_up(T, 4), round_up(T, 4): the padding rows' scales written 0)."""
    groups = hidden // group if group else 1
    if scale_layout == SCALE_ROW_MAJOR:
        return tokens, groups
    if scale_layout == SCALE_COLUMN_MAJOR:
        return tokens, tokens
    padded = -(-tokens // 4) * 4
    return padded, padded


def kind_layout(code: int, swizzled: bool) -> tuple[QuantKind, SFLayout]:
    """A kernel's quant code and swizzle flag as the spec's enums."""
    return _KIND[code], SFLayout.SWIZZLED_128x4 if swizzled else SFLayout.LINEAR
