"""The static description of one layer's epilogue: what it computes, independent of how."""

from __future__ import annotations

import enum
import functools
import numbers
from dataclasses import dataclass, field

import torch

from fusion_bridge.spec_fields import (  # noqa: F401 (constants re-exported)
    BLACKWELL_REFUSAL,
    FP32_MAX,
    FP32_TINY,
    _require,
    _int_field,
    _real_field,
    _enum_field,
)

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
EXPERT_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NVFP4_BLOCK = 16
FP8_E4M3_MAX = 448.0


INT32_MAX = 2**31 - 1
MAX_TOP_K = 1024
MAX_HIDDEN_SIZE = 1 << 20
MAX_EPS = 1.0  # RMSNorm eps regularises mean(x^2); models use 1e-6 .. 1e-5
MAX_ROUTED_SCALING = 1024.0  # DeepSeek-V3 2.5, Kimi-K2 2.827; fp16 holds 65504


FP8_GROUP_SIZES = tuple(2**i for i in range(4, 13))  # 16 .. 4096, powers of two

# Blackwell formats (e8m0 power-of-two scales): refused with this reason wherever a value names them


class QuantKind(str, enum.Enum):
    NONE = "none"
    FP8 = "fp8"
    NVFP4 = "nvfp4"
    FP8_PER_TOKEN_GROUP = "fp8_per_token_group"
    FP8_PER_TOKEN = "fp8_per_token"


class ScaleLayout(str, enum.Enum):
    """Where the fp32 scales of per-token-group FP8 lie (G = H / group_size, T tokens):

    ROW_MAJOR:        fp32 [T, G], contiguous.
    COLUMN_MAJOR:     fp32 storage [G, T], handed out as its transpose: [T, G], strides (1, T).
    COLUMN_MAJOR_TMA: fp32 storage [G, round_up(T, 4)] (DeepGEMM's TMA-aligned layout on SM90),
                      handed out as storage.t()[:T]: shape [T, G], strides (1, round_up(T, 4)); the
                      padding columns T .. round_up(T, 4) of the storage are written 0 by us.
    """

    ROW_MAJOR = "row_major"
    COLUMN_MAJOR = "column_major"
    COLUMN_MAJOR_TMA = "column_major_tma"


class SFLayout(str, enum.Enum):
    """NVFP4 scale-factor layouts; SWIZZLED_128x4 matches FlashInfer's
    QuantizationSFLayout.SWIZZLED_128x4."""

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
    """Optional quantization of norm_out (x = norm_out rounded to the activation dtype, as fp32).

    fp8:   q = e4m3_satfinite(x / scale)   -- `scale` is a divisor.
    nvfp4: 16-element blocks, e4m3 block scales, `global_scale` is a multiplier
    (usually 448*6/amax).
    fp8_per_token_group: per group of `group_size` contiguous elements of a row (vLLM 0.34's
           `_per_token_group_quant_fp8`): scale = max(amax, 1e-10) * fp32(1/448) (a multiply by
           the fp32 reciprocal), q = e4m3(clamp(x / scale, -448, 448)); a group holding a NaN gets
           codes 0x7F and a NaN scale; every NaN code is written 0x7F. hidden_size % group_size
           must be 0. The fp32 scales [T, G] (G = H / group_size) in `scale_layout`:
             row_major:        [T, G] contiguous;
             column_major:     storage [G, T], handed out as its transpose, strides (1, T);
             column_major_tma: storage [G, round_up(T, 4)], handed out as storage.t()[:T],
                               strides (1, round_up(T, 4)); padding columns written 0.
    fp8_per_token: the same formula with the whole row as one group; scales fp32 [T, 1].
    A field the kind does not use is None (sf_layout aside: it keeps its default).
    """

    kind: QuantKind = QuantKind.NONE
    scale: float | None = None
    global_scale: float | None = None
    sf_layout: SFLayout = SFLayout.SWIZZLED_128x4
    group_size: int | None = None
    scale_layout: ScaleLayout | None = None

    @staticmethod
    def none() -> "QuantSpec":
        return QuantSpec()

    @staticmethod
    def fp8(scale: float) -> "QuantSpec":
        return QuantSpec(QuantKind.FP8, scale=scale)

    @staticmethod
    def nvfp4(
        global_scale: float, sf_layout: SFLayout | str = SFLayout.SWIZZLED_128x4
    ) -> "QuantSpec":
        return QuantSpec(QuantKind.NVFP4, global_scale=global_scale, sf_layout=sf_layout)

    @staticmethod
    def fp8_per_token_group(
        group_size: int = 128, scale_layout: ScaleLayout | str = ScaleLayout.ROW_MAJOR
    ) -> "QuantSpec":
        """Dynamic FP8 with one fp32 scale per `group_size` elements of a row, in `scale_layout`."""
        return QuantSpec(
            QuantKind.FP8_PER_TOKEN_GROUP, group_size=group_size, scale_layout=scale_layout
        )

    @staticmethod
    def fp8_per_token() -> "QuantSpec":
        """Dynamic FP8 with one fp32 scale per row (scales [T, 1])."""
        return QuantSpec(QuantKind.FP8_PER_TOKEN)

    @property
    def dynamic_fp8(self) -> bool:
        """Whether the kind computes its FP8 scales at run time (per token group or per token)."""
        return self.kind in (QuantKind.FP8_PER_TOKEN_GROUP, QuantKind.FP8_PER_TOKEN)

    def __post_init__(self) -> None:
        """Check every field, then normalise: kind and the layouts to their enums, scales to float,
        group_size to int."""
        kind = _enum_field("quant.kind", QuantKind, self.kind)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(
            self, "sf_layout", _enum_field("quant.sf_layout", SFLayout, self.sf_layout)
        )
        for name, needed_by in (("scale", QuantKind.FP8), ("global_scale", QuantKind.NVFP4)):
            value = getattr(self, name)
            if kind is needed_by:
                value = _real_field(
                    f"quant.{name}",
                    value,
                    f"a positive float in [{FP32_TINY:.3g}, {FP32_MAX:.3g}] (a normal fp32 "
                    f"number) for {kind.value}",
                    positive=True,
                    low=FP32_TINY,
                )
            # a scale the kind does not use is a mistake, and would differ silently across ranks
            else:
                _require(value is None, f"quant.{name}", f"None for kind {kind.value!r}", value)
            object.__setattr__(self, name, value)
        group_size, scale_layout = self.group_size, self.scale_layout
        if kind is QuantKind.FP8_PER_TOKEN_GROUP:
            is_int = isinstance(group_size, numbers.Integral) and not isinstance(group_size, bool)
            _require(
                is_int and int(group_size) in FP8_GROUP_SIZES,
                "quant.group_size",
                f"a power of two in [{FP8_GROUP_SIZES[0]}, {FP8_GROUP_SIZES[-1]}] for "
                f"{kind.value} (the kernels hold a group as a power-of-two block)",
                group_size,
                show_type=not is_int,
            )
            object.__setattr__(self, "group_size", int(group_size))
            object.__setattr__(
                self, "scale_layout", _enum_field("quant.scale_layout", ScaleLayout, scale_layout)
            )
        else:
            if isinstance(scale_layout, str):
                _enum_field("quant.scale_layout", ScaleLayout, scale_layout)  # UE8M0 has a reason
            for name, value in (("group_size", group_size), ("scale_layout", scale_layout)):
                _require(value is None, f"quant.{name}", f"None for kind {kind.value!r}", value)


@dataclass(frozen=True)
class EpilogueSpec:
    """Static per-layer description of the MoE epilogue.

    hidden_size: H. top_k: K (columns of the index map). dtype: activation dtype, bf16 or fp16.
    eps, weight_bias: RMSNorm uses (gamma + weight_bias): 1.0 for a zero-centred (Gemma-style)
    norm whose stored weight is gamma, 0.0 when gamma is already the multiplier as applied (e.g.
    SGLang's fused_norm_gamma()). routed_scaling_factor multiplies the top-k sum: the factor the
    expert weights do not carry yet, so 1.0 where the routing folded the model's factor into them
    (never the model's value then: it would apply twice).
    has_shared_output: whether shared_output is passed. shared_output_replicated: False (the
    default): it is each rank's partial, summed over the ranks like the routed partials; True: it
    is the whole shared expert's output, the same on every rank, and the bridge adds it once (the
    group's rank 0 adds it, the other ranks add zeros: exact, the same collectives on every rank;
    those ranks hold one [max_tokens, H] zero buffer per device, dtype and H, shared by the
    process's bridges). True needs has_shared_output=True. max_tokens: the largest T a call may
    carry; workspaces are sized for it.
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
    shared_output_replicated: bool = False

    def __post_init__(self) -> None:
        """Check every field's type and value (ints are ints, not bools; floats are finite real
        numbers, not strings or bools), then normalise ints to int and floats to float, so
        `to_dict()` is the same JSON on every rank whether a caller wrote 2 or 2.0."""
        set_ = functools.partial(object.__setattr__, self)
        set_("hidden_size", _int_field("hidden_size", self.hidden_size))
        set_("top_k", _int_field("top_k", self.top_k))
        _require(
            isinstance(self.dtype, torch.dtype) and self.dtype in ACTIVATION_DTYPES,
            "dtype",
            "torch.bfloat16 or torch.float16",
            self.dtype,
        )
        # the kernels compute in fp32: a value fp32 rounds to 0 or inf would change the result
        set_(
            "eps",
            _real_field(
                "eps",
                self.eps,
                f"a positive float in [{FP32_TINY:.3g}, {MAX_EPS:g}] (a normal fp32 number; an "
                "eps that is 0 in fp32 turns an all-zero row into NaN, one above 1 outweighs the "
                "mean square it regularises)",
                positive=True,
                low=FP32_TINY,
                high=MAX_EPS,
            ),
        )
        finite32 = f"a float of magnitude <= {FP32_MAX:.3g} (finite in fp32)"
        set_("weight_bias", _real_field("weight_bias", self.weight_bias, finite32))
        set_(
            "routed_scaling_factor",
            _real_field(
                "routed_scaling_factor",
                self.routed_scaling_factor,
                f"a positive float <= {MAX_ROUTED_SCALING:g} (models scale the routed sum by a "
                "small positive factor; a larger one overflows bf16/fp16 partials)",
                positive=True,
                high=MAX_ROUTED_SCALING,
            ),
        )
        _require(
            isinstance(self.has_shared_output, bool),
            "has_shared_output",
            "a bool (True or False)",
            self.has_shared_output,
            show_type=True,
        )
        _require(
            isinstance(self.shared_output_replicated, bool),
            "shared_output_replicated",
            "a bool (True or False)",
            self.shared_output_replicated,
            show_type=True,
        )
        _require(
            self.has_shared_output or not self.shared_output_replicated,
            "shared_output_replicated",
            "False when has_shared_output=False (there is no shared output to add once)",
            self.shared_output_replicated,
        )
        set_("max_tokens", _int_field("max_tokens", self.max_tokens))
        _require(self.top_k <= MAX_TOP_K, "top_k", f"<= {MAX_TOP_K}", self.top_k)
        _require(
            self.hidden_size <= MAX_HIDDEN_SIZE,
            "hidden_size",
            f"<= {MAX_HIDDEN_SIZE}",
            self.hidden_size,
        )
        # the kernels index [T, H] rows and [T, K] maps with 32-bit offsets
        for name, width in (("hidden_size", self.hidden_size), ("top_k", self.top_k)):
            _require(
                self.max_tokens * width <= INT32_MAX,
                "max_tokens",
                f"<= {INT32_MAX // width} so that max_tokens * {name} ({width}) fits the kernels' "
                f"32-bit offsets ({INT32_MAX})",
                self.max_tokens,
            )
        _require(
            isinstance(self.quant, QuantSpec), "quant", "a QuantSpec", type(self.quant).__name__
        )
        if self.quant.kind is QuantKind.NVFP4:
            _require(
                self.hidden_size % NVFP4_BLOCK == 0,
                "hidden_size",
                f"a multiple of {NVFP4_BLOCK} for nvfp4",
                self.hidden_size,
            )
        if self.quant.kind is QuantKind.FP8_PER_TOKEN_GROUP:
            group_size = self.quant.group_size
            _require(
                self.hidden_size % group_size == 0,
                "hidden_size",
                f"a multiple of quant.group_size ({group_size}) for fp8_per_token_group: "
                f"hidden_size {self.hidden_size} % group_size {group_size} = "
                f"{self.hidden_size % group_size}",
                self.hidden_size,
            )

    @property
    def dtype_name(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]

    def to_dict(self) -> dict:
        """The spec as JSON-able values. The dynamic FP8 fields (group_size, scale_layout) appear
        under "quant" only when set, so a spec without them has the dict it had before them."""
        quant = {
            "kind": self.quant.kind.value,
            "scale": self.quant.scale,
            "global_scale": self.quant.global_scale,
            "sf_layout": self.quant.sf_layout.value,
        }
        if self.quant.group_size is not None:
            quant["group_size"] = self.quant.group_size
        if self.quant.scale_layout is not None:
            quant["scale_layout"] = self.quant.scale_layout.value
        return {
            "hidden_size": self.hidden_size,
            "top_k": self.top_k,
            "dtype": self.dtype_name,
            "eps": self.eps,
            "weight_bias": self.weight_bias,
            "routed_scaling_factor": self.routed_scaling_factor,
            "has_shared_output": self.has_shared_output,
            "max_tokens": self.max_tokens,
            "shared_output_replicated": self.shared_output_replicated,
            "quant": quant,
        }


DTYPE_BY_NAME = {"bf16": torch.bfloat16, "fp16": torch.float16}


def sf_shape(tokens: int, hidden: int, layout: SFLayout) -> tuple[int, int]:
    """The NVFP4 scale tensor's shape for [T, H] in `layout`: linear [T, H/16]; swizzled
    [round_up(T, 128), round_up(H/16, 4)] (the padding is written as 0)."""
    blocks = hidden // NVFP4_BLOCK
    if layout is SFLayout.LINEAR:
        return (tokens, blocks)
    return (-(-tokens // 128) * 128, -(-blocks // 4) * 4)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def fp8_scale_columns(hidden: int, quant: QuantSpec) -> int:
    """G, the scales per row of a dynamic FP8 kind: H / group_size, or 1 per token."""
    if quant.kind is QuantKind.FP8_PER_TOKEN_GROUP:
        return hidden // quant.group_size
    return 1


def fp8_scale_storage_shape(tokens: int, groups: int, layout: ScaleLayout) -> tuple[int, int]:
    """The shape of the storage behind a per-token-group scale view: row_major [T, G];
    column_major [G, T]; column_major_tma [G, round_up(T, 4)]."""
    if layout is ScaleLayout.ROW_MAJOR:
        return (tokens, groups)
    if layout is ScaleLayout.COLUMN_MAJOR:
        return (groups, tokens)
    return (groups, round_up(tokens, 4))
