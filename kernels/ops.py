"""Torch custom ops over our kernels, with fake implementations, so they trace under torch.compile and
capture in CUDA graphs. They allocate their outputs (the caching allocator serves them inside graphs)."""

from __future__ import annotations

from typing import Optional

import torch

from .add_rmsnorm import QUANT_FP8, QUANT_NONE, QUANT_NVFP4, add_rmsnorm_into
from .finalize_add import finalize_add_into


def _sf_rows_cols(tokens: int, hidden: int, swizzled: bool) -> tuple[int, int]:
    blocks = hidden // 16
    return ((-(-tokens // 128) * 128, -(-blocks // 4) * 4) if swizzled else (tokens, blocks))


@torch.library.custom_op("fusion_bridge::finalize_add", mutates_args=())
def finalize_add(gemm2_out: torch.Tensor, perm: torch.Tensor, weights: torch.Tensor,
                 shared: Optional[torch.Tensor], routed_scaling: float) -> torch.Tensor:
    """[P, H] x [T, K] int32 x [T, K] (+ [T, H]) -> [T, H]: routed_scaling * sum_k w * row + shared."""
    out = torch.empty(perm.shape[0], gemm2_out.shape[1], dtype=gemm2_out.dtype, device=gemm2_out.device)
    return finalize_add_into(out, gemm2_out, perm, weights, shared, routed_scaling)


@finalize_add.register_fake
def _(gemm2_out, perm, weights, shared, routed_scaling):
    return gemm2_out.new_empty(perm.shape[0], gemm2_out.shape[1])


@torch.library.custom_op("fusion_bridge::add_rmsnorm_quant", mutates_args=())
def add_rmsnorm_quant(residual: torch.Tensor, reduced: torch.Tensor, gamma: torch.Tensor, eps: float,
                      weight_bias: float, quant: int, quant_scale: float, swizzled: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """residual, reduced [T, H], gamma [H] -> (residual_out, norm_out, q, sf).

    quant 0: q, sf empty. 1 (fp8, quant_scale = divisor): q [T, H] float8_e4m3fn, sf empty.
    2 (nvfp4, quant_scale = global scale): q [T, H/2] uint8, sf uint8 (swizzled 128x4 or linear)."""
    tokens, hidden = residual.shape
    dev = residual.device
    residual_out, norm_out = torch.empty_like(residual), torch.empty_like(residual)
    if quant == QUANT_FP8:
        q = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device=dev)
        q_bytes, sf = q.view(torch.uint8), torch.empty(0, dtype=torch.uint8, device=dev)
    elif quant == QUANT_NVFP4:
        q = q_bytes = torch.empty(tokens, hidden // 2, dtype=torch.uint8, device=dev)
        sf = torch.empty(_sf_rows_cols(tokens, hidden, swizzled), dtype=torch.uint8, device=dev)
    else:
        q = q_bytes = sf = torch.empty(0, dtype=torch.uint8, device=dev)
    add_rmsnorm_into(residual_out, norm_out, q_bytes, sf, residual, reduced, gamma, eps, weight_bias, quant,
                     quant_scale, swizzled)
    if quant == QUANT_NONE:
        sf = torch.empty(0, dtype=torch.uint8, device=dev)  # distinct outputs: a custom op may not alias
    return residual_out, norm_out, q, sf


@add_rmsnorm_quant.register_fake
def _(residual, reduced, gamma, eps, weight_bias, quant, quant_scale, swizzled):
    tokens, hidden = residual.shape
    if quant == QUANT_FP8:
        q = residual.new_empty(tokens, hidden, dtype=torch.float8_e4m3fn)
        sf = residual.new_empty(0, dtype=torch.uint8)
    elif quant == QUANT_NVFP4:
        q = residual.new_empty(tokens, hidden // 2, dtype=torch.uint8)
        sf = residual.new_empty(_sf_rows_cols(tokens, hidden, swizzled), dtype=torch.uint8)
    else:
        q, sf = residual.new_empty(0, dtype=torch.uint8), residual.new_empty(0, dtype=torch.uint8)
    return torch.empty_like(residual), torch.empty_like(residual), q, sf
