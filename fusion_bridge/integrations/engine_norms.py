"""The next RMSNorm's weight for an engine handoff: a norm module, or a tensor named by its meaning.

An RMSNorm multiplies the normalized row by `weight + offset`: offset 0 for the Llama-style norm,
1 for a zero-centred (Gemma-style) norm whose stored weight is `w` and whose applied multiplier is
`1 + w`. The bridge computes `(gamma + spec.weight_bias)`, so the two conventions differ by exactly
the offset, and a wrong offset is a silently wrong norm_out. The norm reaches the bridge one of
three ways, exactly one per call:

- `norm=` the module itself: vLLM's or SGLang's `RMSNorm` / `GemmaRMSNorm` (ENGINE_NORMS), or a
  transformers `*RMSNorm` of a model type in the Hugging Face family table (the norms
  `patch_moe_epilogues` moves: Llama-style, or zero-centred as Qwen3-Next's, whose offset
  `hf_families.norm_weight_offset` reads from its forward). `norm_class` is the one lookup of both;
  the spec's `weight_bias` must equal the class's offset and its `eps` the module's. Its stored
  weight is read (SGLang's `GemmaRMSNorm.weight`, never its pre-folded `gemma_weight`). Any other
  class is refused, naming the accepted ones.
- `norm_weight=` a tensor holding the weight as stored; the spec's `weight_bias` is added to it.
- `applied_gamma=` a tensor holding the multiplier as applied (SGLang's `fused_norm_gamma()`:
  `1 + w` for a Gemma-style norm, with no offset left to add); the spec's `weight_bias` must be 0.

Classes are matched by module and qualified name, never by importing the engine, and exactly:
a subclass may change what its forward computes, so it is refused like any unknown class. A
transformers class must come from a family row's `transformers.models` subpackage, be named
`*RMSNorm` and normalise its one input (a gated norm, which takes a second, is refused).
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from fusion_bridge import EpilogueInputError, EpilogueSpec
from fusion_bridge.integrations.engine_norm_table import (  # noqa: F401 (re-exported)
    ENGINE_NORMS,
    EngineNorm,
    class_path,
    engine_norm_offset,
)
from fusion_bridge.integrations.hf_families import (
    FAMILIES,
    UnsupportedModelError,
    norm_weight_offset,
)


class HandoffError(EpilogueInputError):
    """An engine handoff (or a norm given with it) the bridge cannot take as it is; the message
    names the argument, what was expected, what was seen, and the fix."""


def norm_class(norm: torch.nn.Module | type) -> Optional[EngineNorm]:
    """What the bridge needs from a norm class or module (EngineNorm), or None for a class it does
    not know. The one lookup of norm classes: an engine's class exactly (ENGINE_NORMS), else a
    transformers RMSNorm of the Hugging Face family table (`family_table_norm`)."""
    cls = norm if isinstance(norm, type) else type(norm)
    known = ENGINE_NORMS.get(class_path(cls))
    return known if known is not None else family_table_norm(cls)


def family_table_norm(cls: type) -> Optional[EngineNorm]:
    """A transformers `*RMSNorm` class of a family-table row's `transformers.models` subpackage
    whose forward normalises its one input: its offset as `hf_families.norm_weight_offset` reads
    it (the table's lookup), its eps attribute as its code reads it (`variance_epsilon`, or
    `eps` in the zero-centred norms). None for any other class, or one whose forward says
    neither offset or neither eps."""
    modules = {f"transformers.models.{m}." for row in FAMILIES for m in row.modeling}
    if not cls.__name__.endswith("RMSNorm") or not any(
        cls.__module__.startswith(m) for m in modules
    ):
        return None
    try:
        params = list(inspect.signature(cls.forward).parameters)
        source = inspect.getsource(cls)
        offset = norm_weight_offset(cls)
    except (TypeError, ValueError, OSError, UnsupportedModelError):
        return None
    eps = [a for a in ("variance_epsilon", "eps") if f"self.{a}" in source]
    if len(params) != 2 or len(eps) != 1:  # (self, hidden_states): a gated norm takes a gate
        return None
    return EngineNorm(offset, "weight", eps[0])


ACCEPTED_NORMS = (
    f"{sorted(ENGINE_NORMS)}, or a transformers *RMSNorm of a model type in the Hugging Face "
    "family table (transformers.models.<its row's subpackage>, one input)"
)


def _fail(who: str, name: str, expected: str, actual: object, fix: str = "") -> None:
    raise HandoffError(
        f"{who}: {name} must be {expected}, got {actual}" + (f"; {fix}" if fix else "")
    )


def norm_gamma(
    spec: EpilogueSpec,
    *,
    norm: Optional[torch.nn.Module] = None,
    norm_weight: Optional[torch.Tensor] = None,
    applied_gamma: Optional[torch.Tensor] = None,
    who: str = "the handoff",
) -> torch.Tensor:
    """The `gamma` to pass to finalize_epilogue with `spec`, from exactly one of `norm`,
    `norm_weight` and `applied_gamma` (module docstring). Returns a [H] tensor in spec.dtype (the
    module's weight itself, never a copy: the bridge never modifies it). Raises HandoffError naming
    the argument, the expected and the actual value, and the fix."""
    given = [n for n, v in (("norm", norm), ("norm_weight", norm_weight)) if v is not None]
    given += ["applied_gamma"] if applied_gamma is not None else []
    if len(given) != 1:
        _fail(
            who,
            "the next norm",
            "given exactly once: norm= (the module), norm_weight= (its stored weight; "
            "spec.weight_bias is added) or applied_gamma= (the multiplier as applied)",
            f"{len(given)} of them ({', '.join(given) or 'none'})",
        )
    if norm is not None:
        gamma = _module_gamma(spec, norm, who)
    elif applied_gamma is not None:
        if spec.weight_bias != 0.0:
            _fail(
                who,
                "spec.weight_bias with applied_gamma=",
                "0.0 (applied_gamma is the multiplier as applied, e.g. SGLang's "
                "fused_norm_gamma() = 1 + w; adding weight_bias would apply the offset twice)",
                spec.weight_bias,
                "pass the stored weight as norm_weight= (or the module as norm=) instead, or "
                "build the spec with weight_bias=0.0",
            )
        gamma = applied_gamma
    else:
        gamma = norm_weight
    name = given[0]
    if not isinstance(gamma, torch.Tensor):
        _fail(who, name, "a torch.Tensor [hidden_size]", type(gamma).__name__)
    if tuple(gamma.shape) != (spec.hidden_size,) or gamma.dtype != spec.dtype:
        _fail(
            who,
            f"{name} (shape, dtype)",
            f"([{spec.hidden_size}], {spec.dtype}) as spec says",
            f"({list(gamma.shape)}, {gamma.dtype})",
            "cast the weight once at load time (weight.data = weight.data.to(spec.dtype)); "
            "a per-call cast would round it anew each call",
        )
    return gamma.detach()


def _module_gamma(spec: EpilogueSpec, norm: torch.nn.Module, who: str) -> torch.Tensor:
    """The stored weight of an engine norm module, after checking its class, offset and eps
    against the spec."""
    known = norm_class(norm)
    if known is None:
        _fail(
            who,
            "norm",
            f"one of the norm classes {ACCEPTED_NORMS} (exact class: a subclass may compute "
            "another norm)",
            class_path(type(norm)),
            "pass its weight as norm_weight= with the spec's weight_bias set to the offset its "
            "forward adds (1.0 for a zero-centred, Gemma-style norm), or the multiplier it "
            "applies as applied_gamma=",
        )
    if getattr(norm, "variance_size_override", None) is not None:
        _fail(
            who,
            "norm.variance_size_override",
            "None (the bridge's RMSNorm takes the mean square over the whole row)",
            norm.variance_size_override,
        )
    if spec.weight_bias != known.offset:
        _fail(
            who,
            "spec.weight_bias",
            f"{known.offset} for {class_path(type(norm))} (its forward multiplies by "
            f"weight + {known.offset})",
            spec.weight_bias,
            f"build the bridge's EpilogueSpec with weight_bias={known.offset}",
        )
    eps = float(getattr(norm, known.eps_attr))
    if eps != spec.eps:
        _fail(
            who,
            "spec.eps",
            f"the norm's {known.eps_attr} ({eps})",
            spec.eps,
            f"build the bridge's EpilogueSpec with eps={eps}",
        )
    return getattr(norm, known.weight_attr)
