"""The tensors that go into and come out of one epilogue call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple, Optional

import torch

from fusion_bridge.spec import (
    EpilogueSpec,
    QuantKind,
    QuantSpec,
    ScaleLayout,
    SFLayout,
    fp8_scale_columns,
    fp8_scale_storage_shape,
    sf_shape,
)


class EpilogueInputError(ValueError):
    """An argument of finalize_epilogue is not what the spec says."""


class EpilogueInputs(NamedTuple):
    """gemm2_out [P, H] act dtype: unfinalized routed-expert output, permuted rows (P may
    include padding).
    expanded_idx_to_permuted_idx [T, K] int32: row of gemm2_out for (token, k), -1 = skip.
    expert_weights [T, K] fp32/bf16/fp16. shared_output [T, H] act dtype or None.
    residual [T, H] act dtype. gamma [H] act dtype (RMSNorm weight)."""

    gemm2_out: torch.Tensor
    expanded_idx_to_permuted_idx: torch.Tensor
    expert_weights: torch.Tensor
    shared_output: Optional[torch.Tensor]
    residual: torch.Tensor
    gamma: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.expanded_idx_to_permuted_idx.shape[0]


@dataclass
class EpilogueOutputs:
    """residual_out, norm_out: [T, H] act dtype.
    quant: fp8, fp8_per_token_group, fp8_per_token -> [T, H] float8_e4m3fn; nvfp4 -> [T, H/2] uint8
    (2 e2m1 codes per byte, low nibble first); None without quantization.
    scale: nvfp4: uint8 e4m3 block scales, [round_up(T,128), round_up(H/16,4)] swizzled or [T,
    H/16]; fp8_per_token_group: fp32 [T, H/group_size] in the spec's scale layout (a transposed
    view for the column-major layouts: `fp8_scale_buffer`); fp8_per_token: fp32 [T, 1]; None
    otherwise.

    Unpacking: `norm_out, residual_out = outputs`, the order the engines' fused add+RMSNorm
    consumers return (vLLM's and SGLang's `(out, residual)`): the REVERSE of the field order.
    `len(outputs) == 2` whatever the quant; quant and scale are read by name only. `named()` and
    `dataclasses.fields` keep the field order."""

    residual_out: torch.Tensor
    norm_out: torch.Tensor
    quant: Optional[torch.Tensor] = None
    scale: Optional[torch.Tensor] = None

    @classmethod
    def for_quant(
        cls,
        kind: QuantKind,
        residual_out: torch.Tensor,
        norm_out: torch.Tensor,
        quant: Optional[torch.Tensor] = None,
        scale: Optional[torch.Tensor] = None,
    ) -> "EpilogueOutputs":
        """The outputs of a spec quantizing with `kind`, from a path that may hand back more (a
        kernel or op that always returns four tensors, placeholders included): quant only when the
        spec quantizes, scale only for NVFP4 and the dynamic FP8 kinds. The one place that trims
        outputs."""
        return cls(
            residual_out,
            norm_out,
            None if kind is QuantKind.NONE else quant,
            scale if kind in _KINDS_WITH_SCALES else None,
        )

    def __iter__(self) -> Iterator[torch.Tensor]:
        """(norm_out, residual_out): see the class docstring (not the field order)."""
        return iter((self.norm_out, self.residual_out))

    def __len__(self) -> int:
        return 2

    def named(self) -> dict[str, torch.Tensor]:
        out = {"residual_out": self.residual_out, "norm_out": self.norm_out}
        if self.quant is not None:
            out["quant"] = self.quant
        if self.scale is not None:
            out["scale"] = self.scale
        return out


_KINDS_WITH_SCALES = (QuantKind.NVFP4, QuantKind.FP8_PER_TOKEN_GROUP, QuantKind.FP8_PER_TOKEN)


def fp8_scale_buffer(
    tokens: int, groups: int, layout: ScaleLayout, device: torch.device
) -> torch.Tensor:
    """Dynamic FP8 scales, uninitialised: fp32 [T, G] as the caller receives them in `layout`
    (row_major: contiguous; column_major: the transpose of a [G, T] storage, strides (1, T);
    column_major_tma: storage [G, round_up(T, 4)] handed out as storage.t()[:T], strides
    (1, round_up(T, 4)); its padding columns are the writer's to zero)."""
    storage = torch.empty(
        fp8_scale_storage_shape(tokens, groups, layout), dtype=torch.float32, device=device
    )
    return storage if layout is ScaleLayout.ROW_MAJOR else storage.t()[:tokens]


def quant_buffers(
    tokens: int, hidden: int, kind: QuantKind, layout: SFLayout, device: torch.device
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(quant, scale) outputs, uninitialised: fp8 -> ([T, H] float8_e4m3fn, None); nvfp4 ->
    ([T, H/2] uint8, uint8 scales of `sf_shape(T, H, layout)`); none -> (None, None)."""
    if kind is QuantKind.FP8:
        return torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device=device), None
    if kind is QuantKind.NVFP4:
        return (
            torch.empty(tokens, hidden // 2, dtype=torch.uint8, device=device),
            torch.empty(sf_shape(tokens, hidden, layout), dtype=torch.uint8, device=device),
        )
    return None, None


def allocate_outputs(spec: EpilogueSpec, tokens: int, device: torch.device) -> EpilogueOutputs:
    """Every output of one call for `spec` and T, uninitialised. The one owner of output shapes: the
    strategies, the T == 0 path and the custom ops' fake implementations all allocate through it."""
    residual_out = torch.empty(tokens, spec.hidden_size, dtype=spec.dtype, device=device)
    if spec.quant.dynamic_fp8:
        quant, scale = fp8_dynamic_buffers(tokens, spec.hidden_size, spec.quant, device)
    else:
        quant, scale = quant_buffers(
            tokens, spec.hidden_size, spec.quant.kind, spec.quant.sf_layout, device
        )
    return EpilogueOutputs(residual_out, torch.empty_like(residual_out), quant, scale)


def fp8_dynamic_buffers(
    tokens: int, hidden: int, quant: QuantSpec, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes float8_e4m3fn [T, H], fp32 scales [T, G]) of a dynamic FP8 kind, uninitialised:
    G = H / group_size in the spec's scale layout, or [T, 1] per token."""
    layout = quant.scale_layout or ScaleLayout.ROW_MAJOR
    return (
        torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device=device),
        fp8_scale_buffer(tokens, fp8_scale_columns(hidden, quant), layout, device),
    )


class OutputAllocator:
    """`allocate_outputs(spec, T, device)` for one spec and device, called as `allocate(T)`: the
    same outputs (shapes, dtypes, device; fresh, contiguous, uninitialised tensors the caller owns,
    one allocation each), made by `torch.empty_like` of templates kept per T, which parses one
    tensor argument where `torch.empty(shape, dtype=, device=)` parses a size, a dtype and a
    device. The hot path of the strategies that allocate their own outputs
    (`strategies/kernel_call.py`).

    A template holds no memory of its own: one one-element tensor per dtype on `device` (made here,
    outside any CUDA-graph capture), expanded to the output's shape (stride 0). `empty_like` of a
    tensor that is not dense allocates a contiguous tensor of its shape and dtype on its device,
    with nothing shared with it; an output of at most one element (T == 0) has a real, empty-sized
    template instead (a dense one, whose strides `empty_like` would copy). The shapes per T come
    from `allocate_outputs` on the meta device (the one owner of output shapes), read once per T.
    The dynamic FP8 kinds go through `allocate_outputs` itself: their scales are views of a
    differently shaped storage (column-major, the TMA layout's padded one), which `empty_like` of
    an expanded template would not reproduce."""

    def __init__(self, spec: EpilogueSpec, device: torch.device):
        self.spec, self.device = spec, device
        self._direct = spec.quant.dynamic_fp8
        dtypes = {t.dtype for t in allocate_outputs(spec, 1, torch.device("meta")).named().values()}
        self._bases = {dt: torch.empty(1, dtype=dt, device=device) for dt in dtypes}
        self._templates: dict[int, tuple[torch.Tensor, ...]] = {}

    def __call__(self, tokens: int) -> EpilogueOutputs:
        if self._direct:
            return allocate_outputs(self.spec, tokens, self.device)
        templates = self._templates.get(tokens)
        if templates is None:
            templates = self._templates[tokens] = self._make(tokens)
        return EpilogueOutputs(*map(torch.empty_like, templates))

    def _make(self, tokens: int) -> tuple[torch.Tensor, ...]:
        """The templates of T's outputs, in EpilogueOutputs' field order (None fields left out:
        quant and scale follow only where the spec has them)."""
        shapes = allocate_outputs(self.spec, tokens, torch.device("meta")).named().values()
        return tuple(
            self._bases[t.dtype].expand(t.shape)
            if t.numel() > 1
            else torch.empty(t.shape, dtype=t.dtype, device=self.device)
            for t in shapes
        )


def outputs_for(
    spec: EpilogueSpec, tokens: int, device: torch.device, out: Optional[EpilogueOutputs]
) -> EpilogueOutputs:
    """`out` (the caller's preallocated outputs, validated by call/out_check.py) when given, else
    `allocate_outputs`: where a strategy that writes its outputs in place takes them from."""
    return allocate_outputs(spec, tokens, device) if out is None else out


def deliver(out: Optional[EpilogueOutputs], result: EpilogueOutputs) -> EpilogueOutputs:
    """`result` when the caller gave no `out`; else each of result's tensors copied into out's
    field (a stream-ordered copy: no sync, no allocation, capture-safe; skipped where the strategy
    already wrote into out's own tensor), and `out` returned. For the strategies whose library
    calls return new tensors (the torch paths, FlashInfer's unfused quant)."""
    if out is None:
        return result
    for name in ("residual_out", "norm_out", "quant", "scale"):
        src, dst = getattr(result, name), getattr(out, name)
        if src is None or dst is None or src is dst:
            continue
        if dst.dtype != src.dtype:  # FP8 codes a kernel returned as uint8, and back
            src = src.view(dst.dtype)
        if name == "scale" and dst.dtype == torch.float32 and dst.stride() != src.stride():
            dst.copy_(src)  # a dynamic FP8 view in another layout: the values only
        elif name == "scale" and dst.dtype == torch.float32 and dst.dim() == 2 and dst.numel():
            # the same layout: the whole storage, so the TMA layout's padding zeros travel too
            _storage_of(dst).copy_(_storage_of(src))
        else:
            dst.copy_(src)
    return out


def _storage_of(view: torch.Tensor) -> torch.Tensor:
    """A dynamic FP8 scale view's storage ([T, G] row-major, else [G, its column stride])."""
    if view.stride(1) == 1 or view.shape[0] == 0:
        return view
    width = view.stride(1)
    return torch.as_strided(view, (view.shape[1], width), (width, 1))
