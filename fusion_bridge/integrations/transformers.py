"""Move a loaded Hugging Face transformers MoE model onto the bridge.

    from fusion_bridge.integrations.transformers import patch_moe_epilogues
    patch = patch_moe_epilogues(model, group=tp_group)   # collective over tp_group
    model.generate(...)                                  # unchanged API
    print(patch.explain())                               # per MoE layer: strategy per token count
    patch.unpatch()                                      # the model's own code again

Supported families (`config.model_type`): 'deepseek_v3' (DeepSeek-V3: shared expert, routed
scaling, grouped routing) and 'qwen3_moe' (Qwen3-MoE: no shared expert); anything else raises
UnsupportedModelError naming them. transformers 5.x (expert weights as 3-D tensors).

What changes in the model, per MoE decoder layer (what an engine does when it adopts the fused
epilogue): the layer's own router picks the experts; this rank computes the routed experts it holds
and its slice of the shared expert (see hf_experts), leaving the routed output unfinalized (permuted
rows + [T, K] index map); the bridge finalizes, adds the shared partial, all-reduces over the group,
adds the residual and applies the *next* RMSNorm (the next layer's input_layernorm, or the model's
final norm after the last layer). The layer returns residual_out as its hidden states; the next
norm, when called on exactly that tensor, returns the bridge's norm_out instead of computing the
norm again. Attention, caches, dense layers, embeddings, lm_head and `generate` are the model's own
code, untouched. Every rank holds the whole model and runs the same forward (same inputs); only the
MoE work is split.

Nothing is copied: the patch sets instance attributes (`forward` of the MoE decoder layers and of
the norms they feed, plus `moe_epilogue` on each MoE layer) and `unpatch()` removes them, so
parameters, state_dict and the class are the model's own throughout.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from fusion_bridge import EpilogueOutputs, EpilogueSpec, FusionBridge

from fusion_bridge.integrations.hf_experts import block_of, routed_rows, shared_partial
from fusion_bridge.integrations.weights_digest import parameter_digests
from fusion_bridge.integrations.hf_families import (
    BRIDGE_DTYPES,
    Family,
    UnsupportedModelError,
    check_moe_block,
    check_rmsnorm,
    family_of,
    is_moe_block,
)

__all__ = [
    "patch_moe_epilogues",
    "unpatch_moe_epilogues",
    "MoEEpiloguePatch",
    "PatchedMoELayer",
    "UnsupportedModelError",
]

_PATCH_ATTR = "_fusion_bridge_patch"
# on a norm: (residual_out, norm_out) of the MoE layer that just ran, or None
_HANDOFF_ATTR = "_fusion_bridge_handoff"


@dataclass
class PatchedMoELayer:
    """One MoE decoder layer on the bridge. local_experts: the routed experts this rank computes;
    shared_columns: its intermediate columns of the shared expert (None: the family has none);
    next_norm: the name of the RMSNorm the bridge computes in this layer's epilogue."""

    index: int
    bridge: FusionBridge
    family: Family
    block: torch.nn.Module
    local_experts: range
    shared_columns: Optional[range]
    next_norm: str
    norm_module: torch.nn.Module

    def explain(self, tokens: Optional[int] = None):
        """The bridge's report for this layer (strategy per token bucket, every rejection)."""
        return self.bridge.explain(tokens)

    def epilogue(self, x: torch.Tensor, residual: torch.Tensor) -> EpilogueOutputs:
        """x [T, H]: the post-attention-norm activations; residual [T, H]: the stream before it."""
        weights, ids = self.family.routing(self.block, x)
        gemm2_out, index_map = routed_rows(x, ids, self.block.experts, self.local_experts)
        shared = None
        if self.shared_columns is not None:
            shared_mlp = getattr(self.block, self.family.shared_expert_attr)
            shared = shared_partial(x, shared_mlp, self.shared_columns)
        gamma = self.norm_module.weight.detach()
        return self.bridge.finalize_epilogue(gemm2_out, index_map, weights, shared, residual, gamma)


class MoEEpiloguePatch:
    """What patch_moe_epilogues returns: the patched layers, their reports, the way back."""

    def __init__(self, model, family: Family, group, rank: int, world: int) -> None:
        self.model, self.family, self.group = model, family, group
        self.rank, self.world_size = rank, world
        self.layers: dict[int, PatchedMoELayer] = {}
        self.norms_reused = 0  # how many times a next norm returned the bridge's norm_out
        self._restore: list[tuple[torch.nn.Module, str, object]] = []
        self._bridges: list[FusionBridge] = []

    def strategies(self, tokens: int) -> dict[int, Optional[str]]:
        """{layer index: the strategy a call with T tokens runs} (CUDA-graph plan)."""
        return {i: p.bridge.strategy_for(tokens) for i, p in self.layers.items()}

    def explain(self, tokens: Optional[int] = None) -> str:
        """Every patched layer's report, as text."""
        parts = []
        for i, p in self.layers.items():
            held = f"routed experts {p.local_experts.start}..{p.local_experts.stop - 1}"
            if p.shared_columns is not None:
                held += f", shared columns {p.shared_columns.start}..{p.shared_columns.stop - 1}"
            parts.append(
                f"layer {i} ({self.family.name}, rank {self.rank}/{self.world_size}: {held}; "
                f"norm fused: {p.next_norm})\n{p.explain(tokens)}"
            )
        return "\n\n".join(parts)

    def unpatch(self) -> None:
        """Restore the model's own forwards and free the bridges. Idempotent; not collective."""
        for module, name, previous in reversed(self._restore):
            module.__dict__.pop(name, None)
            if previous is not None:
                module.__dict__[name] = previous
        self._restore.clear()
        for bridge in self._bridges:
            bridge.close()
        self._bridges.clear()
        self.layers.clear()

    close = unpatch

    def _set(self, module: torch.nn.Module, name: str, value: object) -> None:
        self._restore.append((module, name, module.__dict__.get(name)))
        module.__dict__[name] = value  # a plain instance attribute: not a submodule, not state


def patch_moe_epilogues(
    model: torch.nn.Module,
    group=None,
    *,
    strategy: str = "auto",
    max_tokens: int = 8192,
    **bridge_options,
) -> MoEEpiloguePatch:
    """Move every MoE layer of a transformers model onto FusionBridge. Collective over `group`
    (every rank calls it, with the same model, in the same order).

    model: a DeepSeek-V3 or Qwen3-MoE model (…ForCausalLM or …Model), bf16 or fp16, on one device.
    group: the TP process group (None: the default group if torch.distributed is initialised, else
    a single process). strategy / bridge_options: passed to every FusionBridge. max_tokens: the
    largest T (batch x sequence) one forward carries before larger calls take the overflow route.
    Returns the MoEEpiloguePatch (`.unpatch()` restores the model). Raises UnsupportedModelError
    for a model it cannot patch and ValueError for a group that does not match the model."""
    if getattr(model, _PATCH_ATTR, None) is not None:
        raise ValueError("patch_moe_epilogues: model is already patched (call .unpatch() first)")
    family = family_of(model)
    if model.training:
        raise ValueError(
            "patch_moe_epilogues: model must be in eval mode (call model.eval()): the bridge is "
            "an inference epilogue, without autograd"
        )
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    layers, final_norm = getattr(base, "layers", None), getattr(base, "norm", None)
    if not isinstance(layers, torch.nn.ModuleList) or final_norm is None:
        raise UnsupportedModelError(
            f"patch_moe_epilogues: expected the decoder stack at .layers and the final norm at "
            f".norm of {type(base).__name__}"
        )
    hidden = model.config.hidden_size
    moe_indices = [i for i, layer in enumerate(layers) if is_moe_block(layer.mlp)]
    if not moe_indices:
        raise UnsupportedModelError("patch_moe_epilogues: the model has no MoE layer")
    next_norms = {}
    for i in moe_indices:
        where = f"layers.{i}.mlp"
        check_moe_block(family, layers[i].mlp, where, hidden)
        name = f"layers.{i + 1}.input_layernorm" if i + 1 < len(layers) else "norm"
        norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else final_norm
        next_norms[i] = (name, norm, check_rmsnorm(norm, name, hidden))
    first = layers[moe_indices[0]].mlp.experts.gate_up_proj
    dtype, device = first.dtype, first.device
    if dtype not in BRIDGE_DTYPES:
        raise UnsupportedModelError(
            f"patch_moe_epilogues: model dtype must be bf16 or fp16 (the bridge's activation "
            f"dtypes), got {dtype}"
        )
    group, rank, world = _resolve_group(group, device)
    num_experts = layers[moe_indices[0]].mlp.experts.gate_up_proj.shape[0]
    if world > num_experts:
        raise ValueError(
            f"patch_moe_epilogues: group size must be at most the number of routed experts "
            f"({num_experts}) so every rank holds at least one, got a group of {world}"
        )
    if world > 1:
        _agree_on_model(model, moe_indices, group, rank)

    patch = MoEEpiloguePatch(model, family, group, rank, world)
    bridges: dict[EpilogueSpec, FusionBridge] = {}
    try:
        for i in moe_indices:
            block = layers[i].mlp
            name, norm, eps = next_norms[i]
            spec = EpilogueSpec(
                hidden_size=hidden,
                top_k=int(block.gate.top_k),
                dtype=dtype,
                eps=eps,
                routed_scaling_factor=family.routed_scaling(block),
                has_shared_output=family.shared_expert_attr is not None,
                max_tokens=max_tokens,
            )
            if spec not in bridges:  # layers with equal specs share one bridge and its workspaces
                bridges[spec] = FusionBridge(spec, group, strategy, device=device, **bridge_options)
                patch._bridges.append(bridges[spec])
            shared_columns = None
            if family.shared_expert_attr is not None:
                inter = getattr(block, family.shared_expert_attr).gate_proj.weight.shape[0]
                shared_columns = block_of(rank, world, inter)
            layer_patch = PatchedMoELayer(
                i,
                bridges[spec],
                family,
                block,
                block_of(rank, world, block.experts.gate_up_proj.shape[0]),
                shared_columns,
                name,
                norm,
            )
            patch.layers[i] = layer_patch
            patch._set(layers[i], "moe_epilogue", layer_patch)
            patch._set(layers[i], "forward", _moe_layer_forward(layers[i], layer_patch))
            if _HANDOFF_ATTR not in norm.__dict__:
                patch._set(norm, "forward", _handoff_forward(norm, patch))
                patch._set(norm, _HANDOFF_ATTR, None)
    except Exception:
        patch.unpatch()
        raise
    patch._set(model, _PATCH_ATTR, patch)
    return patch


def unpatch_moe_epilogues(model: torch.nn.Module) -> None:
    """Undo patch_moe_epilogues on `model` (no-op if it is not patched)."""
    patch = getattr(model, _PATCH_ATTR, None)
    if patch is not None:
        patch.unpatch()


def _moe_layer_forward(layer: torch.nn.Module, state: PatchedMoELayer):
    """The decoder layer's forward with the MoE epilogue on the bridge. The pre-norm structure
    (input_layernorm -> self_attn -> add -> post_attention_layernorm -> mlp -> add) is the one both
    families' layers run; the arguments go to self_attn exactly as the layer's own forward passes
    them (whatever this transformers version names them)."""
    signature = inspect.signature(type(layer).forward)
    var_keyword = next(
        (p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None
    )

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # every named parameter of the layer's own forward (defaults included) goes to self_attn,
        # as the layer's own forward passes them
        bound = signature.bind(layer, hidden_states, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        extra = arguments.pop(var_keyword, {}) if var_keyword else {}
        kwargs = {k: v for k, v in arguments.items() if k not in ("self", "hidden_states")}
        kwargs.update(extra)
        residual = hidden_states
        attn = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kwargs)
        hidden = residual + (attn[0] if isinstance(attn, tuple) else attn)
        normed = layer.post_attention_layernorm(hidden)
        shape = hidden.shape
        out = state.epilogue(normed.reshape(-1, shape[-1]), hidden.reshape(-1, shape[-1]))
        residual_out = out.residual_out.view(shape)
        state.norm_module.__dict__[_HANDOFF_ATTR] = (residual_out, out.norm_out.view(shape))
        return residual_out

    return forward


def _handoff_forward(norm: torch.nn.Module, patch: MoEEpiloguePatch):
    """The norm's forward, except on the exact tensor an MoE layer just returned: then the bridge
    already computed this norm (norm_out), and it is returned instead of computed twice."""
    own_forward = norm.forward  # bound before the patch replaces it

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        handoff = norm.__dict__.get(_HANDOFF_ATTR)
        norm.__dict__[_HANDOFF_ATTR] = None  # used at most once; never held past the next call
        if handoff is not None and handoff[0] is hidden_states:
            patch.norms_reused += 1
            return handoff[1]
        return own_forward(hidden_states)

    return forward


def _resolve_group(group, device: torch.device):
    """(group, rank, world size) the patch runs over; refuses a group that cannot carry the
    model's tensors."""
    initialized = dist.is_available() and dist.is_initialized()
    if group is None:
        if not initialized:
            return None, 0, 1
        group = dist.group.WORLD
    elif not initialized:
        raise ValueError(
            "patch_moe_epilogues: group was given but torch.distributed is not initialised"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("patch_moe_epilogues: group must contain this process, it does not")
    backend = str(dist.get_backend(group))
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(
            f"patch_moe_epilogues: group uses the nccl backend, which needs the model on a CUDA "
            f"device; the model is on {device}"
        )
    return group, rank, dist.get_world_size(group)


def _fingerprint(model: torch.nn.Module, moe_indices: list[int]) -> dict:
    """What must be equal on every rank: the architecture and a content hash of every parameter
    (weights_digest: it sees a permutation, and treats NaN alike)."""
    return {
        "model_type": model.config.model_type,
        "hidden_size": model.config.hidden_size,
        "moe_layers": moe_indices,
        "checksums": parameter_digests(model),
    }


def _agree_on_model(model: torch.nn.Module, moe_indices: list[int], group, rank: int) -> None:
    """Every rank raises the same error if the ranks hold different models."""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, _fingerprint(model, moe_indices), group=group)
    first = everyone[0]
    for other_rank, other in enumerate(everyone[1:], start=1):
        fields = [k for k in first if k != "checksums" and other[k] != first[k]]
        params = [k for k, v in other["checksums"].items() if first["checksums"].get(k) != v]
        if fields or params or len(other["checksums"]) != len(first["checksums"]):
            raise ValueError(
                "patch_moe_epilogues: every rank of the group must hold the same model; rank "
                f"{other_rank} differs from rank 0 in {fields or 'parameters'} {params[:3]}"
            )
