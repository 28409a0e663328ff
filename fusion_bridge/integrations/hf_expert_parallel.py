"""A model transformers loaded with expert parallelism: what the patch reads from it, and what it
refuses.

transformers 5.25's expert parallelism (`from_pretrained(path, distributed_config=
DistributedConfig(tp_size=W, ep_size=W))`, TP + EP, or with `tp_plan={}`, EP alone) shards each
MoE layer's routed experts by expert: `gate_up_proj` / `down_proj` become `Shard(0)` DTensors on
the EP mesh (rank r holds experts [r*E/W, (r+1)*E/W)), and the experts' `forward` is replaced by
an EP implementation. When the EP group is the TP group, every rank holds the same batch and
transformers' `AllReduceEP` (the inference path of `ep_implementation="auto"`, or "all_reduce")
masks the routes to other ranks' experts and all-reduces the experts' output.

That is exactly the bridge's own split: the patch computes this rank's experts from their local
shards (global ids as above; routes held elsewhere are -1 slots of the index map), never calling
the experts' forward, so `AllReduceEP`'s reduction does not run and the bridge's one reduction
per MoE layer sums the routed and shared partials. Nothing is copied or re-sharded.

Refused, for the whole model, naming the mode and the version: EP whose group is not the TP group
(transformers then exchanges tokens all-to-all between ranks that hold different batches), an
`ep_implementation` other than "auto" / "all_reduce" (all-to-all, DeepGEMM Mega MoE), and 5.17's
router-hooked expert parallelism (`enable_expert_parallel=True`: its router returns local ids with
a sentinel). Per layer (hf_sharding): experts sharded other than whole experts `Shard(0)` on that
group, or wrapped other than by the plan's `ep_dispatch_experts`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from fusion_bridge.integrations.hf_families import UnsupportedModelError
from fusion_bridge.integrations.weights_digest import is_dtensor

# the EP plan's styles on the routed experts the patch knows: the module's dispatch, its weights
EP_STYLES = {"module": "ep_dispatch_experts", "parameter": "grouped_gemm"}
# ep_implementation values that reduce the experts' output with one all-reduce of the shared batch
ALL_REDUCE_IMPLEMENTATIONS = ("auto", "all_reduce")


@dataclass(frozen=True)
class ExpertParallel:
    """The model's expert parallelism: size W of its EP group, this rank's index on it and the
    group's global ranks (equal to the TP group's, in order)."""

    size: int
    rank: int
    ranks: tuple[int, ...]


def _version() -> str:
    import transformers

    return f"transformers {transformers.__version__}"


def _refuse(mode: str, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"patch_moe_epilogues: the model was loaded with {mode} under {_version()}, which the "
        f"patch cannot take over: {why}. The patch supports models loaded whole, with tensor "
        "parallelism (tp_plan='auto'), or with expert parallelism whose EP group is the TP group "
        "(DistributedConfig(tp_size=W, ep_size=W), optionally tp_plan={}) and "
        "ep_implementation 'auto' or 'all_reduce'"
    )


def expert_parallel(model: torch.nn.Module) -> Optional[ExpertParallel]:
    """The model's expert parallelism (None: loaded without it). Raises UnsupportedModelError for
    a mode the patch cannot take over (see the module docstring), naming it and the version."""
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    if config is None:
        return None
    ep_size = getattr(config, "ep_size", None) or 1
    if ep_size <= 1:
        if getattr(config, "enable_expert_parallel", False):
            raise _refuse(
                "router-hooked expert parallelism (DistributedConfig(enable_expert_parallel=True))",
                "its plan hooks the router, which returns local expert ids with a sentinel",
            )
        return None
    mode = f"expert parallelism (DistributedConfig(ep_size={ep_size}))"
    implementation = getattr(config, "ep_implementation", "auto")
    if implementation not in ALL_REDUCE_IMPLEMENTATIONS:
        raise _refuse(
            mode,
            f"ep_implementation={implementation!r} exchanges tokens between the ranks inside the "
            "experts' forward (no all-reduce for the bridge to take the place of)",
        )
    text_config = model.config.get_text_config()
    if getattr(text_config, "_experts_implementation", None) == "deepgemm_megamoe":
        raise _refuse(mode, "DeepGEMM Mega MoE experts exchange tokens inside their kernel")
    manager = getattr(model, "_mesh_manager", None)
    if manager is None:
        raise _refuse(mode, "the model holds no mesh manager (model._mesh_manager) to read the "
                      "EP group from")  # fmt: skip
    ep_group = manager.get_mesh("ep").get_group()
    tp_mesh = manager.get_mesh("tp")
    ep_ranks = tuple(dist.get_process_group_ranks(ep_group))
    tp_ranks = tuple(dist.get_process_group_ranks(tp_mesh.get_group()))
    if ep_ranks != tp_ranks:
        raise _refuse(
            mode,
            f"its EP group (ranks {list(ep_ranks)}) is not its TP group (ranks {list(tp_ranks)}), "
            "so the ranks of an EP group hold different batches and transformers exchanges "
            "tokens all-to-all",
        )
    return ExpertParallel(ep_size, dist.get_rank(ep_group), ep_ranks)


def _styles(model: torch.nn.Module, name: str) -> set[str]:
    """The EP plan styles whose key names `name` ('*' stands for one path component)."""
    out = set()
    for key, style in (getattr(model, "_ep_plan", None) or {}).items():
        if re.compile(re.escape(key).replace(r"\*", r"[^.]+")).fullmatch(name):
            out.add(style)
    return out


def held_experts(
    model: torch.nn.Module, experts: torch.nn.Module, where: str, ep: ExpertParallel
) -> tuple[Optional[range], Optional[str]]:
    """(the global ids of the routed experts this rank holds, None) for experts the EP plan
    sharded as transformers 5.25 does (every parameter `Shard(0)` over the EP group, E/W whole
    experts a rank, the forward the plan's `ep_dispatch_experts`); (None, None) for replicated
    experts (no DTensor parameter, no replaced forward); (None, why) for anything else. `where`:
    the experts' module path."""
    params = dict(experts.named_parameters(recurse=False))
    sharded = {n: p for n, p in params.items() if is_dtensor(p)}
    wrapped = "forward" in vars(experts)
    if not sharded and not wrapped:
        return None, None
    styles = _styles(model, where)
    if not wrapped or styles != {EP_STYLES["module"]}:
        return None, (
            f"its routed experts are not dispatched by the EP plan's {EP_STYLES['module']!r} "
            f"(EP plan styles on {where}: {sorted(styles) or 'none'}; forward replaced: {wrapped})"
        )
    experts_count = params["gate_up_proj"].shape[0] if "gate_up_proj" in params else 0
    if experts_count % ep.size:
        return None, f"{experts_count} routed experts do not split evenly over {ep.size} ranks"
    count = experts_count // ep.size
    for name, p in params.items():
        placements = getattr(p, "placements", None)
        ok = (
            is_dtensor(p)
            and _styles(model, f"{where}.{name}") == {EP_STYLES["parameter"]}
            and len(placements) == 1
            and getattr(placements[0], "dim", None) == 0
            and tuple(dist.get_process_group_ranks(p.device_mesh.get_group())) == ep.ranks
            and p.shape[0] == experts_count
            and p.to_local().shape[0] == count
        )
        if not ok:
            local_shape = tuple(p.to_local().shape) if is_dtensor(p) else "not a DTensor"
            return None, (
                f"{where}.{name} is not {count} whole experts of {experts_count} sharded "
                f"{EP_STYLES['parameter']!r} Shard(0) over the EP group {list(ep.ranks)} "
                f"(placements {placements}, global shape {tuple(p.shape)}, local {local_shape})"
            )
    return range(ep.rank * count, (ep.rank + 1) * count), None
