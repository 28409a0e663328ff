"""What the transformers adapter knows about each MoE family it supports, and the checks that refuse
a model it cannot patch (unsupported family, quantized or otherwise unknown expert layout).

Both supported families (transformers 5.x) store a layer's routed experts as two 3-D tensors,
`experts.gate_up_proj` [E, 2I, H] (gate rows first, then up rows) and `experts.down_proj` [E, H, I],
and route with `mlp.gate(x) -> (router_logits, top_k_weights [T, K], top_k_index [T, K])`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

BRIDGE_DTYPES = (torch.bfloat16, torch.float16)


class UnsupportedModelError(ValueError):
    """The model (or one of its layers) is not one the adapter knows how to patch."""


class Family:
    """One model family: how its MoE block routes and where its shared expert is."""

    name = ""
    model_type = ""
    shared_expert_attr: Optional[str] = None

    def routing(self, block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's own router on x [T, H] -> (expert weights [T, K] before routed scaling,
        expert ids [T, K] int64)."""
        _, weights, ids = block.gate(x)
        return weights, ids

    def routed_scaling(self, block: torch.nn.Module) -> float:
        return 1.0


class DeepseekV3(Family):
    """DeepSeek-V3 (and models published under its architecture, e.g. Kimi-K2): sigmoid scores,
    grouped top-k (n_group / topk_group), routed_scaling_factor, one shared expert (an MLP of
    n_shared_experts * moe_intermediate_size); the first `first_k_dense_replace`
    layers are dense."""

    name = "DeepSeek-V3"
    model_type = "deepseek_v3"
    shared_expert_attr = "shared_experts"

    def routing(self, block, x):
        # The router multiplies its fp32 weights by routed_scaling_factor; the bridge applies the
        # factor itself (in fp32, after the top-k sum), so it is divided out here in fp32: w*s/s
        # is w within one fp32 rounding (2^-24 relative), far below the bf16 roundings that count.
        _, weights, ids = block.gate(x)
        return weights / self.routed_scaling(block), ids

    def routed_scaling(self, block):
        factor = float(block.gate.routed_scaling_factor)
        if not math.isfinite(factor) or factor == 0:
            raise UnsupportedModelError(
                "patch_moe_epilogues: gate.routed_scaling_factor must be a nonzero finite number "
                "(the bridge applies it after dividing it out of the router's weights), got "
                f"{factor}"
            )
        return factor


class Qwen3Moe(Family):
    """Qwen3-MoE: softmax top-k (optionally renormalised), no shared expert, no routed scaling;
    layers listed in `mlp_only_layers` (or off the `decoder_sparse_step` grid) are dense."""

    name = "Qwen3-MoE"
    model_type = "qwen3_moe"


FAMILIES = {f.model_type: f for f in (DeepseekV3(), Qwen3Moe())}


def supported_text() -> str:
    return ", ".join(f"{t!r} ({f.name})" for t, f in FAMILIES.items())


def family_of(model: torch.nn.Module) -> Family:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"patch_moe_epilogues: model must be a transformers MoE model of a supported family "
            f"(config.model_type one of {supported_text()}), got model_type={model_type!r} "
            f"({type(model).__name__})"
        )
    quant = getattr(config, "quantization_config", None)
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else type(quant).__name__
        raise UnsupportedModelError(
            f"patch_moe_epilogues: quantized models are not supported (config.quantization_config: "
            f"{method}); the patch computes the experts from unquantized bf16/fp16 weights"
        )
    return FAMILIES[model_type]


def is_moe_block(mlp: torch.nn.Module) -> bool:
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def check_moe_block(family: Family, block: torch.nn.Module, where: str, hidden: int) -> None:
    """Refuse an MoE block whose expert layout the patch does not understand (quantized weights,
    transposed or interleaved gate/up, biases, an extra scale tensor, a missing shared expert)."""
    experts = block.experts
    expected = "unquantized bf16/fp16 gate_up_proj [E, 2I, H] and down_proj [E, H, I]"
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        raise UnsupportedModelError(
            f"patch_moe_epilogues: {where}.experts ({type(experts).__name__}) must hold "
            f"{expected}; "
            f"it has {sorted(n for n, _ in experts.named_parameters(recurse=False))}"
        )
    for name, t in (("gate_up_proj", gate_up), ("down_proj", down)):
        if t.dtype not in BRIDGE_DTYPES:
            raise UnsupportedModelError(
                f"patch_moe_epilogues: {where}.experts.{name} must be bf16 or fp16 ({expected}), "
                f"got {t.dtype} (a quantized expert layout is not supported)"
            )
    scales = [
        n
        for n, _ in list(experts.named_parameters(recurse=False))
        + list(experts.named_buffers(recurse=False))
        if "scale" in n or "zero" in n
    ]
    flags = {
        "is_transposed": False,
        "has_bias": False,
        "has_gate": True,
        "is_concatenated": True,
        "has_post_expert_norm": False,
    }
    odd = {k: getattr(experts, k) for k, v in flags.items() if getattr(experts, k, v) != v}
    e, h = gate_up.shape[0], hidden
    shapes_ok = (
        gate_up.dim() == 3
        and down.dim() == 3
        and gate_up.shape[2] == h
        and gate_up.shape[1] % 2 == 0
        and tuple(down.shape) == (e, h, gate_up.shape[1] // 2)
    )
    if scales or odd or not shapes_ok:
        raise UnsupportedModelError(
            f"patch_moe_epilogues: {where}.experts must hold {expected} (H={h}); got gate_up_proj "
            f"{tuple(gate_up.shape)}, down_proj {tuple(down.shape)}"
            + (f", scale tensors {scales}" if scales else "")
            + (f", layout flags {odd}" if odd else "")
        )
    if family.shared_expert_attr is not None:
        shared = getattr(block, family.shared_expert_attr, None)
        projections = [getattr(shared, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(p, torch.nn.Linear) and p.bias is None for p in projections):
            raise UnsupportedModelError(
                f"patch_moe_epilogues: {where}.{family.shared_expert_attr} must be an MLP of "
                "bias-free nn.Linear gate_proj / up_proj / down_proj (the shared expert of "
                f"{family.name}), got {type(shared).__name__}"
            )
        if any(p.weight.dtype != gate_up.dtype for p in projections):
            raise UnsupportedModelError(
                f"patch_moe_epilogues: {where}.{family.shared_expert_attr} weights must be "
                f"{gate_up.dtype} like the routed experts, got "
                f"{[str(p.weight.dtype) for p in projections]}"
            )


def check_rmsnorm(norm: torch.nn.Module, where: str, hidden: int) -> float:
    """The norm the bridge computes in place of `norm`: weight * x / rms(x), eps as stored.
    Returns eps."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", None)
    if (
        not type(norm).__name__.endswith("RMSNorm")
        or not isinstance(weight, torch.Tensor)
        or tuple(weight.shape) != (hidden,)
        or not isinstance(eps, float)
    ):
        raise UnsupportedModelError(
            f"patch_moe_epilogues: {where} must be the family's RMSNorm (weight [{hidden}], "
            f"variance_epsilon), got {type(norm).__name__}"
        )
    return eps
