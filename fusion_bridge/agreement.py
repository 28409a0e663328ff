"""Rank agreement: every rank must pick the same plan, or collectives hang.

One all-reduce MIN over an int tensor with one 0/1 flag per strategy (MIN of packed bitmasks is not
AND, so each flag gets its own slot).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .reasons import Reason


def agree_flags(flags: list[int], group, device: torch.device) -> list[int]:
    """Elementwise AND of 0/1 flags across the ranks of `group`. Collective; identity without a
    group."""
    if not flags or not group_active(group):
        return list(flags)
    if dist.get_world_size(group) == 1:
        return list(flags)
    t = torch.tensor(flags, dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t.tolist()]


def collective_device(group, device: torch.device) -> torch.device:
    """NCCL needs the flags on the GPU; gloo on the CPU."""
    backend = dist.get_backend(group) if dist.is_available() and dist.is_initialized() else "gloo"
    return device if backend == "nccl" else torch.device("cpu")


def other_rank_reason(stage: str) -> Reason:
    return Reason(
        "unavailable_on_another_rank",
        f"another rank of the group cannot run this strategy ({stage}); every rank must pick "
        "the same plan, so it is off on all ranks",
        "run `python -m fusion_bridge info` on each rank to see which one and why",
    )


def group_active(group) -> bool:
    """Whether `group` (None: the default group) names an initialised torch.distributed group."""
    return group is not None or (dist.is_available() and dist.is_initialized())


def my_rank(group) -> int:
    """This process's rank in `group` (None: the default group); 0 without torch.distributed."""
    return dist.get_rank(group) if group_active(group) else 0
