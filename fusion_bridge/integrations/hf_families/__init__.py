"""The transformers MoE families the adapter supports (one module per family, each read from
transformers' own modeling file of that family), and how a model is matched to one.

A model is matched by its language model's `config.model_type` (a multimodal wrapper's by the
wrapper's type, then its language model's), never by its class name alone; `family_of` returns the
family and the language model whose decoder layers the patch moves. Anything else raises
UnsupportedModelError naming every supported model type.
"""

from __future__ import annotations

import torch

from fusion_bridge.integrations.hf_families.base import (
    BRIDGE_DTYPES,
    Family,
    UnsupportedModelError,
)
from fusion_bridge.integrations.hf_families.checks import (
    check_moe_block,
    check_rmsnorm,
    is_moe_block,
)
from fusion_bridge.integrations.hf_families.deepseek_v2 import DeepseekV2
from fusion_bridge.integrations.hf_families.deepseek_v3 import DeepseekV3
from fusion_bridge.integrations.hf_families.glm4_moe import Glm4Moe
from fusion_bridge.integrations.hf_families.gpt_oss import GptOss
from fusion_bridge.integrations.hf_families.minimax_m2 import MiniMaxM2
from fusion_bridge.integrations.hf_families.mixtral import Mixtral
from fusion_bridge.integrations.hf_families.qwen2_moe import Qwen2Moe
from fusion_bridge.integrations.hf_families.qwen3_5_moe import Qwen3_5Moe
from fusion_bridge.integrations.hf_families.qwen3_moe import Qwen3Moe

__all__ = [
    "BRIDGE_DTYPES",
    "FAMILIES",
    "Family",
    "UnsupportedModelError",
    "check_moe_block",
    "check_rmsnorm",
    "family_of",
    "is_moe_block",
    "supported_text",
]

FAMILIES: tuple[Family, ...] = (
    DeepseekV3(),
    DeepseekV2(),
    Glm4Moe(),
    Qwen2Moe(),
    Qwen3Moe(),
    Qwen3_5Moe(),
    Mixtral(),
    MiniMaxM2(),
    GptOss(),
)
# config.model_type -> family, for language models and for the wrappers around them
BY_TEXT_TYPE = {t: f for f in FAMILIES for t in f.model_types}
BY_WRAPPER_TYPE = {t: f for f in FAMILIES for t in f.wrappers}


def supported_text() -> str:
    """Every model type the adapter accepts, with its family, for error messages."""
    types = [(t, f.name) for f in FAMILIES for t in f.model_types + f.wrappers]
    return ", ".join(f"{t!r} ({name})" for t, name in types)


def family_of(model: torch.nn.Module) -> tuple[Family, torch.nn.Module]:
    """(family, language model holding `.layers` and `.norm`) of a transformers model, or
    UnsupportedModelError saying what is supported or what is in the way (quantization)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = BY_WRAPPER_TYPE.get(model_type) or BY_TEXT_TYPE.get(model_type)
    if family is None:
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
    text = _language_model(model)
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


def _language_model(model: torch.nn.Module):
    """The module with the decoder stack: the model itself (a …Model), its base model (a
    …ForCausalLM: `.model`), or a wrapper's language model (`.model.language_model`)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model") or "model", None)
    for candidate in (
        model,
        base,
        getattr(base, "language_model", None),
        getattr(model, "language_model", None),
    ):
        layers = getattr(candidate, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and getattr(candidate, "norm", None) is not None:
            return candidate
    return None
