"""The row epilogue that the world-size-1 kernels (kernels/tp1/) and the one-shot exchange kernel
(kernels/symm/oneshot.py) share: a row's top-k finalize + shared add kept in registers and rounded
once as a published partial would be, the residual add, the norm and the quantized outputs
(`row_outputs`), and the L2 prefetch of a row before its gathers (`prefetch_row`). Built from the
shared blocks (finalize_add.finalize_row, add_rmsnorm.rms_norm_row / rms_apply,
quant.quantize_row / quantize_span) in their leaner forms (SELECT_ONCE, LEAN, RECIP: the same bits
in fewer instructions; rounding.round_cast).
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
def prefetch_row(
    gemm2_ptr,
    perm_ptr,
    shared_ptr,
    residual_ptr,
    row,
    lo,
    hidden,
    SPAN: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
):
    KP: tl.constexpr = triton.next_power_of_2(TOP_K)
    """Prefetch into L2 what `_chunk_x` reads of columns [lo, lo + SPAN) of `row` (the K gathered
    rows, the shared output, the residual): one sector per 16 columns, so every DRAM request of
    the row is in flight at once and the gathers that follow, one behind the other, hit L2."""
    cols = lo + tl.arange(0, SPAN // 16)[None, :] * 16
    ok = cols < hidden
    slot = tl.arange(0, KP)[:, None]  # every slot's routing loaded at once, not one by one
    src = tl.load(perm_ptr + row * TOP_K + slot, mask=slot < TOP_K, other=-1).to(tl.int64)
    prefetch_l2(gemm2_ptr + src * hidden + cols, ok & (src >= 0))
    if HAS_SHARED:
        prefetch_l2(shared_ptr + row * hidden + cols, ok)
    prefetch_l2(residual_ptr + row * hidden + cols, ok)


@triton.jit
def row_outputs(
    s,
    row,
    lo,
    hi,
    bad,
    tokens,
    residual_ptr,
    gamma_ptr,
    residual_out_ptr,
    norm_out_ptr,
    q_ptr,
    sf_ptr,
    hidden,
    eps,
    weight_bias,
    quant_scale,
    sf_cols,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    HW_CVT: tl.constexpr,
    OVERFLOW_SAFE: tl.constexpr,
):
    """From the row's summed partials s (fp32 [ROW_BLOCK]): the whole row's x = residual + s and
    its norm (each program of the row computes them identically), stored for columns [lo, hi) only
    (multiples of 64, so the masks stay constant over whole 16-byte vectors). bad != 0
    writes NaN."""
    dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
    cols = tl.arange(0, ROW_BLOCK)
    in_row = cols < hidden
    offs = row * hidden + cols
    x = tl.load(residual_ptr + offs, mask=in_row, other=0.0).to(tl.float32) + s
    x = tl.where((cols * 0 + bad) != 0, float("nan"), x)
    tl.store(residual_out_ptr + offs, round_to(x, dtype), mask=in_row & (cols >= lo) & (cols < hi))
    g = tl.load(gamma_ptr + cols, mask=in_row, other=0.0).to(tl.float32) + weight_bias
    norm_quant_row(
        x,
        g,
        row,
        lo,
        hi,
        tokens,
        norm_out_ptr,
        q_ptr,
        sf_ptr,
        hidden,
        eps,
        quant_scale,
        sf_cols,
        QUANT,
        SWIZZLED,
        ROW_BLOCK,
        HW_CVT,
        OVERFLOW_SAFE,
    )


@triton.jit
def residual_plus_finalize(
    gemm2_ptr,
    perm_ptr,
    weight_ptr,
    shared_ptr,
    residual_ptr,
    row,
    cols,
    hidden,
    routed_scaling,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    dtype: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    """fp32 x = residual + round(finalize) on `cols` of `row` (0 past H), the row's finalize
    rounded once as a published partial would be: the world-size-1 kernels' x."""
    acc = finalize_row(
        gemm2_ptr,
        perm_ptr,
        weight_ptr,
        shared_ptr,
        row,
        cols,
        hidden,
        routed_scaling,
        TOP_K,
        HAS_SHARED,
        True,  # SELECT_ONCE
        HW_CVT,  # GPU_MUL_RN: on a GPU
    )
    # one offset, as the callers' stores form it: the whole-row kernel then compiles to the same
    # machine code as when it spelled this out itself (measured)
    res = tl.load(residual_ptr + (row * hidden + cols), mask=cols < hidden, other=0.0)
    return res.to(tl.float32) + round_cast(acc, dtype, HW_CVT).to(tl.float32)
