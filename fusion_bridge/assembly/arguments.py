"""FusionBridge's argument checks that need no collective: group membership, the measurement tables
given, the requested strategy (the `strategy` argument or FUSION_BRIDGE_STRATEGY) and the strategies
kept out of auto (the `exclude` argument with FUSION_BRIDGE_EXCLUDE)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from fusion_bridge import env_vars
from fusion_bridge import registry
from fusion_bridge.tuning import format as table_format
from fusion_bridge.plan.planner import AUTO, check_exclusions


def check_group_membership(group) -> None:
    """A rank outside `group` cannot take part in its collectives (torch would answer -100)."""
    if group is None or not (
        torch.distributed.is_available() and torch.distributed.is_initialized()
    ):
        return
    if torch.distributed.get_rank(group) < 0:
        raise ValueError(
            f"FusionBridge: group must be a process group this process belongs to; global rank "
            f"{torch.distributed.get_rank()} is not one of its ranks "
            f"{torch.distributed.get_process_group_ranks(group)}"
        )


EXCLUDE_ENV = "FUSION_BRIDGE_EXCLUDE"


def requested_exclusions(exclude: Sequence[str], requested: str) -> dict[str, str]:
    """{strategy to keep out of auto: where the request came from}, validated: the `exclude`
    argument and FUSION_BRIDGE_EXCLUDE (comma-separated, read through env_vars) together."""
    if isinstance(exclude, str):
        raise ValueError(f"FusionBridge: exclude must be a list of strategy names, got {exclude!r}")
    from_env = list(env_vars.read(EXCLUDE_ENV))
    known = list(registry.REGISTRY)
    out = dict.fromkeys(check_exclusions(from_env, known, requested, EXCLUDE_ENV), EXCLUDE_ENV)
    out.update(
        dict.fromkeys(check_exclusions(list(exclude), known, requested, "exclude"), "exclude")
    )
    return dict(sorted(out.items()))


def check_measurements(**tables) -> dict[str, Optional[dict]]:
    """measured_us / eager_us as given (None: not given); raises naming the first bad one, before
    any collective. Returns each normalized ({strategy: {variant: {int: float}}}, None when not
    given): what the planner reads, whatever key and number types the caller used."""
    out: dict[str, Optional[dict]] = {}
    for name, given in tables.items():
        problem = None if given is None else table_format.measurements_problem(given, name)
        if problem:
            raise ValueError(f"FusionBridge: {problem}")
        out[name] = None if given is None else table_format.normalized_measurements(given)
    return out


def requested_strategy(strategy: str) -> str:
    """FUSION_BRIDGE_STRATEGY if set, else `strategy`: "auto" or a registered name."""
    env_strategy = env_vars.read("FUSION_BRIDGE_STRATEGY")
    requested = env_strategy or strategy
    if requested != AUTO and requested not in registry.REGISTRY:
        source = "FUSION_BRIDGE_STRATEGY" if env_strategy else "strategy"
        raise ValueError(
            f"FusionBridge: {source} must be 'auto' or one of {list(registry.REGISTRY)}, "
            f"got {requested!r}"
        )
    return requested
