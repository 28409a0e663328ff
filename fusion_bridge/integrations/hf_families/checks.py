"""The checks that refuse a layer the patch cannot move onto the bridge: a block from other code
than transformers' own modeling file of its family (remote code), an expert layout the adapter's
expert path does not compute (quantized weights, scale tensors, no gate, a post-expert norm, odd
shapes), a shared expert that is not a bias-free MLP, and a norm that is not the family's RMSNorm.

Every error names the layer, what was expected and what was found.
"""

from __future__ import annotations

import torch

from fusion_bridge.integrations.hf_families.base import (
    BRIDGE_DTYPES,
    Family,
    UnsupportedModelError,
    norm_weight_offset,
)


def is_moe_block(mlp: torch.nn.Module) -> bool:
    return hasattr(mlp, "experts")


def check_moe_block(
    family: Family, block: torch.nn.Module, where: str, hidden: int, layer=None
) -> None:
    """Refuse an MoE block whose code or expert layout the patch does not understand."""
    origin = type(block).__module__
    if not _from_modeling(family, block):
        raise UnsupportedModelError(
            f"patch_moe_epilogues: {where} must be transformers' own {family.name} MoE block "
            f"(a class of transformers.models.{family.modeling[0]}), got {type(block).__name__} "
            "from "
            f"{origin} (a model loaded with trust_remote_code=True runs its repository's code: "
            "load it without trust_remote_code)"
        )
    router = getattr(block, family.router_attr, None)
    top_k = getattr(router, "top_k", None)
    if not isinstance(router, torch.nn.Module) or not isinstance(top_k, int):
        raise UnsupportedModelError(
            f"patch_moe_epilogues: {where}.{family.router_attr} must be the block's router (a "
            f"module with an integer top_k), got {type(router).__name__}"
        )
    _check_experts(block.experts, where, hidden)
    shared = family.shared_module(block, layer)
    if shared is not None:
        _check_shared(family, shared, where, block.experts.gate_up_proj.dtype)


def _from_modeling(family: Family, module: torch.nn.Module) -> bool:
    origin = type(module).__module__
    return any(origin.startswith(f"transformers.models.{m}.") for m in family.modeling)


def _check_experts(experts: torch.nn.Module, where: str, hidden: int) -> None:
    transposed = bool(getattr(experts, "is_transposed", False))
    if transposed:
        expected = "gate_up_proj [E, H, 2I] and down_proj [E, I, H] (transposed)"
    else:
        expected = "gate_up_proj [E, 2I, H] and down_proj [E, H, I]"
    expected = f"unquantized bf16/fp16 {expected}"
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        raise UnsupportedModelError(
            f"patch_moe_epilogues: {where}.experts ({type(experts).__name__}) must hold "
            f"{expected}; it has {sorted(n for n, _ in experts.named_parameters(recurse=False))}"
        )
    for name, t in (("gate_up_proj", gate_up), ("down_proj", down)):
        if t.dtype not in BRIDGE_DTYPES:
            raise UnsupportedModelError(
                f"patch_moe_epilogues: {where}.experts.{name} must be bf16 or fp16 ({expected}), "
                f"got {t.dtype} (a quantized expert layout is not supported)"
            )
    tensors = list(experts.named_parameters(recurse=False)) + list(
        experts.named_buffers(recurse=False)
    )
    scales = [n for n, _ in tensors if "scale" in n or "zero" in n]
    # the flags transformers' use_experts_implementation sets; the adapter computes any
    # is_transposed / has_bias / is_concatenated (the experts' own _apply_gate splits gate and up)
    flags = {"has_gate": True, "has_post_expert_norm": False}
    odd = {k: getattr(experts, k) for k, v in flags.items() if getattr(experts, k, v) != v}
    if not callable(getattr(experts, "_apply_gate", None)):
        odd["_apply_gate"] = "missing"
    e, h = gate_up.shape[0], hidden
    if gate_up.dim() == 3 and down.dim() == 3:
        rows, cols = gate_up.shape[1], gate_up.shape[2]
        gate_up_in, two_i = (rows, cols) if transposed else (cols, rows)
        down_shape = (e, two_i // 2, h) if transposed else (e, h, two_i // 2)
        shapes_ok = gate_up_in == h and two_i % 2 == 0 and tuple(down.shape) == down_shape
    else:
        shapes_ok = False
    if shapes_ok and getattr(experts, "has_bias", False):
        biases = {
            "gate_up_proj_bias": (e, two_i),
            "down_proj_bias": (e, h),
        }
        for name, shape in biases.items():
            bias = getattr(experts, name, None)
            if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != shape:
                odd[name] = None if bias is None else tuple(bias.shape)
    if scales or odd or not shapes_ok:
        raise UnsupportedModelError(
            f"patch_moe_epilogues: {where}.experts must hold {expected} (H={h}); got gate_up_proj "
            f"{tuple(gate_up.shape)}, down_proj {tuple(down.shape)}"
            + (f", scale tensors {scales}" if scales else "")
            + (f", layout {odd}" if odd else "")
        )


def _check_shared(family: Family, shared: torch.nn.Module, where: str, dtype) -> None:
    name = family.shared_attr
    if hasattr(shared, "input_linear"):
        names, act = ("input_linear", "output_linear"), getattr(shared, "activation", None)
    elif hasattr(shared, "gate_up_proj"):
        names, act = ("gate_up_proj", "down_proj"), family.shared_act
    else:
        names, act = ("gate_proj", "up_proj", "down_proj"), getattr(shared, "act_fn", None)
    fused = len(names) == 2
    projections = [getattr(shared, p, None) for p in names]
    if not all(isinstance(p, torch.nn.Linear) and p.bias is None for p in projections) or (
        not callable(act)
    ):
        raise UnsupportedModelError(
            f"patch_moe_epilogues: {where}'s {name} must be an MLP of bias-free nn.Linear "
            f"gate_proj / up_proj / down_proj with act_fn, input_linear / output_linear with "
            f"activation, or gate_up_proj / down_proj with the row's shared_act (the shared "
            f"expert of {family.name}), got {type(shared).__name__}"
        )
    if fused and projections[0].weight.shape[0] != 2 * projections[1].weight.shape[1]:
        raise UnsupportedModelError(
            f"patch_moe_epilogues: {where}'s {name}.{names[0]} must be [2I, H] for a "
            f"{names[1]} [H, I], got {tuple(projections[0].weight.shape)}"
        )
    if any(p.weight.dtype != dtype for p in projections):
        raise UnsupportedModelError(
            f"patch_moe_epilogues: {where}'s {name} weights must be {dtype} like the routed "
            f"experts, got {[str(p.weight.dtype) for p in projections]}"
        )


def check_rmsnorm(family: Family, norm: torch.nn.Module, where: str, hidden: int) -> float:
    """The norm the bridge computes in place of `norm`: (weight + the family's weight_bias) * x /
    rms(x), eps as stored (`variance_epsilon`, or `eps` in the zero-centred norms). The class
    must be the family's own RMSNorm, and its forward must multiply by (weight + the offset the
    family states: norm_weight_offset). Returns eps."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if (
        not type(norm).__name__.endswith("RMSNorm")
        or not _from_modeling(family, norm)
        or not isinstance(weight, torch.Tensor)
        or tuple(weight.shape) != (hidden,)
        or not isinstance(eps, float)
    ):
        raise UnsupportedModelError(
            f"patch_moe_epilogues: {where} must be {family.name}'s RMSNorm (a class of "
            f"transformers.models.{family.modeling[0]}, weight [{hidden}], a float eps), got "
            f"{type(norm).__name__} from {type(norm).__module__}"
        )
    offset = norm_weight_offset(norm)
    if offset != family.weight_bias:
        raise UnsupportedModelError(
            f"patch_moe_epilogues: {where} ({type(norm).__name__}) multiplies by (weight + "
            f"{offset}), but the {family.name} row says (weight + {family.weight_bias})"
        )
    return eps
