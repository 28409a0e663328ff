"""The row epilogue that the world-size-1 kernels (kernels/tp1/) and the one-shot exchange kernel
(kernels/symm/oneshot.py) share: a row's top-k finalize + shared add kept in registers and rounded
once as a published partial would be, the residual add, the norm and the quantized outputs
(`row_outputs`), and the L2 prefetch of a row before its gathers (`prefetch_row`). Built from the
shared blocks (finalize_add.finalize_row, add_rmsnorm.rms_norm_row / rms_apply,
quant.quantize_row / quantize_span; the forms each kernel takes:
docs/performance.md#one-form-per-building-block). Every helper takes the kernels' records
(kernels/records.py): src a RowSource, out a RowOutputs, scalars the LayerScalars, FORM the
RowForm.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusion_bridge.kernels.add_rmsnorm import norm_quant_row
from fusion_bridge.kernels.finalize_add import finalize_row
from fusion_bridge.kernels.rounding import round_cast, round_to


@triton.jit
def prefetch_l2(ptrs, mask):
    """Ask L2 for the 32-byte sector at each pointer where mask (GPU only: inline PTX). No register
    holds a result, so the compiler cannot postpone it to where the data is used, as it postpones
    a row's K gathers one behind the other to keep registers free."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "=r,l,r",
        [ptrs, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def prefetch_row(src, row, lo, hidden, SPAN: tl.constexpr, FORM: tl.constexpr):
    """Prefetch into L2 what the row's finalize reads of columns [lo, lo + SPAN) of `row` (the K
    gathered rows, the shared output, the residual): one sector per 16 columns, so every DRAM
    request of the row is in flight at once and the gathers that follow, one behind the other,
    hit L2."""
    KP: tl.constexpr = triton.next_power_of_2(FORM.TOP_K)
    cols = lo + tl.arange(0, SPAN // 16)[None, :] * 16
    ok = cols < hidden
    slot = tl.arange(0, KP)[:, None]  # every slot's routing loaded at once, not one by one
    src_row = tl.load(src.perm + row * FORM.TOP_K + slot, mask=slot < FORM.TOP_K, other=-1)
    src_row = src_row.to(tl.int64)
    prefetch_l2(src.gemm2_out + src_row * hidden + cols, ok & (src_row >= 0))
    if FORM.HAS_SHARED:
        prefetch_l2(src.shared + row * hidden + cols, ok)
    prefetch_l2(src.residual + row * hidden + cols, ok)


@triton.jit
def row_outputs(
    s, row, lo, hi, bad, tokens, hidden, src, out, scalars, sf_cols, FORM: tl.constexpr
):  # fmt: skip
    """From the row's summed partials s (fp32 [ROW_BLOCK]): the whole row's x = residual + s and
    its norm (each program of the row computes them identically), stored for columns [lo, hi) only
    (multiples of 64, so the masks stay constant over whole 16-byte vectors). bad != 0
    writes NaN."""
    dtype: tl.constexpr = out.residual_out.dtype.element_ty
    cols = tl.arange(0, FORM.ROW_BLOCK)
    in_row = cols < hidden
    offs = row * hidden + cols
    x = tl.load(src.residual + offs, mask=in_row, other=0.0).to(tl.float32) + s
    x = tl.where((cols * 0 + bad) != 0, float("nan"), x)
    tl.store(out.residual_out + offs, round_to(x, dtype), mask=in_row & (cols >= lo) & (cols < hi))
    g = tl.load(src.gamma + cols, mask=in_row, other=0.0).to(tl.float32) + scalars.weight_bias
    norm_quant_row(x, g, row, lo, hi, tokens, hidden, out, scalars, sf_cols, FORM)


@triton.jit
def residual_plus_finalize(
    src, row, cols, hidden, scalars, FORM: tl.constexpr, dtype: tl.constexpr
):  # fmt: skip
    """fp32 x = residual + round(finalize) on `cols` of `row` (0 past H), the row's finalize
    rounded once as a published partial would be: the world-size-1 kernels' x. The finalize in
    its SELECT_ONCE form, its products rounded on their own on a GPU (finalize_row)."""
    acc = finalize_row(
        src,
        row,
        cols,
        hidden,
        scalars.routed_scaling,
        TOP_K=FORM.TOP_K,
        HAS_SHARED=FORM.HAS_SHARED,
        SELECT_ONCE=True,
        GPU_MUL_RN=FORM.HW_CVT,
    )
    # one offset, as the callers' stores form it: the whole-row kernel then compiles to the same
    # machine code as when it spelled this out itself (measured)
    res = tl.load(src.residual + (row * hidden + cols), mask=cols < hidden, other=0.0)
    return res.to(tl.float32) + round_cast(acc, dtype, HW_CVT=FORM.HW_CVT).to(tl.float32)
