"""Dynamic FP8 quantization of a normalized row or span: per token group and per token, the
formula of vLLM 0.34's Triton `_per_token_group_quant_fp8` with the same IEEE fp32 operations as
the torch reference (fusion_bridge.oracle.quant_ref.quantize_fp8_per_token_group), so the codes
and scales match it bit for bit:

    per group of GROUP contiguous elements: amax = max |x| (NaN if the group holds one)
    scale = max(amax, 1e-10) * fp32(1/448)          (a product, no division)
    q     = e4m3(clamp(div_rn(x, scale), -448, 448))   (round to nearest even)
    a NaN group gets the NaN scale (0x7FC00000) and codes 0x7F; every NaN code is 0x7F

On a GPU the quotient takes one reciprocal per group (`_div_by_group_scale`: the codes of div_rn)
and the conversion is the hardware's; under the Triton interpreter both are done in software.

Per token is the same with the whole row as one group (GROUP = the row's block: every program
that calls it holds the whole row). `fused_tp1`'s split rows, where a program holds one chunk of
the row, take per token through `chunk_amax_bits` (a chunk's amax, exchanged between the row's
programs: kernels/tp1/split_rows.py) and `quantize_chunk_fp8_per_token` (the chunk's codes from
the row's amax): the same scale and codes.

Scales are fp32, stored in the layout's storage (docs/math.md section 3): row_major [T, G]
(`sf_stride` = G), column_major [G, T] (`sf_stride` = T), column_major_tma [G, round_up(T, 4)]
(`sf_stride` = round_up(T, 4); the padding columns, rows T .. round_up(T, 4) of the view, are
written 0 by the programs past T).
"""

from __future__ import annotations

import triton.language as tl
import triton

from fusion_bridge.kernels import quant_codes as QC
from fusion_bridge.kernels.quant import _e4m3_rne_satfinite
from fusion_bridge.kernels.rounding import block_amax


@triton.jit
def _div_by_group_scale(xg, scale):
    """div_rn(xg, scale[:, None]) as e4m3 sees it, with one reciprocal per group (a GPU only: its
    fma rounds once): fp8_group_quant._div_exact's Markstein steps (exact for a normal quotient;
    one that is not is below 2^-10 in magnitude, +-0 in e4m3 either way) with one of its two
    fix-ups. Here |x| <= amax, so no quotient is near the top of the fp32 range, and q is NaN only
    where x or scale is NaN (q0 NaN too: code 0x7F either way) or where scale is +inf (a group
    holding +-inf: q0 is +-0 for its finite x, NaN for +-inf). Where q0 is +-0 it is the answer:
    the FMAs lose the sign of zero, and give NaN for a finite x over inf."""
    inv = tl.math.div_rn(1.0, scale)[:, None]
    s = tl.broadcast_to(scale[:, None], xg.shape)
    q0 = xg * inv
    q = tl.fma(tl.fma(-q0, s, xg), inv, q0)
    return tl.where(q0 == 0.0, q0, q)


@triton.jit
def _store_where_held(ptrs, values, mask):
    """tl.store(ptrs, values (fp32), mask) on a GPU, as inline PTX: every thread stores the
    values it holds, in the layout the group reduction left them (a group's scale is held by each
    of the lanes that reduced it, and they all store the same bytes), where tl.store would first
    move them into its own layout through shared memory, between two barriers."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r,r",
        [ptrs, values.to(tl.int32, bitcast=True), mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def fp8_dynamic_scale(amax):
    """The fp32 scales [GROUPS] of groups whose amax (NaN-keeping) is `amax` [GROUPS]."""
    scale = tl.maximum(amax, QC.FP8_AMAX_EPS) * QC.E4M3_MAX_RECIP
    scale = tl.where(amax != amax, float("nan"), scale)  # the engines' max would drop the NaN
    return scale


@triton.jit
def fp8_dynamic_codes(xg, scale, HW_CVT: tl.constexpr):
    """The e4m3 codes (uint8 [GROUPS, GROUP]) of xg (fp32 [GROUPS, GROUP]) divided by its groups'
    scales (fp32 [GROUPS], `fp8_dynamic_scale`): e4m3(clamp(div_rn(x, scale), -448, 448)), every
    NaN quotient 0x7F."""
    if HW_CVT:
        # the quotient through one reciprocal per group, then a clamp keeping a NaN (a plain one
        # returns the number): the GPU's RNE conversion takes the canonical NaN the clamp returns
        # for every NaN quotient to 0x7F
        v = _div_by_group_scale(xg, scale)
        c = tl.maximum(v, -QC.E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
        c = tl.minimum(c, QC.E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
        code = c.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        v = tl.math.div_rn(xg, scale[:, None])
        code, _ = _e4m3_rne_satfinite(v)
        code = tl.where(v != v, QC.E4M3_NAN, code)  # every NaN code 0x7F, whatever the NaN's sign
    return code


@triton.jit
def quantize_span_fp8_dynamic(
    y,
    row,
    col0,
    lo,
    hi,
    tokens,
    hidden,
    out,
    sf_stride,
    GROUP: tl.constexpr,
    LAYOUT: tl.constexpr,
    HW_CVT: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Quantize y [BLOCK] (columns col0 .. col0 + BLOCK of `row`, already rounded to the activation
    dtype; anything past H, NaN included, is ignored) into out.q (uint8 [T, H] codes) and out.sf
    (the fp32 scales' storage, `sf_stride` as in the module docstring). GROUP: elements per scale,
    a power of two dividing BLOCK (col0 a multiple of it); GROUP == BLOCK with col0 = 0 is one
    scale per row (per token). LAYOUT: quant_codes.SCALE_ROW_MAJOR / SCALE_COLUMN_MAJOR /
    SCALE_COLUMN_MAJOR_TMA.
    WINDOW False: the whole span; a row at or past `tokens` stores no codes and, in the TMA layout,
    zero scales (its padding column) while row < sf_stride.
    WINDOW True: only columns [lo, hi) (whole groups) of a row below `tokens`."""
    BLOCK: tl.constexpr = y.shape[0]
    GROUPS: tl.constexpr = BLOCK // GROUP
    cols = col0 + tl.arange(0, BLOCK)
    in_row = cols < hidden
    rows = cols * 0 + row  # vector form: the interpreter rejects a scalar-bool mask
    if WINDOW:
        keep = in_row & (cols >= lo) & (cols < hi)
    else:
        keep = in_row & (rows < tokens)
    xg = tl.reshape(y.to(tl.float32), [GROUPS, GROUP])
    if GROUPS == 1:
        # one group, the whole block (per token): its columns past H are no part of the row. With
        # several, H is a multiple of GROUP (the spec's rule): a group lies wholly in the row or
        # wholly past it, and one past it stores nothing
        xg = tl.where(tl.reshape(in_row, [GROUPS, GROUP]), xg, 0.0)
    amax = block_amax(xg, HW_CVT)  # NaN where the group holds one
    scale = fp8_dynamic_scale(amax)
    code = fp8_dynamic_codes(xg, scale, HW_CVT)
    # the same offsets, contiguous over 8 only: the codes stored in the row's own register layout
    # (8 per thread, as its bf16 stores want), not the whole row in a 16-per-thread one
    lean = (cols // 8) * 8 + cols % 8
    tl.store(out.q + row * hidden + lean, tl.reshape(code, [BLOCK]).to(tl.uint8), mask=keep)
    gi = col0 // GROUP + tl.arange(0, GROUPS)
    start = gi * GROUP
    g_rows = gi * 0 + row
    if LAYOUT == QC.SCALE_ROW_MAJOR:
        offs = row * sf_stride + gi
    else:
        offs = gi * sf_stride + row
    if WINDOW:
        keep_s = (start < hidden) & (start >= lo) & (start < hi)
    elif LAYOUT == QC.SCALE_COLUMN_MAJOR_TMA:
        keep_s = (start < hidden) & (g_rows < sf_stride)  # the padding rows too
    else:
        keep_s = (start < hidden) & (g_rows < tokens)
    sf = tl.where(g_rows < tokens, scale, 0.0)
    if HW_CVT and GROUPS > 1:  # (one group: its scale needs no move, and would be stored by all)
        _store_where_held(out.sf + offs, sf, keep_s)
    else:
        tl.store(out.sf + offs, sf, mask=keep_s)


@triton.jit
def tma_padding_row(row, hidden, out, sf_stride, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """Zero the TMA layout's scales of padding row `row` (T <= row < round_up(T, 4)): for kernels
    whose padding programs hold no row (fused_tp1's split rows)."""
    gi = tl.arange(0, BLOCK // GROUP)
    tl.store(out.sf + gi * sf_stride + row, tl.zeros([BLOCK // GROUP], dtype=tl.float32),
             mask=(gi * GROUP < hidden) & ((gi * 0 + row) < sf_stride))  # fmt: skip


@triton.jit
def chunk_amax_bits(y, col0, hidden):
    """Per token in split rows: the bits (int32 scalar) of max |y| over a chunk's columns of the
    row (y [BLOCK]: columns col0 .. col0 + BLOCK, those past H ignored). The bits of a
    non-negative fp32 order as its value does, and a NaN's (sign cleared) lie above +inf's, so the
    integer max of the row's chunks' bits is the bits of the whole row's NaN-keeping amax (the
    `block_amax` of a whole-row program), exactly and in any order."""
    cols = col0 + tl.arange(0, y.shape[0])
    bits = y.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.max(tl.where(cols < hidden, bits, 0), axis=0)


@triton.jit
def quantize_chunk_fp8_per_token(y, row, col0, hidden, out, amax, sf_stride, HW_CVT: tl.constexpr):
    """Per token in split rows: one chunk of `row` (y [BLOCK], columns col0 .. col0 + BLOCK,
    rounded to the activation dtype; past H ignored) quantized with the row's one scale, from
    `amax` (fp32 scalar: the whole row's NaN-keeping amax, from every chunk's `chunk_amax_bits`),
    into out.q (uint8 [T, H]); the row's first chunk (col0 == 0) stores the scale at
    out.sf[row * sf_stride] (scales [T, 1]). The same codes and scale, bit for bit, as
    `quantize_span_fp8_dynamic` gives the whole row (GROUP = the row's block)."""
    BLOCK: tl.constexpr = y.shape[0]
    cols = col0 + tl.arange(0, BLOCK)
    scale = fp8_dynamic_scale(tl.zeros([1], dtype=tl.float32) + amax)
    code = fp8_dynamic_codes(tl.reshape(y.to(tl.float32), [1, BLOCK]), scale, HW_CVT)
    lean = (cols // 8) * 8 + cols % 8  # the row's own register layout, as the whole span's
    tl.store(
        out.q + row * hidden + lean, tl.reshape(code, [BLOCK]).to(tl.uint8), mask=cols < hidden
    )
    if col0 == 0:
        tl.store(out.sf + row * sf_stride + tl.arange(0, 1), scale)
