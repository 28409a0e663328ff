"""FP8 and NVFP4 quantization of a normalized row, in software (integer and fp32 ops).

Software conversion runs on SM90, where FlashInfer's fused FP4 writes zeros, and under the Triton
interpreter; on a GPU the fp8 cast uses the hardware's RNE conversion. Every fp32 step is one IEEE
operation (div_rn for divisions), and the e2m1 rounding compares against exact thresholds, so
results match the torch reference (fusion_bridge.oracle.quant_ref) bit for bit.

    fp8:   q = e4m3_satfinite(x / scale)
    nvfp4: per 16-element block, FlashInfer's steps with IEEE fp32 operations:
           sf = e4m3_satfinite(global_scale * (amax * fp32(1/6)));
           q = e2m1_rne_satfinite(x * (1 / (float(sf) * (1 / global_scale)))), the product
           rounded to fp32 first; the sign bit is x's (code 8 for -0.0); codes +-0 where
           sf == 0; 2 codes per byte, low nibble first; sf in FlashInfer's 128x4 swizzled layout
           (padding rows/cols written 0) or linear [T, H/16].
    NaN stays NaN: an fp8 code 0x7F, an NVFP4 block holding one gets the NaN scale 0x7F (its codes
    only signs); +-inf saturates (docs/math.md section 3).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from fusion_bridge.kernels import quant_codes as QC
from fusion_bridge.kernels.launch_cache import KernelLauncher
from fusion_bridge.kernels.quant_codes import QUANT_FP8, QUANT_NONE, QUANT_NVFP4  # noqa: F401 (re-exported)
from fusion_bridge.kernels.records import RowOutputs
from fusion_bridge.kernels.rounding import block_amax


@triton.jit
def _e4m3_rne_satfinite(v):
    """fp32 -> (e4m3 code as int32 incl. sign bit 0x80, |value| after rounding as fp32); NaN ->
    (e4m3's NaN 0x7F | v's sign bit, NaN), as torch's cast (quant_ref). The clamp keeps a NaN."""
    a = tl.minimum(tl.abs(v), QC.E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # below 2^-6 e4m3 is subnormal with a fixed step of 2^-9
    # 2^(exponent-3) (3 mantissa bits); adding 2^23 times it rounds a to that grid, ties to even
    quantum = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = quantum * 8388608.0
    r = (a + magic) - magic
    rbits = r.to(tl.int32, bitcast=True)
    normal_code = ((((rbits >> 23) & 0xFF) - 127 + 7) << 3) | ((rbits >> 20) & 7)
    subnormal_code = (r * 512.0).to(tl.int32)
    code = tl.where(r >= 0.015625, normal_code, subnormal_code)
    code = tl.where(r != r, QC.E4M3_NAN, code)
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
    return code | sign, r


@triton.jit
def _e2m1_codes(a):
    """e2m1 magnitude code of a >= 0 (fp32; NaN -> 0), round to nearest, ties to the even code,
    saturating at 6: how many of the rounding boundaries a passes (> for the boundaries below an
    odd code, >= for those below an even one: a tie goes to the even code)."""
    return (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )


@triton.jit
def _block_scale_hw(v):
    """(e4m3 code, its value as fp32) of v = global_scale * (amax * fp32(1/6)) >= 0 or NaN, as
    `_e4m3_rne_satfinite` gives them (a GPU only): the GPU's RNE satfinite conversion after the
    same clamp to 448, which keeps a NaN (converted to 0x7F). The sign bit the software form ORs in
    is 0 here: v is +0, positive, or the GPU's canonical NaN (0x7fffffff)."""
    q = tl.minimum(v, QC.E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    code = q.to(tl.float8e4nv)
    return code.to(tl.uint8, bitcast=True).to(tl.int32), code.to(tl.float32)


@triton.jit
def _nvfp4_encode_scale(sf, global_scale):
    """The multiplier that takes a block's x to e2m1 units: 1 / (sf * (1 / global_scale)), each
    step one IEEE fp32 operation as FlashInfer's kernels take them with exact reciprocals; 0 where
    sf == 0 (a block of zeros, or one whose scale underflows to 0), NaN where sf is NaN."""
    inv = tl.math.div_rn(1.0, sf * tl.math.div_rn(1.0, global_scale))
    return tl.where(sf == 0.0, 0.0, inv)


@triton.jit
def _e2m1_nibbles(p, neg):
    """The nibble of each element (e2m1 code of |p| | neg << 3, as fp32 0..15; neg 1.0 / 0.0):
    the code of `_e2m1_codes` by a binary search with no predicates. The code is how many of the
    boundaries 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 (> for the odd codes' lower bounds, >= for the
    even ones: ties to even) |p| passes; they are nested, so three comparisons find it (1.75; then
    0.75 or 3.5; then 0.25, 1.25, 2.5 or 5), each taken as 1.0 / 0.0, the next boundary and the
    code as multiply-adds of those (small exact numbers). NaN passes none: magnitude 0."""
    a = tl.abs(p)
    b2 = (a >= 1.75).to(tl.float32)
    b1 = (a >= b2 * 2.75 + 0.75).to(tl.float32)
    lower = b2 * 2.25 + 0.25  # 0.25 or 2.5
    step = b2 * 1.5 + 1.0  # 1.25 - 0.25 or 5 - 2.5
    b0 = (a > b1 * step + lower).to(tl.float32)
    return neg * 8.0 + (b2 * 4.0 + (b1 * 2.0 + b0))


@triton.jit
def _fp4_bytes(lo4, hi4, LEAN: tl.constexpr):
    """The byte lo4 | hi4 << 4 of two nibbles: int32, or with LEAN fp32 nibbles of
    `_e2m1_nibbles` (the byte in the low bits of the fp32 2^23 + byte: no conversion)."""
    if LEAN:
        return (hi4 * 16.0 + (lo4 + 8388608.0)).to(tl.int32, bitcast=True).to(tl.uint8)
    else:
        return (lo4 | (hi4 << 4)).to(tl.uint8)


@triton.jit
def _div_by_scale(y, scale):
    """div_rn(y, scale), correctly rounded, with one reciprocal per program instead of a division
    per element (on a GPU: tl.fma is one rounding there, not under the interpreter). Markstein:
    with inv = RN(1 / scale) and q0 = RN(y * inv) within one ulp of y / scale, the remainder
    r = y - scale * q0 is exact in an FMA and RN(q0 + r * inv) = RN(y / scale). Where that does not
    apply, q0 is the answer's own sign and class: y = +-0 (q0 keeps the sign of zero the FMAs lose),
    y / scale at the top of the fp32 range or past it (q0 = inf, the FMAs give NaN; inf where the
    quotient may round to the largest float: e4m3 saturates both to 448), y NaN. The remainder is
    exact while |y| >= 2^-102, and the theorem needs a normal quotient (a subnormal one may be a
    tie, or end one place off). For scale in [2^-90, 2^126] (`recip_ok`) what falls outside has
    |y / scale| < 2^-10, which e4m3 takes to +-0 either way: the codes are div_rn's."""
    inv = tl.math.div_rn(1.0, scale)
    q0 = y * inv
    q = tl.fma(tl.fma(-q0, scale, y), inv, q0)
    return tl.where((q != q) | (q0 == 0.0), q0, q)


def recip_ok(scale: float) -> bool:
    """`_div_by_scale` is exact for this fp8 scale (the kernels that quantize may pass RECIP)."""
    return 2.0**-90 <= scale <= 2.0**126


@triton.jit
def quantize_row(
    y,
    row,
    lo,
    hi,
    tokens,
    hidden,
    out,
    quant_scale,
    sf_cols,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    HW_CVT: tl.constexpr,
    WINDOW: tl.constexpr,
    RECIP: tl.constexpr = False,
    LEAN: tl.constexpr = False,
):
    """The building block (every kernel that quantizes calls it): quantize row `row` (y [BLOCK], the
    whole row already rounded to the activation dtype, 0 past H) and store it into out.q / out.sf
    (a `records.RowOutputs`).
    WINDOW False: the whole row; rows at or past `tokens` store only swizzled scale padding (zeros).
    WINDOW True: only columns [lo, hi) (multiples of 64, so the chunks of a row together also cover
    the swizzled padding columns, written 0) of a row below `tokens`.
    HW_CVT: use the GPU's round-to-nearest-even fp8 conversion (the interpreter's is not RNE, so it
    takes the software one). RECIP (HW_CVT only): fp8 divides through `_div_by_scale` (the caller
    checked `recip_ok(quant_scale)`), the same codes with no division per element. LEAN: the same
    codes in fewer instructions (the world-size-1 kernels take it; which kernel takes which form,
    and why, is docs/performance.md#one-form-per-building-block): the codes stored in the row's own
    register layout (offsets contiguous over 8 fp8 / 4 packed NVFP4 bytes only, so the store does
    not convert every row tensor of the kernel to a 16-per-thread layout), NVFP4 codes by
    `_e2m1_nibbles` (the search with no predicates) and, with HW_CVT, block scales by
    `_block_scale_hw`; y past H may then be anything, NaN included (H is a multiple of 16, so a
    block lies wholly in or past the row, and a block past H stores nothing but a zero scale)."""
    quantize_span(
        y,
        row,
        0,
        lo,
        hi,
        tokens,
        hidden,
        out,
        quant_scale,
        sf_cols,
        QUANT=QUANT,
        SWIZZLED=SWIZZLED,
        HW_CVT=HW_CVT,
        WINDOW=WINDOW,
        RECIP=RECIP,
        LEAN=LEAN,
    )


@triton.jit
def quantize_span(
    y,
    row,
    col0,
    lo,
    hi,
    tokens,
    hidden,
    out,
    quant_scale,
    sf_cols,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    HW_CVT: tl.constexpr,
    WINDOW: tl.constexpr,
    RECIP: tl.constexpr = False,
    LEAN: tl.constexpr = False,
):
    """`quantize_row` for y [BLOCK] holding columns col0 .. col0 + BLOCK of the row (col0 a
    multiple of 64; 0 past H): a program that owns only a part of a row quantizes only that part
    (WINDOW True, [lo, hi) within it). col0 = 0 is `quantize_row`."""
    BLOCK: tl.constexpr = y.shape[0]
    q_ptr, sf_ptr = out.q, out.sf
    cols = col0 + tl.arange(0, BLOCK)
    if WINDOW:
        keep = (cols < hidden) & (cols >= lo) & (cols < hi)
    else:
        keep = (cols < hidden) & ((cols * 0 + row) < tokens)  # vector form: no scalar-bool masks
    if QUANT == QC.QUANT_FP8:
        if RECIP:
            v = _div_by_scale(y.to(tl.float32), quant_scale)
        else:
            v = tl.math.div_rn(y.to(tl.float32), quant_scale)
        if HW_CVT:
            # a clamp keeping a NaN (a plain one returns the number): the conversion gives 0x7F
            v = tl.maximum(v, -QC.E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
            v = tl.minimum(v, QC.E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
            code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            code, _ = _e4m3_rne_satfinite(v)
        if LEAN:
            cols = (cols // 8) * 8 + cols % 8  # the same offsets, contiguous over 8 only
        tl.store(q_ptr + row * hidden + cols, code.to(tl.uint8), mask=keep)
    if QUANT == QC.QUANT_NVFP4:
        yb = tl.reshape(y.to(tl.float32), [BLOCK // 16, 16])
        amax = block_amax(yb, HW_CVT)
        v = quant_scale * (amax * QC.E2M1_MAX_RECIP)
        if LEAN and HW_CVT:
            sf_code, sf = _block_scale_hw(v)
        else:
            sf_code, sf = _e4m3_rne_satfinite(v)
        p = yb * _nvfp4_encode_scale(sf, quant_scale)[:, None]
        # x's sign bit (-0.0 included), none for a NaN: FlashInfer's conversion keeps the sign
        neg = (yb.to(tl.int32, bitcast=True) < 0) & (yb == yb)
        if LEAN:
            codes = _e2m1_nibbles(p, neg.to(tl.float32))
        else:
            codes = _e2m1_codes(tl.abs(p)) | (neg.to(tl.int32) << 3)
        lo4, hi4 = tl.split(tl.reshape(codes, [BLOCK // 2, 2]))
        packed = col0 // 2 + tl.arange(0, BLOCK // 2)
        kb = col0 // 16 + tl.arange(0, BLOCK // 16)
        if WINDOW:
            keep_q = (packed < hidden // 2) & (packed * 2 >= lo) & (packed * 2 < hi)
            keep_sf = (kb * 16 >= lo) & (kb * 16 < hi)
        else:
            keep_q = (packed < hidden // 2) & ((packed * 0 + row) < tokens)
            keep_sf = (kb * 0 + row) < tokens
        if LEAN:
            packed = (packed // 4) * 4 + packed % 4  # the same offsets, contiguous over 4 only
        tl.store(q_ptr + row * (hidden // 2) + packed, _fp4_bytes(lo4, hi4, LEAN), mask=keep_q)
        sf_byte = tl.where(kb < hidden // 16, sf_code, 0).to(tl.uint8)
        if SWIZZLED:
            sf_off = (
                (row // 128) * (sf_cols * 128)
                + (kb // 4) * 512
                + (row % 32) * 16
                + ((row % 128) // 32) * 4
                + (kb % 4)
            )
            if WINDOW:
                tl.store(sf_ptr + sf_off, sf_byte, mask=(kb < sf_cols) & keep_sf)
            else:  # padding rows too
                tl.store(sf_ptr + sf_off, sf_byte, mask=kb < sf_cols)
        else:
            tl.store(
                sf_ptr + row * (hidden // 16) + kb, sf_byte, mask=(kb < hidden // 16) & keep_sf
            )


@triton.jit
def _quantize_kernel(
    x_ptr,
    out,
    tokens,
    hidden,
    quant_scale,
    sf_cols,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    BLOCK: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    """x [T, H] -> out.q / out.sf (out: a `records.RowOutputs`, residual_out and norm_out
    None)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    y = tl.load(
        x_ptr + row * hidden + cols, mask=(cols < hidden) & ((cols * 0 + row) < tokens), other=0.0
    )
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


def sf_padding_items(tokens: int, sf_rows: int, sf_cols: int) -> int:
    """Items of `sf_padding_item` that cover swizzled scale rows T .. sf_rows."""
    return triton.cdiv(max(sf_rows - tokens, 0), 32) * triton.cdiv(sf_cols, 128)


@triton.jit
def sf_padding_item(item, sf_ptr, tokens, sf_rows, sf_cols):
    """Swizzled scale padding rows T .. round_up(T, 128) -> 0, for kernels whose programs do not map
    to rows; item = (32 padding rows, 128 scale columns): few items, so T=1 (127 padding rows) costs
    a store or two per program, not a loop."""
    kchunks = tl.cdiv(sf_cols, 128)
    row = tokens + (item // kchunks) * 32 + tl.arange(0, 32)[:, None]
    kb = (item % kchunks) * 128 + tl.arange(0, 128)[None, :]
    off = (
        (row // 128) * (sf_cols * 128)
        + (kb // 4) * 512
        + (row % 32) * 16
        + ((row % 128) // 32) * 4
        + (kb % 4)
    )
    tl.store(
        sf_ptr + off, tl.zeros([32, 128], dtype=tl.uint8), mask=(kb < sf_cols) & (row < sf_rows)
    )


def row_block(hidden: int) -> int:
    # >= 64 so the BLOCK/16 scale blocks always cover round_up(H/16, 4) swizzled columns
    return max(64, triton.next_power_of_2(hidden))


def row_num_warps(block: int, quant: int = QUANT_NONE) -> int:
    """Warps per row program, from the H200 sweeps at H=7168: fp8 is issue-bound and wants the
    most threads (32 warps), nvfp4 is best at 8 (the times:
    docs/performance.md#figures-behind-the-codes-choices)."""
    if quant == QUANT_FP8:
        return max(4, min(32, block // 256))
    return 4 if block <= 2048 else (8 if block <= 4096 or quant == QUANT_NVFP4 else 16)


def launch_rows(quant: int, swizzled: bool, tokens: int, sf: torch.Tensor) -> int:
    """Programs to launch: one per token, or per swizzled scale row (padding rows get zeros)."""
    return sf.shape[0] if quant == QUANT_NVFP4 and swizzled else tokens


@functools.lru_cache(maxsize=256)
def row_launch_shape(
    hidden: int, quant: int, swizzled: bool, hw_cvt: bool, num_warps: Optional[int] = None
) -> tuple[tuple, int]:
    """(constexprs (QUANT, SWIZZLED, BLOCK, HW_CVT), num_warps) of a row kernel: fixed per spec,
    computed once."""
    block = row_block(hidden)
    return (quant, swizzled, block, hw_cvt), num_warps or row_num_warps(block, quant)


_LAUNCH = KernelLauncher(_quantize_kernel, ("QUANT", "SWIZZLED", "BLOCK", "HW_CVT"))


def quantize_into(
    q: torch.Tensor,
    sf: torch.Tensor,
    x: torch.Tensor,
    quant: int,
    quant_scale: float,
    swizzled: bool,
) -> None:
    """x [T, H] activation dtype -> q (uint8 view: [T, H] fp8 codes or [T, H/2] packed fp4), sf."""
    tokens, hidden = x.shape
    if tokens == 0 or quant == QUANT_NONE:
        return
    constexprs, warps = row_launch_shape(hidden, quant, swizzled, x.is_cuda)
    sf_cols = sf.shape[1] if quant == QUANT_NVFP4 else 0
    _LAUNCH(
        (launch_rows(quant, swizzled, tokens, sf),),
        (x, RowOutputs(None, None, q, sf), tokens, hidden, float(quant_scale), sf_cols),
        constexprs,
        warps,
    )
