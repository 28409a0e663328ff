"""The records our kernels take instead of walls of positional arguments: one per concept, bound
once where its values are known.

- `RowSource` (per call): what a row of the epilogue is computed from, the call's six inputs
  (`RowSource.of(inputs)` from an `EpilogueInputs`).
- `RowOutputs` (per call): what a row writes (`RowOutputs.of(outputs, unused)` from an
  `EpilogueOutputs` allocated before the call).
- `LayerScalars` (per layer, built when a strategy is prepared: `layer.LayerRecord.scalars`).
- `RowForm` (a compile-time record, one `tl.constexpr`): the shape of a row's work, fixed per
  layer, per call kind (shared output or not) and per device.

Imports no Triton: host code builds these without loading a kernel.

How Triton takes them (>= 3.3; we pin 3.6): a tuple argument reaches the kernel as its elements,
in order, each specialized as a plain argument would be (a tensor by dtype and 16-byte alignment,
an int by `== 1`, `% 16 == 0` and range, a float not at all), and a NamedTuple's fields are read
by name inside the kernel (`src.perm`). A field that is None is a compile-time constant and no
kernel parameter at all: a kernel's record leaves None the fields it never reads, so it has
exactly the parameters it uses, in the order the fields are listed. The launch cache keys a
record field by field, as Triton specializes it (kernels/launch_cache.py).

`do_not_specialize` names a whole parameter, and Triton 3.6 specializes a tuple's elements even
then: a value that must not be specialized (T in the symmetric-memory kernels, a rank, a chunk
index) stays a parameter of its own, never a record field. Every record lists its fields in the
order the kernel had them as plain parameters, so the compiled code has the same parameters at
the same offsets (benchmarks/sass_diff.py compares it).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class RowSource(NamedTuple):
    """gemm2_out [P, H]; perm [T, K] int32 (-1: a skipped slot); weights [T, K]; shared [T, H]
    (any tensor when the call has none: RowForm.HAS_SHARED off, never read); residual [T, H];
    gamma [H]. None where the kernel does not read the field.

    A call's record (`of`) holds None for a call without a shared output; `for_kernel` puts the
    residual in its place, so a kernel has the same parameters either way."""

    gemm2_out: Any
    perm: Any
    weights: Any
    shared: Any
    residual: Any
    gamma: Any

    @classmethod
    def of(cls, inputs) -> "RowSource":
        """A call's record from an `EpilogueInputs` (the same six tensors, as the kernels name
        them; shared None when the call has no shared output)."""
        return cls(
            inputs.gemm2_out,
            inputs.expanded_idx_to_permuted_idx,
            inputs.expert_weights,
            inputs.shared_output,
            inputs.residual,
            inputs.gamma,
        )

    def for_kernel(self) -> "RowSource":
        """The record as a kernel takes it: no shared output (None) is the residual in its place
        (any tensor: RowForm.HAS_SHARED is off and it is never read)."""
        if self.shared is not None:
            return self
        return RowSource(self.gemm2_out, self.perm, self.weights, self.residual, self.residual,
                         self.gamma)  # fmt: skip


class RowOutputs(NamedTuple):
    """residual_out, norm_out [T, H]; q (uint8: [T, H] fp8 codes or [T, H/2] packed fp4) and sf
    (the NVFP4 scales, uint8; the dynamic FP8 scales, fp32: the layout's view, whose first element
    is its storage's), any tensor when the quant mode has none. None where the kernel does not
    write the field."""

    residual_out: Any
    norm_out: Any
    q: Any
    sf: Any

    @classmethod
    def of(cls, outputs, unused: torch.Tensor) -> "RowOutputs":
        """The record of an `EpilogueOutputs` allocated for a call (`allocate_outputs`): the FP8
        codes viewed as uint8, as the kernels store them; `unused` (an empty uint8 tensor) where
        the quant mode has no codes or no scales."""
        q, sf = outputs.quant, outputs.scale
        if q is None:
            q = unused
        elif q.dtype != torch.uint8:
            q = q.view(torch.uint8)
        return cls(outputs.residual_out, outputs.norm_out, q, unused if sf is None else sf)


class LayerScalars(NamedTuple):
    """The spec's scalars as a kernel reads them: routed_scaling_factor, eps, weight_bias and the
    quant scale (FP8: the divisor; NVFP4: the global scale; 1.0 without quant). None where the
    kernel does not read the field. (H is a size, passed beside it: a kernel's sizes sit where
    its address arithmetic wants them.)"""

    routed_scaling: float
    eps: float
    weight_bias: float
    quant_scale: float


class RowForm(NamedTuple):
    """The compile-time shape of a row's work: TOP_K slots per token, HAS_SHARED (a shared output
    is added), QUANT (quant_codes: QUANT_NONE / FP8 / NVFP4 / FP8_GROUP / FP8_TOKEN), SWIZZLED
    (NVFP4 scales in the 128x4 layout), ROW_BLOCK (a whole row's block: H rounded up to a power of
    two, >= 64), HW_CVT (a GPU: the hardware's RNE conversions; off under the interpreter). The
    dynamic FP8 kinds only (defaults otherwise, so the other kinds' records are unchanged): GROUP,
    elements per scale as the kernel holds them (the spec's group size; ROW_BLOCK per token),
    SCALE_LAYOUT (quant_codes.SCALE_ROW_MAJOR / SCALE_COLUMN_MAJOR / SCALE_COLUMN_MAJOR_TMA). Their
    scales' stride reaches the kernel in the runtime slot the NVFP4 scales' columns take
    (`sf_cols`): quant_codes.dynamic_scale_dims."""

    TOP_K: int
    HAS_SHARED: bool
    QUANT: int
    SWIZZLED: bool
    ROW_BLOCK: int
    HW_CVT: bool
    GROUP: int = 0
    SCALE_LAYOUT: int = 0
