"""Torch custom ops over our kernels, with fake implementations, so they trace under torch.compile
and capture in CUDA graphs. They allocate their outputs (the caching allocator serves them
inside graphs).

Strategies call `finalize_add`, `add_rmsnorm_quant` and `quantize` from this module's
`direct_when_eager` namespace: under torch.compile they go through the registered ops; in eager mode
they call the same Python bodies directly, skipping the custom-op dispatcher (tens of microseconds
of host time per call).

quant codes: kernels/quant_codes.py.
"""

from __future__ import annotations

from typing import Optional

import torch

from fusion_bridge.epilogue_tensors import fp8_dynamic_buffers, quant_buffers
from fusion_bridge.kernels.add_rmsnorm import add_rmsnorm_into
from fusion_bridge.kernels.finalize_add import finalize_add_into
from fusion_bridge.kernels.quant import quantize_into
from fusion_bridge.kernels.quant_codes import QUANT_FP8, QUANT_FP8_TOKEN, is_dynamic, kind_layout
from fusion_bridge.spec import QuantSpec, ScaleLayout


def _buffers(
    shape: torch.Size, device: torch.device, quant: int, swizzled: bool, group: int, layout: int
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(q, sf) of the quant mode as `allocate_outputs` makes them (the dynamic FP8 kinds' scales
    in their layout's view), None where it has none."""
    if not is_dynamic(quant):
        return quant_buffers(*shape, *kind_layout(quant, swizzled), device)
    spec = (
        QuantSpec.fp8_per_token()
        if quant == QUANT_FP8_TOKEN
        else QuantSpec.fp8_per_token_group(group, list(ScaleLayout)[layout])
    )
    return fp8_dynamic_buffers(*shape, spec, device)


def _quant_outputs(
    like: torch.Tensor,
    quant: int,
    swizzled: bool,
    fake: bool = False,
    group: int = 0,
    layout: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q returned, q as uint8 for the kernel, sf returned, sf for the kernel). Unused ones are
    empty and distinct: a custom op's outputs may not alias each other."""
    q, sf = _buffers(like.shape, like.device, quant, swizzled, group, layout)
    q = q if q is not None else like.new_empty(0, dtype=torch.uint8)
    sf = sf if sf is not None else like.new_empty(0, dtype=torch.uint8)
    fp8 = quant == QUANT_FP8 or is_dynamic(quant)
    q_bytes = q.view(torch.uint8) if (fp8 and not fake) else q
    return q, q_bytes, sf, sf


def _finalize_add(
    gemm2_out: torch.Tensor,
    perm: torch.Tensor,
    weights: torch.Tensor,
    shared: Optional[torch.Tensor],
    routed_scaling: float,
) -> torch.Tensor:
    """[P, H] x [T, K] int32 x [T, K] (+ [T, H]) -> [T, H]:
    routed_scaling * sum_k w * row + shared."""
    out = torch.empty(
        perm.shape[0], gemm2_out.shape[1], dtype=gemm2_out.dtype, device=gemm2_out.device
    )
    return finalize_add_into(out, gemm2_out, perm, weights, shared, routed_scaling)


finalize_add = torch.library.custom_op("fusion_bridge::finalize_add", mutates_args=())(
    _finalize_add
)


@finalize_add.register_fake
def _(gemm2_out, perm, weights, shared, routed_scaling):
    return gemm2_out.new_empty(perm.shape[0], gemm2_out.shape[1])


def _add_rmsnorm_quant(
    residual: torch.Tensor,
    reduced: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    weight_bias: float,
    quant: int,
    quant_scale: float,
    swizzled: bool,
    group: int = 0,
    scale_layout: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """residual, reduced [T, H], gamma [H] -> (residual_out, norm_out, q, sf). group,
    scale_layout: the dynamic FP8 kinds' (quant_codes.QuantArgs).
    q: fp8 [T, H] float8_e4m3fn, nvfp4 [T, H/2] uint8, else empty; sf: nvfp4 uint8 scales,
    else empty."""
    residual_out, norm_out = torch.empty_like(residual), torch.empty_like(residual)
    q, q_bytes, sf, sf_bytes = _quant_outputs(
        residual, quant, swizzled, group=group, layout=scale_layout
    )
    add_rmsnorm_into(
        residual_out,
        norm_out,
        q_bytes,
        sf_bytes,
        residual,
        reduced,
        gamma,
        eps=eps,
        weight_bias=weight_bias,
        quant=quant,
        quant_scale=quant_scale,
        swizzled=swizzled,
        group=group,
        scale_layout=scale_layout,
    )
    return residual_out, norm_out, q, sf


add_rmsnorm_quant = torch.library.custom_op("fusion_bridge::add_rmsnorm_quant", mutates_args=())(
    _add_rmsnorm_quant
)


@add_rmsnorm_quant.register_fake
def _(residual, reduced, gamma, eps, weight_bias, quant, quant_scale, swizzled, group=0,
      scale_layout=0):  # fmt: skip
    q, _, sf, _ = _quant_outputs(
        residual, quant, swizzled, fake=True, group=group, layout=scale_layout
    )
    return torch.empty_like(residual), torch.empty_like(residual), q, sf


def _quantize(
    x: torch.Tensor,
    quant: int,
    quant_scale: float,
    swizzled: bool,
    group: int = 0,
    scale_layout: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] activation dtype -> (q, sf) as in add_rmsnorm_quant. FP8 and NVFP4 only: the
    dynamic FP8 kinds (group, scale_layout) have no standalone kernel here."""
    if is_dynamic(quant):
        raise ValueError(
            f"quantize: quant must be a static kind (fp8 or nvfp4), got the dynamic FP8 code "
            f"{quant} (group {group}, scale_layout {scale_layout}): no standalone kernel for it"
        )
    q, q_bytes, sf, sf_bytes = _quant_outputs(x, quant, swizzled)
    quantize_into(q_bytes, sf_bytes, x, quant, quant_scale, swizzled)
    return q, sf


quantize = torch.library.custom_op("fusion_bridge::quantize", mutates_args=())(_quantize)


@quantize.register_fake
def _(x, quant, quant_scale, swizzled, group=0, scale_layout=0):
    q, _, sf, _ = _quant_outputs(x, quant, swizzled, fake=True)
    return q, sf


def _add_rmsnorm_quant_eager(
    residual: torch.Tensor,
    reduced: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    weight_bias: float,
    quant: int,
    quant_scale: float,
    swizzled: bool,
    group: int = 0,
    scale_layout: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """add_rmsnorm_quant for eager calls: allocates only what it returns (None for an output the
    quant mode does not have; the kernel's unused pointers get an output it writes anyway)."""
    residual_out, norm_out = torch.empty_like(residual), torch.empty_like(residual)
    q, sf = _buffers(residual.shape, residual.device, quant, swizzled, group, scale_layout)
    q_bytes = q.view(torch.uint8) if q is not None else norm_out
    add_rmsnorm_into(
        residual_out,
        norm_out,
        q_bytes,
        sf if sf is not None else q_bytes,
        residual,
        reduced,
        gamma,
        eps=eps,
        weight_bias=weight_bias,
        quant=quant,
        quant_scale=quant_scale,
        swizzled=swizzled,
        group=group,
        scale_layout=scale_layout,
    )
    return residual_out, norm_out, q, sf


class _DirectWhenEager:
    """Eager: the op bodies called directly (no dispatcher). Compiling: the registered ops (so
    dynamo sees custom ops)."""

    @staticmethod
    def finalize_add(*args):
        if torch.compiler.is_compiling():
            return torch.ops.fusion_bridge.finalize_add(*args)
        return _finalize_add(*args)

    @staticmethod
    def add_rmsnorm_quant(*args):
        """(residual_out, norm_out, q, sf); eagerly, q / sf are None where the quant
        mode has none."""
        if torch.compiler.is_compiling():
            return torch.ops.fusion_bridge.add_rmsnorm_quant(*args)
        return _add_rmsnorm_quant_eager(*args)

    @staticmethod
    def quantize(*args):
        if torch.compiler.is_compiling():
            return torch.ops.fusion_bridge.quantize(*args)
        return _quantize(*args)


direct_when_eager = _DirectWhenEager()
