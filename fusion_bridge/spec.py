"""The static description of one layer's epilogue: what it computes, independent of how."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
EXPERT_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NVFP4_BLOCK = 16
FP8_E4M3_MAX = 448.0


class QuantKind(str, enum.Enum):
    NONE = "none"
    FP8 = "fp8"
    NVFP4 = "nvfp4"


class SFLayout(str, enum.Enum):
    """NVFP4 scale-factor layouts; SWIZZLED_128x4 matches FlashInfer's QuantizationSFLayout.SWIZZLED_128x4."""

    SWIZZLED_128x4 = "swizzled_128x4"
    LINEAR = "linear"


class Stage(str, enum.Enum):
    """The stages of the epilogue, in order. A strategy's steps cover a contiguous run of them."""

    FINALIZE = "finalize"
    SHARED_ADD = "shared_add"
    ALL_REDUCE = "all_reduce"
    RESIDUAL_NORM = "residual_norm"
    QUANT = "quant"


@dataclass(frozen=True)
class QuantSpec:
    """Optional quantization of norm_out.

    fp8:   q = e4m3_satfinite(bf16(norm_out) / scale)   -- `scale` is a divisor.
    nvfp4: 16-element blocks, e4m3 block scales, `global_scale` is a multiplier (usually 448*6/amax).
    """

    kind: QuantKind = QuantKind.NONE
    scale: float | None = None
    global_scale: float | None = None
    sf_layout: SFLayout = SFLayout.SWIZZLED_128x4

    @staticmethod
    def none() -> "QuantSpec":
        return QuantSpec()

    @staticmethod
    def fp8(scale: float) -> "QuantSpec":
        return QuantSpec(QuantKind.FP8, scale=float(scale))

    @staticmethod
    def nvfp4(global_scale: float, sf_layout: SFLayout | str = SFLayout.SWIZZLED_128x4) -> "QuantSpec":
        return QuantSpec(QuantKind.NVFP4, global_scale=float(global_scale), sf_layout=SFLayout(sf_layout))

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", QuantKind(self.kind))
        object.__setattr__(self, "sf_layout", SFLayout(self.sf_layout))
        if self.kind is QuantKind.FP8:
            _require(self.scale is not None and self.scale > 0 and self.scale == self.scale,
                     "quant.scale", "a positive finite float for fp8", self.scale)
        if self.kind is QuantKind.NVFP4:
            _require(self.global_scale is not None and self.global_scale > 0
                     and self.global_scale == self.global_scale,
                     "quant.global_scale", "a positive finite float for nvfp4", self.global_scale)


@dataclass(frozen=True)
class EpilogueSpec:
    """Static per-layer description of the MoE epilogue.

    hidden_size: H. top_k: K (columns of the index map). dtype: activation dtype, bf16 or fp16.
    eps, weight_bias: RMSNorm uses (gamma + weight_bias). routed_scaling_factor multiplies the top-k sum.
    has_shared_output: whether shared_output is passed. max_tokens: the largest T a call may carry;
    workspaces are sized for it.
    """

    hidden_size: int
    top_k: int
    dtype: torch.dtype = torch.bfloat16
    eps: float = 1e-6
    weight_bias: float = 0.0
    routed_scaling_factor: float = 1.0
    has_shared_output: bool = True
    quant: QuantSpec = field(default_factory=QuantSpec)
    max_tokens: int = 8192

    def __post_init__(self) -> None:
        _require(isinstance(self.hidden_size, int) and self.hidden_size > 0,
                 "hidden_size", "a positive int", self.hidden_size)
        _require(isinstance(self.top_k, int) and self.top_k > 0, "top_k", "a positive int", self.top_k)
        _require(self.dtype in ACTIVATION_DTYPES, "dtype", "torch.bfloat16 or torch.float16", self.dtype)
        _require(self.eps > 0, "eps", "a positive float", self.eps)
        _require(isinstance(self.max_tokens, int) and self.max_tokens > 0,
                 "max_tokens", "a positive int", self.max_tokens)
        _require(isinstance(self.quant, QuantSpec), "quant", "a QuantSpec", type(self.quant).__name__)
        if self.quant.kind is QuantKind.NVFP4:
            _require(self.hidden_size % NVFP4_BLOCK == 0, "hidden_size",
                     f"a multiple of {NVFP4_BLOCK} for nvfp4", self.hidden_size)

    @property
    def dtype_name(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]

    def to_dict(self) -> dict:
        return {
            "hidden_size": self.hidden_size, "top_k": self.top_k, "dtype": self.dtype_name,
            "eps": self.eps, "weight_bias": self.weight_bias,
            "routed_scaling_factor": self.routed_scaling_factor,
            "has_shared_output": self.has_shared_output, "max_tokens": self.max_tokens,
            "quant": {"kind": self.quant.kind.value, "scale": self.quant.scale,
                      "global_scale": self.quant.global_scale, "sf_layout": self.quant.sf_layout.value},
        }


DTYPE_BY_NAME = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _require(ok: bool, name: str, expected: str, actual: object) -> None:
    if not ok:
        raise ValueError(f"EpilogueSpec: {name} must be {expected}, got {actual!r}")
