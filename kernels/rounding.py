"""Numerics that must come out the same on the GPU and in the interpreter: rounding to the output
dtype (round to nearest even on both), and a block max that keeps a NaN (`block_amax`).

The Triton interpreter (measured with triton 3.9) casts fp32 -> bf16 by truncation, the GPU by RNE.
We round fp32 to the bf16 grid ourselves (integer ops, free in a memory-bound kernel); the cast of
the already-rounded value is then exact everywhere, so CPU CI checks the same one-rounding
math as the GPU.
"""

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 tensor -> `dtype` (bf16/fp16/fp32), round to nearest even."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000
        # NaN stays NaN: the GPU's NaN 0x7FFFFFFF would carry into the sign bit and give -0.0.
        # The NaN case is `x * 1.0`, which the compiler folds to x: ptxas then writes the rounded
        # bits into x's own register under a predicate, no select and no extra instruction (the
        # fastest form measured: docs/performance.md#before-the-two-shot-pipeline,
        # benchmarks/results/oneshot_w2_regression_diagnosis.md). A NaN
        # constant costs a select and a register per element, `x + x` an add per element. Plain
        # `x` would let the interpreter's truncating cast turn a low-payload NaN into inf; its
        # unfolded multiply makes the NaN quiet first.
        x = tl.where(x != x, x * 1.0, bits.to(tl.float32, bitcast=True))
    return x.to(dtype)


@triton.jit
def round_cast(x, dtype: tl.constexpr, HW_CVT: tl.constexpr):
    """`round_to(x, dtype)`; HW_CVT (a GPU): the GPU's own conversion, round to nearest even too, so
    the same bits, NaN included (round_to hands a NaN to that conversion unchanged), in one
    instruction per two elements instead of six per element."""
    if HW_CVT:
        return x.to(dtype)
    else:
        return round_to(x, dtype)


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def block_amax(yb, HW_CVT: tl.constexpr):
    """max |y| per row of yb [blocks, 16] (NVFP4's block amax), NaN where a block holds one, as
    quant_ref's: a plain max drops a NaN (the GPU's maxnum, the interpreter's nanmax). HW_CVT (a
    GPU): a NaN-keeping float max. The interpreter runs a custom combine element by element in
    Python: there the integer max of the magnitudes' bits (a NaN's are above inf's), the same."""
    if HW_CVT:
        return tl.reduce(tl.abs(yb), 1, _max_keeping_nan)
    else:
        return tl.max(yb.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1).to(
            tl.float32, bitcast=True
        )
