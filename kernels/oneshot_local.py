"""The one-shot kernel's local work (kernels/symm_oneshot.py) with the exchange left out: the
world-size-1 kernels, and the row epilogue that the exchange kernel shares with them.

Two launch shapes, one launch each, from the same building blocks (finalize_add.finalize_row,
add_rmsnorm.rms_norm_row / rms_apply, quant.quantize_row / quantize_span) in their leaner forms
(SELECT_ONCE, LEAN, RECIP: the same bits in fewer instructions; rounding.round_cast) and, where a
launch shape asks for it, the row prefetched into L2 before its gathers (`prefetch_row`):

- whole rows (`_tp1_kernel`): one program per row keeps the row's top-k finalize in registers,
  rounds it once as a published partial would be, adds the residual, normalizes and quantizes.
- split rows (`_tp1_split_kernel`, few rows): a row's columns are spread over `chunks` programs,
  so a row's K gathers run on several SMs at once instead of one SM serially. A program finalizes
  and stores its chunk, publishes its chunk's sum of squares, waits for the row's other chunks'
  sums (the only exchange, inside the launch) and normalizes and quantizes its own columns.

The split rows' exchange protocol and its memory-ordering argument: kernels/tp1_split.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .add_rmsnorm import norm_quant_row, rms_norm_row
from .finalize_add import finalize_row
from .pdl import pdl_enter
from .quant import quantize_row
from .rounding import round_cast, round_to


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
    (multiples of 64, so the masks stay constant over whole 16-byte vectors). bad != 0 writes
    NaN."""
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


@triton.jit
def _tp1_kernel(
    gemm2_ptr,
    perm_ptr,
    weight_ptr,
    shared_ptr,
    residual_ptr,
    gamma_ptr,
    residual_out_ptr,
    norm_out_ptr,
    q_ptr,
    sf_ptr,
    tokens,
    hidden,
    routed_scaling,
    eps,
    weight_bias,
    quant_scale,
    sf_cols,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    QUANT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    HW_CVT: tl.constexpr,
    PREFETCH: tl.constexpr,
    RECIP: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """World size 1, whole rows: one program per row; the top-k finalize of the row stays in
    registers, rounded once as a published partial would be (so residual_out is the two-launch
    path's bit for bit), then residual, norm and quant from the same building blocks. Programs past
    T (swizzled NVFP4 only) write their scale row's padding (zeros), as the standalone norm kernel
    does. PREFETCH: the row's reads requested into L2 at once before its gathers (GPU only).
    RECIP: fp8 through one reciprocal (quant._div_by_scale). Roundings through the GPU's own
    conversion where HW_CVT (rounding.round_cast). USE_PDL (launched with programmatic dependent
    launch): every program first waits for the grid before it, before any memory access
    (kernels/pdl.py), then lets the next grid be scheduled. Its source reaches no module-level
    value, which lets the cached launcher launch it."""
    pdl_enter(USE_PDL, True)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, ROW_BLOCK)
    if row < tokens:
        if PREFETCH:
            prefetch_row(
                gemm2_ptr,
                perm_ptr,
                shared_ptr,
                residual_ptr,
                row,
                0,
                hidden,
                ROW_BLOCK,
                TOP_K,
                HAS_SHARED,
            )
        dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
        x = residual_plus_finalize(
            gemm2_ptr,
            perm_ptr,
            weight_ptr,
            shared_ptr,
            residual_ptr,
            row,
            cols,
            hidden,
            routed_scaling,
            TOP_K,
            HAS_SHARED,
            dtype,
            HW_CVT,
        )
        in_row = cols < hidden
        offs = row * hidden + cols
        tl.store(residual_out_ptr + offs, round_cast(x, dtype, HW_CVT), mask=in_row)
        g = tl.load(gamma_ptr + cols, mask=in_row, other=0.0).to(tl.float32) + weight_bias
        # overflow-safe, as the two-launch path's norm kernel
        y = round_cast(rms_norm_row(x, g, hidden, eps, True), dtype, HW_CVT)
        tl.store(norm_out_ptr + offs, y, mask=in_row)
        # (LEAN: y past H needs no zeroing for NVFP4)
        quantize_row(
            y,
            row,
            0,
            ROW_BLOCK,
            tokens,
            hidden,
            q_ptr,
            sf_ptr,
            quant_scale,
            sf_cols,
            QUANT,
            SWIZZLED,
            ROW_BLOCK,
            HW_CVT,
            False,
            RECIP,
            True,  # LEAN
        )
    else:
        quantize_row(
            tl.zeros([ROW_BLOCK], dtype=tl.float32),
            row,
            0,
            ROW_BLOCK,
            tokens,
            hidden,
            q_ptr,
            sf_ptr,
            quant_scale,
            sf_cols,
            QUANT,
            SWIZZLED,
            ROW_BLOCK,
            HW_CVT,
            False,
            False,
            True,  # LEAN
        )
