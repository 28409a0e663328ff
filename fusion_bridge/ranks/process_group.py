"""Facts about a torch.distributed process group that several modules need: its size and this
process's rank (also without torch.distributed), its name and store, the device its collectives
take, and how to name its ranks in a message. The one home of these helpers; none runs a collective.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def group_active(group) -> bool:
    """Whether `group` (None: the default group) names an initialised torch.distributed group."""
    return group is not None or (dist.is_available() and dist.is_initialized())


def world_size(group) -> int:
    """Ranks in `group`; 1 when torch.distributed is not initialised (a single process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def my_rank(group) -> int:
    """This process's rank in `group` (None: the default group); 0 without torch.distributed."""
    return dist.get_rank(group) if group_active(group) else 0


def group_name(group) -> str:
    """The group's name (None: the default group): identical on every member rank, distinct between
    groups, so it tells groups apart in keys."""
    pg = group if group is not None else dist.group.WORLD
    name = getattr(pg, "group_name", None)
    return name if name else dist.distributed_c10d._get_process_group_name(pg)


def group_store(group) -> "dist.Store":
    """The group's own key/value store: the store that created it, prefixed with its name for a
    subgroup. torch has no public accessor; _get_process_group_store has been stable since 2.0."""
    pg = group if group is not None else dist.group.WORLD
    getter = getattr(dist.distributed_c10d, "_get_process_group_store", None)
    return getter(pg) if getter is not None else dist.distributed_c10d._world.pg_map[pg][1]


def collective_device(group, device: torch.device) -> torch.device:
    """Where a small tensor for a collective of `group` lives: NCCL needs the GPU, gloo the CPU."""
    backend = dist.get_backend(group) if dist.is_available() and dist.is_initialized() else "gloo"
    return device if backend == "nccl" else torch.device("cpu")


def ranks_text(ranks, group) -> str:
    """'1, 3' or, when the group is not the default one, '1, 3 (global ranks 5, 7)'."""
    ranks = list(ranks)
    text = ", ".join(str(r) for r in ranks)
    if group is not None and group is not dist.group.WORLD:
        members = dist.get_process_group_ranks(group)
        glob = [members[r] for r in ranks]
        if glob != ranks:
            text += f" (global ranks {', '.join(str(g) for g in glob)})"
    return text


def check_process_group(group) -> None:
    """Refuse a bridge that would silently run alone on one rank of a multi-process launch.

    Under torchrun (or any launcher that sets WORLD_SIZE > 1) with no explicit group and no
    initialised default process group, each rank would build its own world-size-1 bridge and skip
    the all-reduce: the ranks' outputs would differ with no error. A single process (WORLD_SIZE
    unset or 1) keeps working without a group."""
    if group is not None or (dist.is_available() and dist.is_initialized()):
        return
    raw = os.environ.get("WORLD_SIZE", "").strip()
    try:
        launched = int(raw) if raw else 1
    except ValueError:
        return  # not a launcher's value: nothing to infer from it
    if launched > 1:
        raise RuntimeError(
            f"FusionBridge: WORLD_SIZE={launched} in the environment (a multi-process launch, e.g. "
            "torchrun), but torch.distributed has no initialised default process group and no "
            "`group` was given, so this rank would all-reduce with nobody. Call "
            "torch.distributed.init_process_group() on every rank before building the bridge "
            "(torchrun sets the rendezvous variables; it does not create the group), or pass "
            "group=<your tensor-parallel group>."
        )
