"""Fused MoE finalize + shared-expert add:

    out[t] = routed_scaling * sum_k w[t,k] * gemm2_out[perm[t,k]] + shared[t]

fp32 accumulation, one rounding to the activation dtype. Slots with perm == -1 are masked out of the
load (never read). 64-bit row offsets: P * H may exceed 2^31.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from fusion_bridge.kernels.launch_cache import KernelLauncher
from fusion_bridge.kernels.records import RowSource
from fusion_bridge.kernels.rounding import round_to


@triton.jit
def _mul_rn(a, b):
    """fp32 a * b rounded on its own (ptxas does not fuse an explicitly rounded multiply)."""
    return tl.inline_asm_elementwise(
        "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def finalize_row(
    src,
    row,
    cols,
    hidden,
    routed_scaling,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    SELECT_ONCE: tl.constexpr = False,
    GPU_MUL_RN: tl.constexpr = False,
    STREAM_ONCE: tl.constexpr = False,
):
    """The building block (the symmetric-memory kernels call it too): fp32 [len(cols)] =
    routed_scaling * sum_k w[row,k] * gemm2_out[perm[row,k], cols] (+ shared[row, cols]), row int64;
    src: a `records.RowSource` (gemm2_out, perm, weights, shared read).
    Slots with perm == -1 are never read; where, not x * 0: a skipped slot's weight may be garbage
    (NaN). SELECT_ONCE: the same sum bit for bit with the skipped slot's weight set to 0 once per
    slot instead of a select per element (its masked load gives +0, and +0 * 0 added to the sum,
    which is never -0 as it starts at +0, leaves it as it is); the world-size-1 kernels take it
    (which kernel takes which form, and why: docs/performance.md#one-form-per-building-block).
    Without the select between them, ptxas fuses the product and the sum into one FMA (one
    rounding, not two: other bits than the select form's), so on a GPU SELECT_ONCE needs
    GPU_MUL_RN: the product by an explicit `mul.rn.f32`, which ptxas never contracts. The
    interpreter rounds both anyway. STREAM_ONCE: the expert rows are loaded with the L2
    evict-first hint (read once: they should not push out data a later kernel reads from L2; the
    two-shot's slot rows)."""
    gemm2_ptr, perm_ptr, weight_ptr, shared_ptr = src.gemm2_out, src.perm, src.weights, src.shared
    in_row = cols < hidden
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        expert_row = tl.load(perm_ptr + row * TOP_K + k).to(tl.int64)
        weight = tl.load(weight_ptr + row * TOP_K + k).to(tl.float32)
        if SELECT_ONCE:
            weight = tl.where(expert_row >= 0, weight, 0.0)
        valid = (
            cols * 0 + expert_row
        ) >= 0  # vector form: the interpreter rejects a scalar-bool mask
        if STREAM_ONCE:
            x = tl.load(
                gemm2_ptr + expert_row * hidden + cols, mask=in_row & valid, other=0.0,
                eviction_policy="evict_first",
            ).to(tl.float32)  # fmt: skip
        else:
            x = tl.load(gemm2_ptr + expert_row * hidden + cols, mask=in_row & valid, other=0.0)
            x = x.to(tl.float32)
        if SELECT_ONCE:
            if GPU_MUL_RN:
                acc += _mul_rn(x, weight)
            else:
                acc += x * weight
        else:
            acc += tl.where(valid, x * weight, 0.0)
    acc = acc * routed_scaling
    if HAS_SHARED:
        acc += tl.load(shared_ptr + row * hidden + cols, mask=in_row, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _finalize_add_kernel(
    src,
    out_ptr,
    hidden,
    routed_scaling,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """src: a `records.RowSource` with residual and gamma None -> out [T, H]."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = finalize_row(src, token, cols, hidden, routed_scaling, TOP_K=TOP_K, HAS_SHARED=HAS_SHARED)
    tl.store(
        out_ptr + token * hidden + cols, round_to(acc, out_ptr.dtype.element_ty), mask=cols < hidden
    )


def block_h_for(hidden: int, tokens: int) -> int:
    """Few tokens: latency-bound, small blocks spread one row over more SMs (256 measured faster
    than 1024 at T=1: docs/performance.md#figures-behind-the-codes-choices). Many tokens:
    1024-wide blocks for 16-byte accesses at the bandwidth limit."""
    return min(256 if tokens <= 32 else 1024, triton.next_power_of_2(hidden))


_LAUNCH = KernelLauncher(_finalize_add_kernel, ("TOP_K", "HAS_SHARED", "BLOCK_H"))


@functools.lru_cache(maxsize=256)
def _launch_shape(
    hidden: int,
    top_k: int,
    has_shared: bool,
    few_tokens: bool,
    block_h: Optional[int],
    num_warps: Optional[int],
) -> tuple[int, tuple, int]:
    """(column blocks per row, constexprs, num_warps): fixed per spec and T class, computed once."""
    block = block_h or block_h_for(hidden, 1 if few_tokens else 33)
    return (
        triton.cdiv(hidden, block),
        (top_k, has_shared, block),
        num_warps or (4 if block >= 256 else 2),
    )


def finalize_add_into(
    out: torch.Tensor,
    gemm2_out: torch.Tensor,
    perm: torch.Tensor,
    weights: torch.Tensor,
    shared: Optional[torch.Tensor],
    routed_scaling: float,
    block_h: Optional[int] = None,
    num_warps: Optional[int] = None,
) -> torch.Tensor:
    """Launch into a preallocated `out` [T, H] (activation dtype). T == 0 launches nothing.
    block_h / num_warps override the launch shape (benchmark sweeps)."""
    tokens, top_k = perm.shape
    hidden = gemm2_out.shape[1]
    if tokens == 0:
        return out
    blocks, constexprs, warps = _launch_shape(
        hidden, top_k, shared is not None, tokens <= 32, block_h, num_warps
    )
    _LAUNCH(
        (tokens, blocks),
        (
            RowSource(gemm2_out, perm, weights, out if shared is None else shared, None, None),
            out,
            hidden,
            float(routed_scaling),
        ),
        constexprs,
        warps,
    )
    return out


def finalize_add(
    gemm2_out: torch.Tensor,
    perm: torch.Tensor,
    weights: torch.Tensor,
    shared: Optional[torch.Tensor],
    routed_scaling: float,
) -> torch.Tensor:
    """gemm2_out [P, H] bf16/fp16, perm [T, K] int32, weights [T, K] fp32/bf16/fp16, shared [T, H]
    or None -> [T, H] in gemm2_out's dtype."""
    out = torch.empty(
        perm.shape[0], gemm2_out.shape[1], dtype=gemm2_out.dtype, device=gemm2_out.device
    )
    return finalize_add_into(out, gemm2_out, perm, weights, shared, routed_scaling)
