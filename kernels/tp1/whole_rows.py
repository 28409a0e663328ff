"""`fused_tp1`'s whole-row kernel (world size 1): one program per row. The split-row kernel for
few rows is kernels/tp1/split_rows.py; the row epilogue both use is kernels/row_epilogue.py."""

from __future__ import annotations

import triton
import triton.language as tl

from fusion_bridge.kernels.add_rmsnorm import rms_norm_row
from fusion_bridge.kernels.pdl import pdl_enter
from fusion_bridge.kernels.quant import quantize_row
from fusion_bridge.kernels.rounding import round_cast
from fusion_bridge.kernels.row_epilogue import prefetch_row, residual_plus_finalize


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
