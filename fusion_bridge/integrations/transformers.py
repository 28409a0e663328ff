"""Move a loaded Hugging Face transformers MoE model onto the bridge.

    from fusion_bridge.integrations.transformers import patch_moe_epilogues
    patch = patch_moe_epilogues(model, group=tp_group)   # collective over tp_group
    model.generate(...)                                  # unchanged API
    print(patch.explain())                               # per MoE layer: strategy per token count
    patch.unpatch()                                      # the model's own code again

Supported families: the rows of hf_families.table, keyed by the language model's `config.model_type`
(or a multimodal wrapper's), each read from transformers' own modeling file of that type (the
README's Hugging Face section lists them, with the transformers releases that have each). Any other
type raises UnsupportedModelError with the structural difference that keeps it off the bridge
(hf_families.structure) and the supported list. transformers 5.x (expert weights as 3-D
tensors). A wrapper's vision tower and image inputs are untouched: only its language model's MoE
layers move.

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

A model transformers loaded with tensor parallelism (`from_pretrained(path, tp_plan="auto")`) is
patched over its own TP group (its device mesh's): the routed experts, replicated by every
supported family's plan, are split as above; a shared expert the plan shards (gate/up colwise,
down rowwise) is computed from its local shards, without its own all-reduce, so each MoE layer
makes one reduction, the bridge's (hf_sharding says what is refused: any other sharding of the MoE
block). A model loaded with transformers 5.25's expert parallelism (hf_expert_parallel) has each
rank compute its own experts' shards, with their global ids, in place of `AllReduceEP`; a call
whose parameters were replaced or re-sharded since patching raises (hf_param_watch).

Contract: every rank holds the whole model (or transformers' TP shards of it) and runs the same
forward calls with identical inputs
(input_ids, attention mask, positions, cache state, generation settings); only the MoE work is
split, and the bridge sums the ranks' partial outputs token by token. Ranks fed different inputs of
the same length get wrong outputs without an error; `MoEEpiloguePatch.check_same_inputs` checks
the contract with one small all-gather, and debug mode (`debug=True`) checks it on every MoE call.

Nothing is copied: the patch sets instance attributes (`forward` of the MoE blocks and of the norms
they feed, plus `moe_epilogue` on each MoE layer) and `unpatch()` removes them, so parameters,
state_dict and the classes are the model's own throughout. The patched model runs in eval mode only
and without autograd: a patched block in training mode, or with gradients recorded, raises.

When one rank's forward fails (its router, experts, attention, ...), it takes part in the MoE
layers' calls it did not make with a NaN payload (hf_forward), so its peers get NaN logits and the
next forward is in step; the model check (hf_model_check) runs before any bridge is built.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from fusion_bridge import EpilogueSpec, FusionBridge

from fusion_bridge.integrations.hf_experts import block_of, shared_width
from fusion_bridge.integrations.hf_families import (
    Family,
    UnsupportedModelError,
    check_moe_block,
    check_rmsnorm,
    family_of,
)
from fusion_bridge.integrations.hf_forward import (
    ForwardAccount,
    out_of_step_reason,
    record_out_of_step,
)
from fusion_bridge.integrations.hf_handoff import (
    HANDOFF_ATTR,
    block_forward,
    handoff_forward,
    shared_forward,
)
from fusion_bridge import tensor_digest
from fusion_bridge.integrations.hf_layer import PatchedMoELayer
from fusion_bridge.integrations.hf_param_watch import ParameterWatch
from fusion_bridge.integrations.hf_model_check import agree_on_model, resolve_group
from fusion_bridge.integrations.hf_expert_parallel import expert_parallel
from fusion_bridge.integrations.hf_sharding import LayerLayout, layer_layouts, tp_group
from fusion_bridge.integrations.weights_digest import local

__all__ = [
    "patch_moe_epilogues",
    "unpatch_moe_epilogues",
    "MoEEpiloguePatch",
    "PatchedMoELayer",
    "UnsupportedModelError",
]

_PATCH_ATTR = "_fusion_bridge_patch"


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
                held += " of its TP-plan shard" if p.shared_sharded else ""
            held += " (its EP shard)" if p.experts_sharded else ""
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
        """Restore the model's own forwards and free the bridges. Idempotent; not collective. A
        bridge left unusable (its group out of step on this rank) is remembered, so a new patch on
        that process group raises, saying what recovers, instead of pairing its model check with a
        peer's pending collective."""
        for bridge in self._bridges:
            if bridge.unusable is not None:
                record_out_of_step(self.group, bridge.unusable)
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
    ep = expert_parallel(model)  # refuses the modes it cannot take over, naming them
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
    norms = {i: layers[i + 1].input_layernorm if i + 1 < len(layers) else final_norm
             for i in moe_indices}  # fmt: skip
    # what transformers' TP / EP plans put on each layer (hf_sharding; every refused layer named)
    layouts = layer_layouts(model, family, moe_indices, paths, blocks, layers, norms, ep)
    next_norms = {}
    for i in moe_indices:
        check_moe_block(family, blocks[i], paths[id(blocks[i])], hidden, layers[i])
        name = paths[id(norms[i])]
        next_norms[i] = (name, norms[i], check_rmsnorm(family, norms[i], name, hidden))
    device = blocks[moe_indices[0]].experts.gate_up_proj.device
    family.check_device(device)
    group, rank, world = resolve_group(tp_group(model, group), device)
    num_experts = blocks[moe_indices[0]].experts.gate_up_proj.shape[0]
    if world > num_experts:
        raise ValueError(
            f"patch_moe_epilogues: group size must be at most the number of routed experts "
            f"({num_experts}) so every rank holds at least one, got a group of {world}"
        )
    stale = out_of_step_reason(group) if world > 1 else None
    if stale is not None:
        raise RuntimeError(
            "patch_moe_epilogues: an earlier patch's calls on this process group went out of "
            f"step on this rank ({stale[:300]}); a new patch's first collective would pair with "
            "a peer's pending one. On every rank: torch.distributed.destroy_process_group(), "
            "init_process_group() again, and patch with the new group"
        )
    specs = {i: _spec(family, blocks[i], layers[i], hidden, dtype, next_norms[i][2], max_tokens)
             for i in moe_indices}  # fmt: skip
    if world > 1:  # before any bridge: the same model and the same specs on every rank
        timeout = bridge_options.get("build_timeout_s")
        agree_on_model(model, moe_indices, group, rank, specs, build_timeout_s=timeout)

    patch = MoEEpiloguePatch(model, family, group, rank, world)
    account = ForwardAccount(group)
    bridges: dict[EpilogueSpec, FusionBridge] = {}
    try:
        for i in moe_indices:
            block, spec = blocks[i], specs[i]
            name, norm, _ = next_norms[i]
            multiplier = family.multiplier(layers[i])
            if spec not in bridges:  # layers with equal specs share one bridge and its workspaces
                bridges[spec] = FusionBridge(spec, group, strategy, device=device, **bridge_options)
                patch._bridges.append(bridges[spec])
            shared_columns, layout = None, layouts.get(i, LayerLayout())
            experts = block.experts.gate_up_proj.shape[0]  # E (a DTensor's: its global shape)
            shared = family.shared_module(block, layers[i])
            if shared is not None and layout.shared_sharded:  # its plan's shard: all of it
                shared_columns = range(local(_first_linear(shared).weight).shape[0])
            elif shared is not None:
                shared_columns = block_of(rank, world, shared_width(shared))
            layer_patch = PatchedMoELayer(
                i,
                bridges[spec],
                family,
                block,
                layout.experts if layout.experts is not None else block_of(rank, world, experts),
                shared_columns,
                name,
                norm,
                multiplier,
                shared,
                account,
                layout.shared_sharded,
                layout.experts is not None,
                ParameterWatch({paths[id(m)]: m for m in (block, shared, norm) if m is not None}),
            )
            patch.layers[i] = layer_patch
            account.layers[i] = layer_patch
            patch._set(layers[i], "moe_epilogue", layer_patch)
            where = paths[id(block)]
            patch._set(block, "forward", block_forward(block, where, layer_patch, family))
            if shared is not None and family.shared_on_layer:
                patch._set(shared, "forward", shared_forward(shared, where, layer_patch))
            if HANDOFF_ATTR not in norm.__dict__:
                patch._set(norm, "forward", handoff_forward(norm, patch._norm_reused))
                patch._set(norm, HANDOFF_ATTR, None)
        patch._set(text, "forward", account.wrap(text.forward))
    except Exception:
        patch.unpatch()
        raise
    patch._set(model, _PATCH_ATTR, patch)
    return patch


def _first_linear(shared: torch.nn.Module) -> torch.nn.Module:
    """A plan-sharded shared expert's gate_proj (its local rows are this rank's columns)."""
    return shared.gate_proj


def _spec(family: Family, block, layer, hidden: int, dtype, eps: float, max_tokens: int):
    """The EpilogueSpec of one MoE layer's bridge."""
    multiplier = family.multiplier(layer)
    return EpilogueSpec(
        hidden_size=hidden,
        top_k=family.top_k(block),
        dtype=dtype,
        eps=eps,
        weight_bias=family.weight_bias,
        # residual + m * (routed + shared): m folded into the routed scaling here and into
        # the shared partial by PatchedMoELayer
        routed_scaling_factor=family.routed_scaling(block) * multiplier,
        has_shared_output=family.shared_module(block, layer) is not None,
        max_tokens=max_tokens,
    )


def unpatch_moe_epilogues(model: torch.nn.Module) -> None:
    """Undo patch_moe_epilogues on `model` (no-op if it is not patched)."""
    patch = getattr(model, _PATCH_ATTR, None)
    if patch is not None:
        patch.unpatch()
