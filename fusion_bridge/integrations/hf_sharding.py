"""A model transformers loaded sharded (`from_pretrained(path, tp_plan="auto")`): what the patch
reads from it, and what it refuses.

transformers' tensor parallelism (5.25) shards attention and dense MLPs by the model's TP plan:
their weights become DTensors and a sharded module's `forward` is replaced by an instance attribute
(colwise in, rowwise out with an all-reduce of its own). Under every supported family's plan the
routed experts stay replicated (plain parameters on every rank); a family whose plan names its
shared expert (DeepSeek-V3, GLM-4-MoE, Qwen3.5-MoE: `gate_proj` / `up_proj` colwise, `down_proj`
rowwise) holds that MLP sharded by its intermediate columns, and its `down_proj` all-reduces.

The patch then: splits the routed experts over the ranks as for a replicated model; computes the
plan-sharded shared expert from its local shards as they are (no second slicing: the shards *are*
this rank's columns), never calling its forward, so its own all-reduce does not run and the
bridge's one reduction sums both partials; slices a replicated shared expert as usual; and runs
over the model's own TP group, read from its device mesh.

A model loaded with transformers 5.25's expert parallelism (hf_expert_parallel) holds each
layer's routed experts as whole-expert shards over the TP group: the patch computes this rank's
experts from them (global ids), in place of `AllReduceEP`'s masked experts and all-reduce.

What it cannot establish on a layer it refuses, naming every such layer and its reason, before
anything is patched: any other sharded (DTensor) parameter or replaced `forward` (a TP or EP
style) on the MoE block or its shared expert (5.17's `moe_tp_experts` plan, which shards the
routed experts by their intermediate columns; any other plan entry on the block), a sharded or
wrapped next norm. Forward hooks are not refused: the patched block runs its router's and its own
hooks as the model does. Expert parallelism the patch cannot take over (all-to-all, 5.17's
router-hooked `enable_expert_parallel`) and meshes with other dimensions than TP are refused for
the whole model, naming the mode and the version.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from fusion_bridge.integrations.hf_expert_parallel import held_experts
from fusion_bridge.integrations.hf_families import UnsupportedModelError
from fusion_bridge.integrations.weights_digest import is_dtensor, is_sharded

# the plan a sharded shared expert must have, by its submodule: (style, weight placement)
SHARDED_SHARED = {
    "gate_proj": ("colwise", 0),
    "up_proj": ("colwise", 0),
    "down_proj": ("rowwise", 1),
}


def _version() -> str:
    import transformers

    return f"transformers {transformers.__version__}"


def is_sharded_model(model: torch.nn.Module) -> bool:
    """Whether transformers distributed this model (a device mesh, or any DTensor parameter)."""
    if getattr(model, "_device_mesh", None) is not None:
        return True
    return any(is_dtensor(p) for p in model.parameters())


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def tp_group(model: torch.nn.Module, group):
    """The process group the patch runs over: for a sharded model, its device mesh's TP group
    (`group` must be None or a group of the same ranks in the same order); otherwise `group`."""
    if not is_sharded_model(model):
        return group
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        raise UnsupportedModelError(
            "patch_moe_epilogues: the model holds DTensor parameters but no device mesh "
            "(model._device_mesh): only models transformers loaded sharded (tp_plan='auto') "
            "are supported"
        )
    names = tuple(mesh.mesh_dim_names or ())
    others = {n: mesh.size(names.index(n)) for n in names if n != "tp"}
    if any(size > 1 for size in others.values()):
        raise UnsupportedModelError(
            f"patch_moe_epilogues: the model's device mesh has dimensions {others} besides tp "
            f"(pipeline / FSDP / data parallelism under {_version()}); the patch supports a mesh "
            "of tensor parallelism alone"
        )
    mesh_group = mesh.get_group("tp") if "tp" in names else mesh.get_group()
    if group is None:
        return mesh_group
    if not dist.is_initialized() or _ranks(group) != _ranks(mesh_group):
        given = _ranks(group) if dist.is_initialized() else "torch.distributed not initialised"
        raise ValueError(
            f"patch_moe_epilogues: group must be the model's own tensor-parallel group (its "
            f"device mesh's 'tp' group, ranks {_ranks(mesh_group)}), or None to use it; got a "
            f"group of ranks {given}"
        )
    return group


def _plan_entries(model: torch.nn.Module, names, plan: str = "_tp_plan") -> dict[str, str]:
    """{plan key: style} of the model's TP plan (or `plan`: "_ep_plan") entries that name one of
    the modules `names` ('*' in a key stands for one path component, a layer index)."""
    out = {}
    for key, style in (getattr(model, plan, None) or {}).items():
        pattern = re.compile(re.escape(key).replace(r"\*", r"[^.]+"))
        if any(pattern.fullmatch(name) for name in names):
            out[key] = style
    return out


def _installed(module: torch.nn.Module) -> Optional[str]:
    """What transformers' TP installs on a module it shards: an instance `forward` (hooks are
    not looked at: the patch runs the block's and router's own hooks as the model does)."""
    return "a replaced forward (a TP style)" if "forward" in vars(module) else None


@dataclass(frozen=True)
class LayerLayout:
    """How transformers sharded one MoE layer. shared_sharded: its shared expert is the TP plan's
    shard (use the local weights whole); experts: the global ids of the routed experts this rank
    holds as the EP plan's local shard (None: replicated, split by the patch)."""

    shared_sharded: bool = False
    experts: Optional[range] = None


def layer_layouts(model, family, indices, paths, blocks, layers, norms, ep) -> dict:
    """{MoE layer index: LayerLayout} ({} for a model transformers did not shard); raises one
    UnsupportedModelError naming every layer the patch cannot take over, each with its reason.
    ep: the model's hf_expert_parallel.expert_parallel (None: without it)."""
    if not is_sharded_model(model):
        return {}
    out, refused = {}, []
    for i in indices:
        shared = family.shared_module(blocks[i], layers[i])
        try:
            out[i] = layer_layout(model, i, paths, blocks[i], shared, norms[i], ep)
        except UnsupportedModelError as exc:
            refused.append((i, str(exc).removeprefix("patch_moe_epilogues: ")))
    if refused:
        raise UnsupportedModelError(
            f"patch_moe_epilogues: {len(refused)} of the sharded model's {len(indices)} MoE "
            f"layers cannot be patched (layers {[i for i, _ in refused]}):\n"
            + "\n".join(f"- {why}" for _, why in refused)
        )
    return out


def layer_layout(
    model: torch.nn.Module, index: int, paths: dict, block, shared, norm, ep=None
) -> LayerLayout:
    """For MoE layer `index` of a sharded model: its LayerLayout (a shared expert plan-sharded as
    SHARDED_SHARED, routed experts EP-sharded as hf_expert_parallel.held_experts accepts, or
    either replicated). Raises UnsupportedModelError naming the layer, what is in the way and the
    plan entries that put it there."""
    where = paths[id(block)]
    modules = {paths[id(m)]: m for m in block.modules()}
    if shared is not None:
        modules.update({paths[id(m)]: m for m in shared.modules()})
    trio = {}
    if shared is not None:
        trio = {f"{paths[id(shared)]}.{n}": n for n in SHARDED_SHARED if hasattr(shared, n)}
    found = {}  # module path -> what is on it
    for name, module in modules.items():
        sharded = [p for p, t in module.named_parameters(recurse=False) if is_dtensor(t)]
        what = _installed(module)
        if sharded or what:
            found[name] = (sharded, what)

    def refuse(why: str):
        entries = _plan_entries(model, modules)
        names = [*modules, *(f"{n}.{p}" for n, m in modules.items() for p, _ in
                             m.named_parameters(recurse=False))]  # fmt: skip
        ep_entries = _plan_entries(model, names, "_ep_plan")
        raise UnsupportedModelError(
            f"patch_moe_epilogues: MoE layer {index} ({where}) of the sharded model cannot be "
            f"patched under {_version()}: {why}; its TP plan entries: {entries or 'none'}"
            + (f", its EP plan entries: {ep_entries}" if ep_entries else "")
            + ". The patch supports routed experts replicated or sharded by expert parallelism "
            "(whole experts, Shard(0) over the TP group) and a shared expert either replicated "
            "or sharded as gate_proj/up_proj colwise, down_proj rowwise (the layer then makes "
            "one reduction, the bridge's)"
        )

    experts = None
    if ep is not None and hasattr(block, "experts"):  # 5.25's EP: its shards, else refused
        experts_path = paths[id(block.experts)]
        experts, why = held_experts(model, block.experts, experts_path, ep)
        if why is not None:
            refuse(why)
        found.pop(experts_path, None)  # EP-sharded as the plan says, or replicated
    extra = sorted(set(found) - set(trio))
    if extra:
        details = "; ".join(
            f"{n}: "
            + ", ".join(filter(None, [found[n][1], *(f"DTensor {p}" for p in found[n][0])]))
            for n in extra[:3]
        )
        refuse(f"sharded parameters or installed forwards the patch does not know ({details})")
    if is_sharded(norm.weight) or _installed(norm):
        refuse("its next norm is sharded or wrapped")
    if not found:
        return LayerLayout(False, experts)
    if set(found) != set(trio) or len(trio) != len(SHARDED_SHARED):
        refuse(f"only part of its shared expert is sharded ({sorted(found)})")
    for name, short in trio.items():
        linear = modules[name]
        weight, dim = linear.weight, SHARDED_SHARED[short][1]
        placements = getattr(weight, "placements", ())
        ok = len(placements) == 1 and getattr(placements[0], "dim", None) in (dim, dim - 2)
        if not ok or getattr(linear, "bias", None) is not None:
            refuse(f"{name} is not sharded {SHARDED_SHARED[short][0]} without bias ({placements})")
    return LayerLayout(True, experts)
