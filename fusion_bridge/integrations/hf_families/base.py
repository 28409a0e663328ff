"""What a transformers MoE family tells the adapter (a frozen record: `Family`), the norm-offset
lookup every adapter shares (`norm_weight_offset`), and the error for a model it cannot patch.

A family is data read from transformers' own modeling file of its model type, not re-derived: the
patch calls the block's own router module, its experts' own `_apply_gate` and its shared expert's
own weights, so routing and activation stay theirs bit for bit. A row states only what their code
does *after* those modules and what the bridge must do in their place. The behaviours a row
selects (one implementation each, here):
  - routing: call the router (`router_attr`) on x, with the block's `router_args` after it; its
    top-k weights are the bridge's, except that where `scaled_router` the router has multiplied
    them by its `routed_scaling_factor`, which is divided out (fp32) and given to the bridge;
    `block_scaling`: the block multiplies its routed output by its own `routed_scaling_factor`
    (minimax_m3_vl), which the bridge applies; `scaling_attr`: the router's (or block's)
    attribute holding that factor (hy_v3's router calls it `router_scaling_factor`);
  - shared expert (`shared_attr`): an MLP of gate/up/down linears, or of a fused input / output
    linear (granitemoeshared's `input_linear` [2I, H] and `output_linear`); each rank adds its
    slice of the intermediate columns; `shared_gate_attr`: scaled per token by sigmoid(that
    linear(x)); `shared_act(module, gate, up)`: the shared MLP's own activation where it is not
    act_fn(gate) * up (minimax_m3_vl's clamped GLU); `shared_on_layer`: the shared MLP is the
    decoder layer's, added by the layer as `moe + shared_mlp(x)` (granitemoeshared), not the
    block's;
  - `block_returns`: "tensor", or "pair" (the block returns (output, router scores) and its layer
    unpacks the pair);
  - `moe_attr`: the decoder layer's attribute holding the MoE block ("mlp"; granitemoe:
    "block_sparse_moe");
  - `residual_multiplier`: the decoder layer's attribute m of `residual + h * m` (granitemoe),
    folded into the scaling of both partials (the bridge computes residual + m * (routed +
    shared));
  - the next norm multiplies by (weight + `weight_bias`), checked against `norm_weight_offset`.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from fusion_bridge.integrations.engine_norm_table import engine_norm_offset

BRIDGE_DTYPES = (torch.bfloat16, torch.float16)


class UnsupportedModelError(ValueError):
    """The model (or one of its layers) is not one the adapter knows how to patch."""


@dataclass(frozen=True)
class Family:
    """One row of the family table (see the module docstring for the behaviours).

    name: how errors and reports name it. model_types: the `config.model_type` values of the
    language model it covers (an alias such as 'kimi_k2' included). source: the transformers file
    the row was read from, with what it says. wrappers: model types of multimodal models whose
    language model is this family (found at one of `text_paths`); the patch moves that language
    model's MoE layers and leaves the other towers alone. modeling: the transformers.models
    subpackage(s) the MoE blocks' and norms' classes must come from (remote code is refused).
    """

    name: str
    model_types: tuple[str, ...]
    modeling: tuple[str, ...]
    source: str
    wrappers: tuple[str, ...] = ()
    text_paths: tuple[str, ...] = ("model.language_model",)
    router_attr: str = "gate"
    router_args: tuple[str, ...] = ()
    scaled_router: bool = False
    block_scaling: bool = False
    scaling_attr: str = "routed_scaling_factor"
    shared_attr: Optional[str] = None
    shared_gate_attr: Optional[str] = None
    shared_on_layer: bool = False
    shared_act: Optional[Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = (
        None
    )
    block_returns: str = "tensor"
    moe_attr: str = "mlp"
    residual_multiplier: Optional[str] = None
    weight_bias: float = 0.0
    # why the row is refused on a CUDA device (its GPU check has not passed yet); None: it passed
    cuda_refusal: Optional[str] = None

    def check_device(self, device: torch.device) -> None:
        """Refuse a model on a device this row has not been verified on (`cuda_refusal`)."""
        if device.type == "cuda" and self.cuda_refusal is not None:
            raise UnsupportedModelError(
                f"patch_moe_epilogues: {self.name} is not supported on CUDA yet: "
                f"{self.cuda_refusal}; on the CPU it is"
            )

    def moe_block(self, layer: torch.nn.Module) -> Optional[torch.nn.Module]:
        """The decoder layer's MoE block (a module with `experts`), or None for a dense layer."""
        block = getattr(layer, self.moe_attr, None)
        return block if hasattr(block, "experts") else None

    def multiplier(self, layer: torch.nn.Module) -> float:
        """m of the layer's `residual + h * m` (1.0 where the family has none), refused where it
        is not a finite nonzero number."""
        if self.residual_multiplier is None:
            return 1.0
        value = getattr(layer, self.residual_multiplier, None)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UnsupportedModelError(
                f"patch_moe_epilogues: a {self.name} decoder layer must hold a number at "
                f".{self.residual_multiplier}, got {type(value).__name__}"
            )
        if not math.isfinite(value) or value == 0:
            raise UnsupportedModelError(
                f"patch_moe_epilogues: {self.name}'s {self.residual_multiplier} must be a nonzero "
                f"finite number, got {value}"
            )
        return float(value)

    def shared_module(
        self, block: torch.nn.Module, layer: Optional[torch.nn.Module] = None
    ) -> Optional[torch.nn.Module]:
        """The shared expert of the block (or of its decoder layer where `shared_on_layer`), or
        None (the family has none, or this config builds none)."""
        owner = layer if self.shared_on_layer else block
        return getattr(owner, self.shared_attr, None) if self.shared_attr and owner else None

    def router(self, block: torch.nn.Module) -> torch.nn.Module:
        """The block's router module."""
        return getattr(block, self.router_attr)

    def top_k(self, block: torch.nn.Module) -> int:
        """How many experts the router picks per token."""
        return int(self.router(block).top_k)

    def routing(self, block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's own router on x [T, H] -> (expert weights [T, K] as the bridge multiplies
        them before routed scaling, expert ids [T, K] int64)."""
        extra = [getattr(block, name) for name in self.router_args]
        _, weights, ids = self.router(block)(x, *extra)
        if self.scaled_router:
            # the router multiplied its fp32 weights by routed_scaling_factor; the bridge applies
            # the factor itself (fp32, after the top-k sum), so it is divided out here in fp32:
            # w*s/s is w within one fp32 rounding, far below the bf16 roundings that count
            weights = weights / self.routed_scaling(block)
        return weights, ids

    def routed_scaling(self, block: torch.nn.Module) -> float:
        """The factor the bridge multiplies the weighted sum by (1.0: none)."""
        if self.block_scaling:
            return scaling_factor(block, self.scaling_attr)
        if self.scaled_router:
            return scaling_factor(self.router(block), self.scaling_attr)
        return 1.0

    def shared_output(
        self, block: torch.nn.Module, x: torch.Tensor, partial: torch.Tensor
    ) -> torch.Tensor:
        """This rank's share of the block's shared output from its share of the shared expert's
        output (`partial`, [T, H]): the gate is a per-token scalar, so gating each rank's partial
        sums to the gated whole (the same ops in the same dtype as the block's own forward)."""
        if self.shared_gate_attr is None:
            return partial
        return torch.sigmoid(getattr(block, self.shared_gate_attr)(x)) * partial

    def block_output(self, handoff: torch.Tensor):
        """What the patched block returns to its decoder layer in place of its output."""
        return (handoff, None) if self.block_returns == "pair" else handoff


def scaling_factor(router: torch.nn.Module, attr: str = "routed_scaling_factor") -> float:
    """router.<attr> (its routed scaling factor) as a float, refused where dividing it out would
    not be exact (zero, inf, nan)."""
    factor = float(getattr(router, attr))
    if not math.isfinite(factor) or factor == 0:
        raise UnsupportedModelError(
            f"patch_moe_epilogues: the router's {attr} must be a nonzero finite "
            f"number (the bridge applies it after dividing it out of the router's weights), got "
            f"{factor}"
        )
    return factor


_ZERO_CENTRED = ("(1.0 + self.weight", "(1 + self.weight", "(self.weight + 1")
_PLAIN = (
    "self.weight * hidden_states",
    "(self.weight * hidden_states",
    "(self.weight.to(torch.float32) * hidden_states",  # lara_mini: the weight applied in fp32
)


def norm_weight_offset(norm: Union[torch.nn.Module, type]) -> float:
    """The offset b of an RMSNorm class or module that multiplies the normalized row by
    (weight + b): 0.0 for the Llama-style norm, 1.0 for a zero-centred one. vLLM's and SGLang's
    classes by their exact qualified name (engine_norm_table.ENGINE_NORMS, the engines' one
    table); any other class is read from its forward's source (`(1.0 + self.weight` / `self.weight *
    hidden_states`). Raises UnsupportedModelError naming the class when neither says."""
    cls = norm if isinstance(norm, type) else type(norm)
    known = engine_norm_offset(cls)
    if known is not None:
        return known
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        source = ""
    zero_centred = any(s in source for s in _ZERO_CENTRED)
    plain = any(s in source for s in _PLAIN)
    if zero_centred != plain:
        return 1.0 if zero_centred else 0.0
    raise UnsupportedModelError(
        f"norm_weight_offset: cannot tell whether {cls.__module__}.{cls.__name__} multiplies by "
        "weight or by (1 + weight): its forward says neither (or both)"
    )
