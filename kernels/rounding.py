"""Rounding to the output dtype that is round-to-nearest-even on the GPU and in the interpreter
alike.

The Triton interpreter (measured with triton 3.9) casts fp32 -> bf16 by truncation, the GPU by RNE.
We
round fp32 to the bf16 grid ourselves (integer ops, free in a memory-bound kernel); the cast of the
already-rounded value is then exact everywhere, so CPU CI checks the same one-rounding math as the
GPU.
"""

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 tensor -> `dtype` (bf16/fp16/fp32), round to nearest even."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000
        # NaN stays NaN (made quiet): the GPU's NaN 0x7FFFFFFF would carry into the sign bit and
        # give -0.0. `x + x` rather than a NaN constant: the select then reuses x's register, which
        # measured offline as 16 fewer registers in the symmetric-memory kernels (no spills left in
        # the W <= 2 ones) and the gather schedule they had before the building blocks were shared.
        x = tl.where(x != x, x + x, bits.to(tl.float32, bitcast=True))
    return x.to(dtype)
