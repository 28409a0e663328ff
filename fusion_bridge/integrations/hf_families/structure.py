"""Which model types of the installed transformers are MoE, and what in their structure the patch
cannot move onto the bridge, read from their modeling source (no model is built, nothing of theirs
is imported).

A model type is MoE when its modeling module defines a class decorated with transformers'
`use_experts_implementation`, or a decoder layer whose MLP has an `experts` submodule (a class
whose `__init__` sets `self.experts`, instantiated by another class). `refusal(module)` returns the
first difference from the structure the patch supports, or None:

    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)    # an RMSNorm
    hidden_states = self.mlp(hidden_states)                          # the MoE block
    hidden_states = residual + hidden_states                         # one residual add
with experts that take the router's top-k weights and end at their down projection.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import pathlib
from typing import Optional

__all__ = ["moe_model_types", "refusal", "modeling_module_of"]


def modeling_module_of(model_type: str) -> Optional[str]:
    """The transformers.models subpackage that defines `model_type`, or None."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    return model_type_to_module_name(model_type)


@functools.lru_cache(maxsize=None)
def _parsed(module: str) -> Optional[tuple[str, dict]]:
    spec = importlib.util.find_spec("transformers")
    path = pathlib.Path(spec.origin).parent / "models" / module / f"modeling_{module}.py"
    if not path.is_file():
        return None
    source = path.read_text()
    if "experts" not in source:
        return source, {}
    tree = ast.parse(source)
    return source, {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _method(cls: ast.ClassDef, name: str) -> Optional[ast.FunctionDef]:
    return next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == name), None)


def _assigned(cls: ast.ClassDef) -> dict[str, list[str]]:
    """self.<attr> = ... in __init__ -> the names of the classes called in the value."""
    init = _method(cls, "__init__")
    out: dict[str, list[str]] = {}
    for node in ast.walk(init) if init else ():
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    calls = [c for c in ast.walk(node.value) if isinstance(c, ast.Call)]
                    out.setdefault(target.attr, []).extend(ast.unparse(c.func) for c in calls)
    return out


def _decorated_experts(cls: ast.ClassDef) -> Optional[ast.expr]:
    for d in cls.decorator_list:
        name = ast.unparse(d.func if isinstance(d, ast.Call) else d)
        if name.endswith("use_experts_implementation"):
            return d
    return None


def _moe_parts(module: str):
    """(decoder layer class, attribute of its MoE block, MoE block class) of the module's first
    decoder layer holding an MoE block, or None when the module is not MoE."""
    parsed = _parsed(module)
    if parsed is None:
        return None
    _, classes = parsed
    blocks = {n: c for n, c in classes.items() if "experts" in _assigned(c)}
    decorated = any(_decorated_experts(c) is not None for c in classes.values())
    for cls in blocks.values():  # a decoder layer that holds the experts itself (gemma4)
        if "DecoderLayer" in cls.name:
            return cls, "experts", cls
    for name, cls in classes.items():
        if any(k in name for k in ("Vision", "Audio", "Visual", "Talker", "Encoder")):
            continue
        hits = [
            (attr, blocks[c])
            for attr, called in _assigned(cls).items()
            for c in called
            if c in blocks and attr != "experts"
        ]
        if hits:
            mlp = [h for h in hits if h[0] in ("mlp", "feed_forward", "block_sparse_moe", "ffn")]
            attr, hit = (mlp or hits)[0]
            return cls, attr, hit
    if decorated:
        return None, None, None
    return None


@functools.lru_cache(maxsize=None)
def moe_model_types() -> dict[str, str]:
    """{model type: modeling subpackage} of every MoE model type the installed transformers
    registers (its config mapping), derived from the modeling sources."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    out = {}
    for model_type in CONFIG_MAPPING_NAMES:
        module = modeling_module_of(model_type)
        if module and _moe_parts(module) is not None and _has_experts(model_type):
            out[model_type] = module
    return out


_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _has_experts(model_type: str) -> bool:
    """Whether the type's own config (or its text config) counts experts: a wrapper's vision or
    audio sub-config shares the modeling module but has none."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config = CONFIG_MAPPING[model_type]()
        text = config.get_text_config()
        if any(_count(c, a) for c in (config, text) for a in _EXPERT_COUNTS):
            return True
        # a model whose MoE block is off by default (gemma4's enable_moe_block) or whose expert
        # settings are nested (dbrx's ffn_config) still names them
        return "expert" in str(config.to_dict())
    except Exception:  # noqa: BLE001 - a config that cannot be built by default: count it
        return True


def _count(config, name: str):
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - a per-layer attribute read globally: it is there
        return True


def _norm_classes(classes: dict, cls: ast.ClassDef, depth: int = 0) -> list[str]:
    """Classes of the norms a decoder layer (or a norm-holding submodule of it) sets."""
    found = []
    for attr, called in _assigned(cls).items():
        if "norm" not in attr.lower():
            continue
        for c in called:
            short = c.split(".")[-1]
            if short.endswith("Norm") and ("LayerNorm" in short or "RMSNorm" in short):
                found.append(short)
            elif c in classes and depth < 2:
                found.extend(_norm_classes(classes, classes[c], depth + 1))
    return found


def _statements_after_block(layer: ast.ClassDef, attr: str) -> Optional[list[ast.stmt]]:
    forward = _method(layer, "forward")
    if forward is None:
        return None
    body = forward.body
    for i, stmt in enumerate(body):
        calls = [ast.unparse(c.func) for c in ast.walk(stmt) if isinstance(c, ast.Call)]
        if f"self.{attr}" in calls:
            return body[i:]
    return None


_LAYER_SHARED = (
    "if self.{0} is None:\n    hidden_states = moe_hidden_states\nelse:\n"
    "    hidden_states = moe_hidden_states + self.{0}(hidden_states)"
)


def _layer_tail_ok(
    stmts: list[ast.stmt], multiplier_ok: bool, layer_shared: Optional[str] = None
) -> Optional[str]:
    """None when the statements from the MoE call on are `h = self.mlp(h)`, an optional tuple
    unpacking, `h = residual + h` and the return (with a family's residual multiplier or its
    layer's shared MLP added to the block's output, where the row says so); else the first
    other statement."""
    allowed = {
        "hidden_states = residual + hidden_states",
        "hidden_states = residual + hidden_states.view(residual.shape)",
    }
    if multiplier_ok:
        allowed.add("hidden_states = residual + hidden_states * self.residual_multiplier")
    first = stmts[0]
    text = ast.unparse(first)
    target = text.split(" = ")[0]
    targets = ("hidden_states", "hidden_states, _") + (
        ("moe_hidden_states",) if layer_shared else ()
    )
    if not (isinstance(first, ast.Assign) and target in targets):
        return text.splitlines()[0]
    for stmt in stmts[1:]:
        text = ast.unparse(stmt)
        if text in allowed:
            return None
        if layer_shared and text == _LAYER_SHARED.format(layer_shared):
            continue
        if isinstance(stmt, ast.If) and "isinstance(hidden_states, tuple)" in text:
            continue
        if text.startswith("if self.is_moe_layer") and "hidden_states, _ = hidden_states" in text:
            continue
        return text.splitlines()[0]
    return "no residual add after it"


def _router_order(block: ast.ClassDef) -> Optional[str]:
    """None when the block's forward hands its router's output (a, weights, ids) to its experts as
    `self.experts(x, ids, weights)`, the order the family table reads; else the difference."""
    forward = _method(block, "forward")
    if forward is None or block.name.endswith("DecoderLayer"):
        return None
    experts = [
        c
        for c in ast.walk(forward)
        if isinstance(c, ast.Call) and ast.unparse(c.func) == "self.experts" and len(c.args) >= 3
    ]
    routed = [
        n
        for n in ast.walk(forward)
        if isinstance(n, ast.Assign)
        and isinstance(n.targets[0], ast.Tuple)
        and len(n.targets[0].elts) == 3
        and isinstance(n.value, ast.Call)
        and ast.unparse(n.value.func).startswith("self.")
    ]
    if not experts or not routed:
        return None  # no router output unpacked in the block (the other checks decide)
    names = [ast.unparse(e) for e in routed[0].targets[0].elts]
    ids, weights = ast.unparse(experts[0].args[1]), ast.unparse(experts[0].args[2])
    if ids in names and weights in names and (names.index(weights), names.index(ids)) != (1, 2):
        return (
            f"router output order: {block.name} unpacks its router as ({', '.join(names)}); the "
            "family table reads (logits, top-k weights, top-k ids)"
        )
    return None


def _norms_with_modules(classes: dict, norms: list[str]) -> list[str]:
    """The module's own norm classes among `norms` whose __init__ builds a module (axk2's
    AXK2GatedRMSNorm: an RMSNorm and a gate MLP), as 'Class (attributes)'."""
    out = []
    for name in sorted(set(norms)):
        built = (
            [
                attr
                for attr, called in _assigned(classes[name]).items()
                if any(
                    c in classes or (c.startswith("nn.") and c != "nn.Parameter") for c in called
                )
            ]
            if name in classes
            else []
        )
        if built:
            out.append(f"{name} ({', '.join(sorted(built))})")
    return out


def _norm_in_block(block: ast.ClassDef) -> Optional[str]:
    """The attribute of a norm module the MoE block's own forward calls (axk1 normalizes its
    output: `return self.post_mlp_layernorm(hidden_states)`), or None."""
    forward = _method(block, "forward")
    # a decoder layer holding its experts itself (gemma4) is not a block: its norms are the layer's
    layer_like = any("attn" in a or "attention" in a for a in _assigned(block))
    if forward is None or layer_like:
        return None
    for call in ast.walk(forward):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
            owner, attr = call.func.value, call.func.attr
            if isinstance(owner, ast.Name) and owner.id == "self" and "norm" in attr.lower():
                return attr
    return None


def refusal(
    module: str, multiplier_ok: bool = False, layer_shared: Optional[str] = None
) -> Optional[str]:
    """The first structural difference of `module`'s MoE decoder layer from what the patch
    moves onto the bridge, as a sentence; None when the structure is the supported one (whether
    its router and block are known is the family table's business). multiplier_ok: the row
    folds a residual multiplier; layer_shared: the row's shared MLP attribute on the layer."""
    parts = _moe_parts(module)
    if parts is None:
        return "not an MoE model (no experts in its modeling module)"
    layer, attr, block = parts
    _, classes = _parsed(module)
    if layer is None:
        return (
            "no decoder layer the checks can read holds its experts (no `self.<name> = <MoE "
            "block>(...)` in a decoder layer's __init__), so its structure is not established"
        )
    for cls in classes.values():
        deco = _decorated_experts(cls)
        if deco is not None and "has_post_expert_norm=True" in ast.unparse(deco):
            return f"post-expert norm: {cls.name} normalizes each expert's output"
    assigned = _assigned(layer)
    moe_attrs = sorted(
        a
        for a, called in assigned.items()
        if any("experts" in _assigned(classes[c]) for c in called if c in classes)
    )
    if "attn" in attr or "attention" in attr:
        return (
            f"experts in the attention: {layer.name}'s {attr} ({block.name}) is the module with "
            "experts, not an MoE MLP the patch moves"
        )
    if len(moe_attrs) > 1:
        return (
            f"several expert sets in one layer: {layer.name} has several mixture-of-experts "
            f"modules ({', '.join(moe_attrs)}), the patch moves one MoE MLP per layer"
        )
    if any(a.endswith("_hc") or "hyper" in a for a in assigned):
        hc = sorted(a for a in assigned if a.endswith("_hc") or "hyper" in a)
        return (
            f"hyper-connections: {layer.name} mixes several residual streams ({', '.join(hc)}) "
            "around its MoE block instead of one residual add"
        )
    norms = _norm_classes(classes, layer)
    layer_norms = sorted({n for n in norms if "RMSNorm" not in n})
    if layer_norms:
        return f"LayerNorm, not RMSNorm: {layer.name}'s norms are {', '.join(layer_norms)}"
    gated = _norms_with_modules(classes, norms)
    if gated:
        return (
            f"a norm with modules of its own: {layer.name}'s {', '.join(gated)} (a gate or "
            "projection on top of the RMSNorm, which the bridge's norm does not compute)"
        )
    sandwich = sorted(a for a in assigned if a.startswith("post_feedforward_layernorm"))
    if sandwich:
        return (
            f"sandwich norms: {layer.name} normalizes its MLP output ({', '.join(sandwich)}) "
            "before the residual add"
        )
    forward = _method(block, "forward")
    if forward is not None:
        for call in ast.walk(forward):
            if isinstance(call, ast.Call) and ast.unparse(call.func) == "self.experts":
                if len(call.args) + len(call.keywords) < 3:
                    return (
                        f"routing scales the expert input: {block.name} calls its experts "
                        "without the router's top-k weights"
                    )
    norm = _norm_in_block(block)
    if norm is not None:
        return (
            f"a norm inside the MoE block: {block.name}'s forward calls self.{norm} (the patch "
            "calls the block's router and experts, and the bridge adds their output to the "
            "residual as it is)"
        )
    order = _router_order(block)
    if order is not None:
        return order
    tail = _statements_after_block(layer, attr)
    if tail is None:
        return f"{layer.name}'s forward does not call its MoE block (self.{attr}) itself"
    odd = _layer_tail_ok(tail, multiplier_ok, layer_shared)
    if odd is not None:
        return (
            f"{layer.name} does `{odd}` with its MoE block's output where the patch needs "
            "`hidden_states = residual + hidden_states`"
        )
    return None
