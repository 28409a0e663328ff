"""`fused_tp1`'s whole-row kernel (world size 1): one program per row. The split-row kernel for
few rows is kernels/tp1/split_rows.py; the row epilogue both use is kernels/row_epilogue.py."""

from __future__ import annotations

import triton
import triton.language as tl

from fusion_bridge.kernels import quant_codes as QC
from fusion_bridge.kernels.add_rmsnorm import rms_norm_row
from fusion_bridge.kernels.pdl import pdl_enter
from fusion_bridge.kernels.quant import quantize_row
from fusion_bridge.kernels.quant_dynamic import quantize_span_fp8_dynamic
from fusion_bridge.kernels.rounding import round_cast
from fusion_bridge.kernels.row_epilogue import prefetch_row, residual_plus_finalize


@triton.jit
def _tp1_kernel(
    src,
    out,
    tokens,
    hidden,
    scalars,
    sf_cols,
    FORM: tl.constexpr,
    PREFETCH: tl.constexpr,
    RECIP: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """World size 1, whole rows: one program per row; the top-k finalize of the row stays in
    registers, rounded once as a published partial would be (so residual_out is the two-launch
    path's bit for bit), then residual, norm and quant from the same building blocks. src: a
    `records.RowSource`, out: `records.RowOutputs`, scalars: `records.LayerScalars`, FORM:
    `records.RowForm`. Programs past T (swizzled NVFP4 only) write their scale row's padding
    (zeros), as the standalone norm kernel does. PREFETCH: the row's reads requested into L2 at
    once before its gathers (GPU only). RECIP: fp8 through one reciprocal (quant._div_by_scale).
    Roundings through the GPU's own conversion where FORM.HW_CVT (rounding.round_cast). USE_PDL
    (launched with programmatic dependent launch): every program first waits for the grid before
    it, before any memory access (kernels/pdl.py), then lets the next grid be scheduled. Its source
    reaches no module-level value, which lets the cached launcher launch it."""
    pdl_enter(USE_PDL, LAUNCH_DEPENDENTS=True)
    ROW_BLOCK: tl.constexpr = FORM.ROW_BLOCK
    HW_CVT: tl.constexpr = FORM.HW_CVT
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, ROW_BLOCK)
    if row < tokens:
        if PREFETCH:
            prefetch_row(src, row, 0, hidden, ROW_BLOCK, FORM)
        dtype: tl.constexpr = out.residual_out.dtype.element_ty
        x = residual_plus_finalize(src, row, cols, hidden, scalars, FORM, dtype)
        in_row = cols < hidden
        offs = row * hidden + cols
        tl.store(out.residual_out + offs, round_cast(x, dtype, HW_CVT=HW_CVT), mask=in_row)
        g = tl.load(src.gamma + cols, mask=in_row, other=0.0).to(tl.float32) + scalars.weight_bias
        # overflow-safe, as the two-launch path's norm kernel
        y = round_cast(rms_norm_row(x, g, hidden, scalars.eps), dtype, HW_CVT=HW_CVT)
        tl.store(out.norm_out + offs, y, mask=in_row)
        if FORM.QUANT >= QC.QUANT_FP8_GROUP:  # dynamic FP8; sf_cols is the scales' stride
            quantize_span_fp8_dynamic(
                y, row, 0, 0, ROW_BLOCK, tokens, hidden, out, sf_cols,
                GROUP=FORM.GROUP, LAYOUT=FORM.SCALE_LAYOUT, HW_CVT=HW_CVT, WINDOW=False,
            )  # fmt: skip
        else:  # (LEAN: y past H needs no zeroing for NVFP4)
            quantize_row(
                y,
                row,
                0,
                ROW_BLOCK,
                tokens,
                hidden,
                out,
                scalars.quant_scale,
                sf_cols,
                QUANT=FORM.QUANT,
                SWIZZLED=FORM.SWIZZLED,
                HW_CVT=HW_CVT,
                WINDOW=False,
                RECIP=RECIP,
                LEAN=True,
            )
    elif FORM.QUANT >= QC.QUANT_FP8_GROUP:  # a TMA scale padding row: zero scales
        quantize_span_fp8_dynamic(
            tl.zeros([ROW_BLOCK], dtype=tl.float32), row, 0, 0, ROW_BLOCK, tokens, hidden, out,
            sf_cols, GROUP=FORM.GROUP, LAYOUT=FORM.SCALE_LAYOUT, HW_CVT=HW_CVT, WINDOW=False,
        )  # fmt: skip
    else:
        quantize_row(
            tl.zeros([ROW_BLOCK], dtype=tl.float32),
            row,
            0,
            ROW_BLOCK,
            tokens,
            hidden,
            out,
            scalars.quant_scale,
            sf_cols,
            QUANT=FORM.QUANT,
            SWIZZLED=FORM.SWIZZLED,
            HW_CVT=HW_CVT,
            WINDOW=False,
            RECIP=False,
            LEAN=True,
        )
