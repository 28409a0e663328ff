"""The transformers MoE families the adapter supports (one table, `table.FAMILY_ROWS`, keyed by
`config.model_type`), how a model is matched to one, and why any other MoE model type is refused.

A model is matched by its language model's `config.model_type` (a multimodal wrapper's by the
wrapper's type, then its language model's), never by its class name alone; `family_of` returns the
family and the language model whose decoder layers the patch moves. A type without a row, or whose
installed modeling code differs from the structure the patch supports (structure.refusal), raises
UnsupportedModelError with that difference, at patch time.
"""

from __future__ import annotations

from typing import Optional

import torch

from fusion_bridge.integrations.hf_families.base import (
    BRIDGE_DTYPES,
    Family,
    UnsupportedModelError,
    norm_weight_offset,
)
from fusion_bridge.integrations.hf_families.checks import (
    check_moe_block,
    check_rmsnorm,
    is_moe_block,
)
from fusion_bridge.integrations.hf_families.structure import (
    modeling_module_of,
    moe_model_types,
    refusal,
)
from fusion_bridge.integrations.hf_families.stack import stack_refusal
from fusion_bridge.integrations.hf_families.table import FAMILY_ROWS

__all__ = [
    "BRIDGE_DTYPES",
    "FAMILIES",
    "Family",
    "UnsupportedModelError",
    "check_moe_block",
    "check_rmsnorm",
    "family_of",
    "is_moe_block",
    "moe_model_types",
    "norm_weight_offset",
    "refusal_of",
    "supported_text",
]

FAMILIES: tuple[Family, ...] = FAMILY_ROWS
# config.model_type -> family, for language models and for the wrappers around them
BY_TEXT_TYPE = {t: f for f in FAMILIES for t in f.model_types}
BY_WRAPPER_TYPE = {t: f for f in FAMILIES for t in f.wrappers}


def supported_text() -> str:
    """Every model type the adapter accepts, with its family, for error messages."""
    types = [(t, f.name) for f in FAMILIES for t in f.model_types + f.wrappers]
    return ", ".join(f"{t!r} ({name})" for t, name in types)


def refusal_of(model_type: str) -> Optional[str]:
    """Why a model type is refused (its structural difference, or no row in the family table),
    or None when it is supported. Reads the installed transformers' modeling source; builds
    nothing."""
    family = BY_WRAPPER_TYPE.get(model_type) or BY_TEXT_TYPE.get(model_type)
    # a row's structure is its language model's modeling file (a wrapper's file may hold none)
    module = family.modeling[0] if family is not None else modeling_module_of(model_type)
    multiplier_ok = family is not None and family.residual_multiplier is not None
    layer_shared = family.shared_attr if family is not None and family.shared_on_layer else None
    reason = refusal(module, multiplier_ok, layer_shared) if module else None
    # the type's own model class (a vision encoder or talker sharing a supported modeling file)
    reason = reason or (stack_refusal(model_type, module) if module else None)
    if reason is not None:
        return reason
    if family is None:
        return (
            "no row in the family table: what its router's weights carry and what its block "
            "adds after the experts are not established for this type"
        )
    return None


def family_of(model: torch.nn.Module) -> tuple[Family, torch.nn.Module]:
    """(family, language model holding `.layers` and `.norm`) of a transformers model, or
    UnsupportedModelError saying what is supported or what is in the way."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = BY_WRAPPER_TYPE.get(model_type) or BY_TEXT_TYPE.get(model_type)
    if family is None or (isinstance(model_type, str) and refusal_of(model_type)):
        why = refusal_of(model_type) if isinstance(model_type, str) else None
        raise UnsupportedModelError(
            f"patch_moe_epilogues: model_type={model_type!r} ({type(model).__name__}) is not "
            "supported"
            + (f": {why}" if why else "")
            + f". Supported: config.model_type one of {supported_text()}"
        )
    quant = getattr(config, "quantization_config", None)
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else type(quant).__name__
        raise UnsupportedModelError(
            f"patch_moe_epilogues: quantized models are not supported (config.quantization_config: "
            f"{method}); the patch computes the experts from unquantized bf16/fp16 weights"
        )
    text = _language_model(model, family)
    text_type = getattr(getattr(text, "config", None), "model_type", None)
    if text is None or BY_TEXT_TYPE.get(text_type) is not family:
        raise UnsupportedModelError(
            f"patch_moe_epilogues: a {model_type!r} model must hold a {family.name} language "
            f"model (config.model_type one of {list(family.model_types)}) with its decoder layers "
            f"at .layers and its final norm at .norm; found "
            + (
                f"{type(text).__name__} with model_type={text_type!r}"
                if text is not None
                else f"none in {type(model).__name__}"
            )
        )
    return family, text


def _language_model(model: torch.nn.Module, family: Family):
    """The module with the decoder stack: the model itself (a …Model), its base model (a
    …ForCausalLM: `.model`), or a wrapper's language model (the family's `text_paths`, e.g.
    `model.language_model`, `thinker.model.language_model`)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model") or "model", None)
    candidates = [model, base, getattr(base, "language_model", None)]
    for path in family.text_paths:
        node = model
        for part in path.split("."):
            node = getattr(node, part, None)
        candidates.append(node)
    for candidate in candidates:
        layers = getattr(candidate, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and getattr(candidate, "norm", None) is not None:
            return candidate
    return None
