"""Move a loaded Hugging Face transformers MoE model onto the bridge.

    from fusion_bridge.integrations.transformers import patch_moe_epilogues
    patch = patch_moe_epilogues(model, group=tp_group)   # collective over tp_group
    model.generate(...)                                  # unchanged API
    print(patch.explain())                               # per MoE layer: strategy per token count
    patch.unpatch()                                      # the model's own code again

Supported families: the rows of hf_families.table, keyed by the language model's `config.model_type`
(or a multimodal wrapper's), each read from transformers' own modeling file of that type
(DeepSeek-V2/-V3/-V3.2 and Kimi-K2/K2.5, GLM-4-MoE, GLM-4-MoE-Lite, GLM-MoE-DSA, Mistral-4, Mistral-
Large-4, Kimi-Linear, dots.llm1, Solar-Open, EXAONE-MoE, Qwen2-MoE, Qwen3-MoE, Qwen3.5-MoE,
Qwen3-Next, Qwen3-VL-MoE, Qwen3-Omni-MoE's thinker, OLMoE, ERNIE-4.5-MoE, Mixtral, MiniMax-M2 and
-M3, gpt-oss, Granite-MoE and Granite-MoE-Shared). Any other type raises UnsupportedModelError with
the structural difference that keeps it off the bridge (hf_families.structure) and the supported
list. transformers 5.x (expert weights as 3-D tensors). A wrapper's vision tower and image inputs
are untouched: only its language model's MoE layers move.

What changes in the model, per MoE decoder layer (what an engine does when it adopts the fused
epilogue): the block's own router picks the experts; this rank computes the routed experts it holds
and its slice of the shared expert (see hf_experts), leaving the routed output unfinalized (permuted
rows + [T, K] index map); the bridge finalizes, adds the shared partial, all-reduces over the group,
adds the residual and applies the *next* RMSNorm (the next layer's input_layernorm, or the model's
final norm after the last layer). The decoder layer's own forward runs unchanged: the block returns
a handoff that its `residual + mlp(...)` turns into the bridge's call (hf_handoff), and the next
norm, called on exactly the bridge's residual_out, returns its norm_out instead of computing it
again. Attention (full or linear), caches, dense layers, embeddings, lm_head and `generate` are the
model's own code, untouched.

Contract: every rank holds the whole model and runs the same forward calls with identical inputs
(input_ids, attention mask, positions, cache state, generation settings); only the MoE work is
split, and the bridge sums the ranks' partial outputs token by token. Ranks fed different inputs of
the same length get wrong outputs without an error; `MoEEpiloguePatch.check_same_inputs` checks
the contract with one small all-gather, and debug mode (`debug=True`) checks it on every MoE call.

Nothing is copied: the patch sets instance attributes (`forward` of the MoE blocks and of the norms
they feed, plus `moe_epilogue` on each MoE layer) and `unpatch()` removes them, so parameters,
state_dict and the classes are the model's own throughout. The patched model runs in eval mode only:
a patched block in training mode raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from fusion_bridge import EpilogueOutputs, EpilogueSpec, FusionBridge

from fusion_bridge.integrations.hf_experts import (
    block_of,
    routed_rows,
    shared_partial,
    shared_width,
)
from fusion_bridge.integrations.hf_families import (
    Family,
    UnsupportedModelError,
    check_moe_block,
    check_rmsnorm,
    family_of,
)
from fusion_bridge.integrations.hf_handoff import (
    HANDOFF_ATTR,
    block_forward,
    handoff_forward,
    shared_forward,
)
from fusion_bridge import tensor_digest
from fusion_bridge.integrations.weights_digest import parameter_digests

__all__ = [
    "patch_moe_epilogues",
    "unpatch_moe_epilogues",
    "MoEEpiloguePatch",
    "PatchedMoELayer",
    "UnsupportedModelError",
]

_PATCH_ATTR = "_fusion_bridge_patch"


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
    multiplier: float = 1.0  # m of the layer's `residual + h * m` (1.0: a plain residual add)
    shared: Optional[torch.nn.Module] = None  # the shared expert MLP (the block's or the layer's)

    def explain(self, tokens: Optional[int] = None):
        """The bridge's report for this layer (strategy per token bucket, every rejection)."""
        return self.bridge.explain(tokens)

    def expert_share(self, x: torch.Tensor):
        """This rank's share of the block on x [T, H] (the post-attention-norm activations):
        (gemm2_out, index map, expert weights, shared output or None), the bridge's inputs. A
        shared expert of the decoder layer (`shared_on_layer`) is left to `shared_share`, which
        its own patched forward calls."""
        weights, ids = self.family.routing(self.block, x)
        gemm2_out, index_map = routed_rows(x, ids, self.block.experts, self.local_experts)
        shared = None
        if self.shared is not None and not self.family.shared_on_layer:
            shared = self.shared_share(x)
        return gemm2_out, index_map, weights, shared

    def shared_share(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the shared output on x [T, H], times the residual multiplier."""
        partial = shared_partial(x, self.shared, self.shared_columns, self.family.shared_act)
        shared = self.family.shared_output(self.block, x, partial)
        if self.multiplier != 1.0:  # residual + m * (routed + shared)
            shared = shared * self.multiplier
        return shared

    def epilogue(self, x: torch.Tensor, residual: torch.Tensor) -> EpilogueOutputs:
        """x [T, H]: the post-attention-norm activations; residual [T, H]: the stream before it."""
        gemm2_out, index_map, weights, shared = self.expert_share(x)
        if self.shared is not None and self.family.shared_on_layer:
            shared = self.shared_share(x)
        return self._finalize((gemm2_out, index_map, weights, shared), residual)

    def start(self, x: torch.Tensor) -> Callable[..., torch.Tensor]:
        """The block's work on x [T, H] up to the bridge; returns finish(residual [..., H],
        shared=None) -> residual_out, which runs the bridge (with a layer's shared share where
        given) and leaves its norm_out for the next norm."""
        gemm2_out, index_map, weights, own_shared = self.expert_share(x)

        def finish(residual: torch.Tensor, shared: Optional[torch.Tensor] = None) -> torch.Tensor:
            share = (gemm2_out, index_map, weights, own_shared if shared is None else shared)
            out = self._finalize(share, residual.reshape(-1, residual.shape[-1]))
            residual_out = out.residual_out.view(residual.shape)
            norm_out = out.norm_out.view(residual.shape)
            self.norm_module.__dict__[HANDOFF_ATTR] = (residual_out, norm_out)
            return residual_out

        return finish

    def _finalize(self, share, residual: torch.Tensor) -> EpilogueOutputs:
        gemm2_out, index_map, weights, shared = share
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

    def check_same_inputs(self, *tensors: torch.Tensor) -> None:
        """Collective over the group: raise ValueError on every rank, naming the argument and the
        ranks, unless every rank passed equal tensors (shape, dtype and bytes). Call it with what
        a forward or generate call is given (input_ids, attention_mask, ...) before the call: one
        pass over those tensors and one small all-gather, so once per request is cheap."""
        if self.world_size == 1:
            return
        mine = [(tuple(t.shape), str(t.dtype), tensor_digest(t)) for t in tensors]
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        for i in range(len(tensors)):
            differ = [r for r in range(1, self.world_size) if everyone[r][i] != everyone[0][i]]
            if differ:
                shapes = ", ".join(f"rank {r}: {everyone[r][i][:2]}" for r in [0] + differ)
                raise ValueError(
                    f"check_same_inputs: argument {i} must be identical on every rank of the "
                    f"group (shape, dtype, values), but rank(s) {differ} differ from rank 0 "
                    f"({shapes}). Every rank runs the same forward; the bridge sums the ranks' "
                    "expert outputs token by token, so different inputs give wrong outputs"
                )

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

    def _norm_reused(self) -> None:
        self.norms_reused += 1


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

    model: a model of a supported family (…ForCausalLM, …Model, or a supported vision-language
    wrapper), bf16 or fp16, on one device, in eval mode. group: the TP process group (None: the
    default group if torch.distributed is initialised, else a single process). strategy /
    bridge_options: passed to every FusionBridge (e.g. debug=True). max_tokens: the largest T
    (batch x sequence) one forward carries before larger calls take the overflow route.
    Returns the MoEEpiloguePatch (`.unpatch()` restores the model). Raises UnsupportedModelError
    for a model it cannot patch and ValueError for a group that does not match the model."""
    if getattr(model, _PATCH_ATTR, None) is not None:
        raise ValueError("patch_moe_epilogues: model is already patched (call .unpatch() first)")
    family, text = family_of(model)
    if model.training:
        raise ValueError(
            "patch_moe_epilogues: model must be in eval mode (call model.eval()): the bridge is "
            "an inference epilogue, without autograd"
        )
    paths = {id(m): name for name, m in model.named_modules()}
    layers, final_norm = text.layers, text.norm
    hidden = text.config.hidden_size
    blocks = {i: family.moe_block(layer) for i, layer in enumerate(layers)}
    moe_indices = [i for i, block in blocks.items() if block is not None]
    if not moe_indices:
        raise UnsupportedModelError("patch_moe_epilogues: the model has no MoE layer")
    dtype = blocks[moe_indices[0]].experts.gate_up_proj.dtype
    if dtype in (torch.float32, torch.float64):
        raise UnsupportedModelError(
            f"patch_moe_epilogues: model dtype must be bf16 or fp16 (the bridge's activation "
            f"dtypes), got {dtype} ({'fp32' if dtype == torch.float32 else 'fp64'}): "
            "cast it first, e.g. model.to(torch.bfloat16)"
        )
    next_norms = {}
    for i in moe_indices:
        check_moe_block(family, blocks[i], paths[id(blocks[i])], hidden, layers[i])
        norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else final_norm
        name = paths[id(norm)]
        next_norms[i] = (name, norm, check_rmsnorm(family, norm, name, hidden))
    device = blocks[moe_indices[0]].experts.gate_up_proj.device
    family.check_device(device)
    group, rank, world = _resolve_group(group, device)
    num_experts = blocks[moe_indices[0]].experts.gate_up_proj.shape[0]
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
            block = blocks[i]
            name, norm, eps = next_norms[i]
            multiplier = family.multiplier(layers[i])
            spec = EpilogueSpec(
                hidden_size=hidden,
                top_k=family.top_k(block),
                dtype=dtype,
                eps=eps,
                weight_bias=family.weight_bias,
                # residual + m * (routed + shared): m folded into the routed scaling here and into
                # the shared partial by PatchedMoELayer
                routed_scaling_factor=family.routed_scaling(block) * multiplier,
                has_shared_output=family.shared_module(block, layers[i]) is not None,
                max_tokens=max_tokens,
            )
            if spec not in bridges:  # layers with equal specs share one bridge and its workspaces
                bridges[spec] = FusionBridge(spec, group, strategy, device=device, **bridge_options)
                patch._bridges.append(bridges[spec])
            shared_columns = None
            shared = family.shared_module(block, layers[i])
            if shared is not None:
                shared_columns = block_of(rank, world, shared_width(shared))
            layer_patch = PatchedMoELayer(
                i,
                bridges[spec],
                family,
                block,
                block_of(rank, world, block.experts.gate_up_proj.shape[0]),
                shared_columns,
                name,
                norm,
                multiplier,
                shared,
            )
            patch.layers[i] = layer_patch
            patch._set(layers[i], "moe_epilogue", layer_patch)
            where = paths[id(block)]
            patch._set(
                block, "forward", block_forward(block, where, layer_patch.start, family, multiplier)
            )
            if shared is not None and family.shared_on_layer:
                patch._set(shared, "forward", shared_forward(shared, where, layer_patch))
            if HANDOFF_ATTR not in norm.__dict__:
                patch._set(norm, "forward", handoff_forward(norm, patch._norm_reused))
                patch._set(norm, HANDOFF_ATTR, None)
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
        "hidden_size": model.config.get_text_config().hidden_size,
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
