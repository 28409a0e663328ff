"""The quant mode as our kernels take it (an int constexpr) and as the spec names it: the one map.

Imports no Triton, so strategies and capability code can use it without loading a kernel.

    code 0 none; 1 fp8 (scale is the divisor); 2 nvfp4 (scale is the global scale)
"""

from __future__ import annotations

from typing import NamedTuple

from fusion_bridge.spec import EpilogueSpec, QuantKind, SFLayout

QUANT_NONE, QUANT_FP8, QUANT_NVFP4 = 0, 1, 2

# the number formats' special values, as the kernels read them (`quant_codes.E4M3_MAX` inside a
# kernel: a module attribute, which Triton folds at compile time without re-checking it per
# launch, unlike a constexpr global; the launch cache needs that)
E4M3_MAX = 448.0  # the largest finite e4m3 magnitude (satfinite clamps to it)
E4M3_NAN = 0x7F  # e4m3's NaN code (| the sign bit 0x80)
# fp32(1 / 6), exactly (6: the largest e2m1 magnitude): an NVFP4 block's scale is
# global_scale * (amax * E2M1_MAX_RECIP), a product as FlashInfer's kernels take it (no division)
E2M1_MAX_RECIP = 0.16666667163372040
_CODE = {QuantKind.NONE: QUANT_NONE, QuantKind.FP8: QUANT_FP8, QuantKind.NVFP4: QUANT_NVFP4}
_KIND = {code: kind for kind, code in _CODE.items()}


class QuantArgs(NamedTuple):
    """What a kernel needs of the spec's quantization: code, scale, swizzled NVFP4 scales?"""

    code: int
    scale: float
    swizzled: bool


def quant_args(spec: EpilogueSpec) -> QuantArgs:
    q = spec.quant
    scale = {QuantKind.FP8: q.scale, QuantKind.NVFP4: q.global_scale}.get(q.kind, 1.0)
    return QuantArgs(_CODE[q.kind], float(scale), q.sf_layout is SFLayout.SWIZZLED_128x4)


def kind_layout(code: int, swizzled: bool) -> tuple[QuantKind, SFLayout]:
    """A kernel's quant code and swizzle flag as the spec's enums."""
    return _KIND[code], SFLayout.SWIZZLED_128x4 if swizzled else SFLayout.LINEAR
