"""What the model class of one model type holds, read from its modeling source (no model is built):
the patch moves a stack of decoder layers at `.layers` followed by a final RMSNorm at `.norm`, run
from token ids by a causal LM. Types that share a modeling file with a supported one (a
multimodal model's vision encoder, a speech model's talker) can differ from it here:
`stack_refusal(model_type, module)` names the difference, or returns None.

The model class of a type is the class of the modeling file whose `config_class` (else its
`config:` annotation) is the type's config class, not a `...PreTrainedModel`; its heads are the
classes that build it in `__init__`.
"""

from __future__ import annotations

import ast
from typing import Optional

from fusion_bridge.integrations.hf_families.structure import _assigned, _method, _parsed

__all__ = ["stack_refusal"]


def _config_class(cls: ast.ClassDef) -> Optional[str]:
    """The class body's `config_class = <Name>`, else its `config: <Name>` annotation, or None (a
    class may annotate one config and set another: 5.17's Qwen3OmniMoeTalkerModel)."""
    annotated = None
    for node in cls.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "config_class":
            return ast.unparse(node.value)
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "config":
            annotated = ast.unparse(node.annotation)
    return annotated


def _holds_experts(classes: dict, name: str, depth: int = 0) -> bool:
    """Whether class `name` of the module (or a module it builds, two levels down) sets experts."""
    cls = classes.get(name.split(".")[0])
    if cls is None or depth > 2:
        return False
    assigned = _assigned(cls)
    if "experts" in assigned:
        return True
    built = [c for called in assigned.values() for c in called]
    return any(_holds_experts(classes, c, depth + 1) for c in built)


def _moe_layers_at(classes: dict, model: ast.ClassDef) -> Optional[tuple[str, str]]:
    """(attribute, layer class) where `model` keeps a list of layers holding experts, or None."""
    for attr, called in _assigned(model).items():
        if "nn.ModuleList" not in called:
            continue
        for c in called:
            if c in classes and c != model.name and _holds_experts(classes, c):
                return attr, c
    return None


def _hands_on_input_ids(forward: ast.FunctionDef) -> bool:
    """Whether the forward passes its `input_ids` argument to any call (an embedding, its model):
    a head whose calls never get them runs its model on embeddings made elsewhere."""
    for call in ast.walk(forward):
        if isinstance(call, ast.Call):
            values = list(call.args) + [k.value for k in call.keywords]
            if any(isinstance(v, ast.Name) and v.id == "input_ids" for v in values):
                return True
    return False


def stack_refusal(model_type: str, module: str) -> Optional[str]:
    """The difference of `model_type`'s own model class from a decoder stack the patch moves and a
    causal LM runs from token ids, as a sentence; None where there is none (or nothing to read)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config = CONFIG_MAPPING_NAMES.get(model_type)
    parsed = _parsed(module)
    if config is None or parsed is None:
        return None
    classes = parsed[1]
    models = [
        c
        for c in classes.values()
        if _config_class(c) == config and not c.name.endswith("PreTrainedModel")
    ]
    for model in models:
        found = _moe_layers_at(classes, model)
        if found is None:
            continue  # a wrapper (its language model is another type's) or a head
        attr, layer = found
        if attr != "layers" or "norm" not in _assigned(model):
            return (
                f"not a decoder stack: {model.name} holds its MoE layers ({layer}) at .{attr}"
                + (", with no final norm at .norm" if "norm" not in _assigned(model) else "")
                + "; the patch moves decoder layers at .layers followed by a final RMSNorm .norm"
            )
        heads = [
            (head, attr)
            for head in classes.values()
            for attr, called in _assigned(head).items()
            if any(c.split(".")[0] == model.name for c in called) and head is not model
        ]
        forwards = [(head, _method(head, "forward")) for head, _ in heads]
        blind = [h.name for h, fwd in forwards if fwd is not None and not _hands_on_input_ids(fwd)]
        if heads and len(blind) == len(heads):
            return (
                f"no causal LM runs it from token ids: {', '.join(blind)}.forward hands its "
                f"input_ids to nothing and runs {model.name} on embeddings made elsewhere, so its "
                "tiny model cannot be checked against the unpatched one (logits, greedy generate)"
            )
    return None
