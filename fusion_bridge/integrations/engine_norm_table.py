"""The engines' norm classes by exact name (vLLM's and SGLang's `RMSNorm` / `GemmaRMSNorm`): what
the bridge needs from each, for `engine_norms` (the adapters' one lookup of norm classes) and for
`hf_families.norm_weight_offset`, which asks this table first. A values module: it imports neither
of them, so neither import goes in a circle."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class EngineNorm(NamedTuple):
    """What the bridge needs from an engine norm class: the offset its forward adds to the stored
    weight, and the attribute names of the stored weight and of eps."""

    offset: float
    weight_attr: str
    eps_attr: str


# The engine norm classes, by `module.qualname`, as their sources define them: vLLM 0.34.0
# `vllm/model_executor/layers/layernorm.py`, SGLang 0.5.23 `sglang/srt/layers/layernorm.py`.
# vLLM's GemmaRMSNorm forward multiplies by `self.weight.float() + 1.0`; SGLang's by
# `1.0 + self.weight.float()` (its `gemma_weight` buffer holds that sum, pre-folded).
ENGINE_NORMS = {
    "vllm.model_executor.layers.layernorm.RMSNorm": EngineNorm(0.0, "weight", "variance_epsilon"),
    "vllm.model_executor.layers.layernorm.GemmaRMSNorm": EngineNorm(
        1.0, "weight", "variance_epsilon"
    ),
    "sglang.srt.layers.layernorm.RMSNorm": EngineNorm(0.0, "weight", "variance_epsilon"),
    "sglang.srt.layers.layernorm.GemmaRMSNorm": EngineNorm(1.0, "weight", "variance_epsilon"),
}


def class_path(cls: type) -> str:
    """`module.qualname` of a class: the key of ENGINE_NORMS."""
    return f"{cls.__module__}.{cls.__qualname__}"


def engine_norm_offset(norm: torch.nn.Module | type) -> Optional[float]:
    """The weight offset of an engine norm class or module (0.0 for `RMSNorm`, 1.0 for
    `GemmaRMSNorm`, vLLM's and SGLang's), or None for a class that is not one of them (the
    engines' table only: hf_families.norm_weight_offset asks it first)."""
    known = ENGINE_NORMS.get(class_path(norm if isinstance(norm, type) else type(norm)))
    return None if known is None else known.offset
