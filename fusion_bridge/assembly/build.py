"""Building a bridge: from FusionBridge's arguments to a `BuiltBridge`, everything a call needs.

Collective over `group` (every rank builds its bridges in the same order), in this order:
  1. the checks this rank can make alone (arguments.py), before the first collective, so a typo
     raises at once on the rank that made it;
  2. the check-in through the store (no collective, bounded by build_timeout_s), then one agreement
     on every setting that must be equal on every rank;
  3. admission (admission.py): capabilities, resources, workspaces and the self-test, each agreed
     across ranks, so every rank keeps the same prepared strategies;
  4. the plan: planner.select_for_modes over the agreed statuses and the measurements (given, or
     rank 0's cached or shipped table), and on several ranks the NaN payload a failing call takes
     part with, reserved for the plan's routes and the shadow (call/failure.py); the plan, or the
     error planning or reserving raised, is agreed across ranks (so a failure on one rank raises on
     every rank) and bound to the prepared instances (call/routes.py).
If step 4 fails, the prepared strategies are closed before the error propagates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from fusion_bridge import env_vars, log, registry
from fusion_bridge.assembly.admission import Admission, admit
from fusion_bridge.assembly.arguments import (
    check_group_membership,
    check_measurements,
    requested_exclusions,
    requested_strategy,
)
from fusion_bridge.call.failure import reserve_for
from fusion_bridge.call.routes import Routes, bind_plan
from fusion_bridge.call.shadow import Shadow
from fusion_bridge.environment import Environment, default_device, detect
from fusion_bridge.plan.planner import AUTO, select_for_modes
from fusion_bridge.plan.status import StrategyStatus
from fusion_bridge.ranks import agreement as rank_agreement, check_in as rank_check_in
from fusion_bridge.ranks.process_group import check_process_group
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.strategies.base import Strategy
from fusion_bridge.tuning import tables as tuning_tables


@dataclass
class BuiltBridge:
    """What a built bridge is: the same on every rank of `group`, except `device`, `env`'s
    per-rank facts and the instances' workspaces.

    spec: the layer's EpilogueSpec. group: the TP process group (None: the default group, or a
    single process). requested: "auto" or the strategy asked for by name (the `strategy` argument
    or FUSION_BRIDGE_STRATEGY). debug: whether calls run the value checks and per-call agreement.
    device: where the tensors live. build_index: this build's number among the group's builds.
    env: the detected (or given) Environment. statuses: every registered strategy with its reasons,
    in registry order. instances: the prepared strategies, usable on every rank. shadow: shadow
    mode's sampler, or None. table: the measurement table the plan came from (None: none used).
    routes: the plan, agreed across ranks and bound to `instances` (routes.plan is the Plan)."""

    spec: EpilogueSpec
    group: object
    requested: str
    debug: bool
    device: torch.device
    build_index: int
    env: Environment
    statuses: list[StrategyStatus]
    instances: dict[str, Strategy]
    shadow: Optional[Shadow]
    table: Optional[dict]
    routes: Routes


def build_bridge(
    spec: EpilogueSpec,
    group=None,
    strategy: str = AUTO,
    *,
    device: Optional[torch.device] = None,
    environment: Optional[Environment] = None,
    self_test: Optional[bool] = None,
    debug: Optional[bool] = None,
    tuning: str = "auto",
    measured_us: Optional[dict] = None,
    eager_us: Optional[dict] = None,
    shadow: Optional[str] = None,
    build_timeout_s: Optional[float] = None,
    exclude: Sequence[str] = (),
) -> BuiltBridge:
    """Build what FusionBridge(spec, group, strategy, ...) runs; the arguments are FusionBridge's
    (its docstring says what each means). Collective over `group`. Raises TypeError / ValueError
    for a bad argument (before any collective), RankAgreementError when the ranks disagree or one
    does not arrive."""
    if not isinstance(spec, EpilogueSpec):
        raise TypeError(f"FusionBridge: spec must be an EpilogueSpec, got {type(spec).__name__}")
    # everything this rank can check alone, before the first collective (the check-in)
    env_vars.check_all()
    log.configure_once()
    check_group_membership(group)
    given = check_measurements(measured_us=measured_us, eager_us=eager_us)
    measured_us, eager_us = given["measured_us"], given["eager_us"]
    requested = requested_strategy(strategy)
    excluded = requested_exclusions(exclude, requested)
    if tuning not in ("auto", "off"):
        raise ValueError(f"FusionBridge: tuning must be 'auto' or 'off', got {tuning!r}")
    source = "shadow" if shadow is not None else "FUSION_BRIDGE_SHADOW"
    shadow = shadow if shadow is not None else env_vars.read("FUSION_BRIDGE_SHADOW")
    sampler = Shadow.parse(shadow, list(registry.REGISTRY), source) if shadow else None
    debug = env_vars.read("FUSION_BRIDGE_DEBUG") if debug is None else debug
    run_self_test = env_vars.read("FUSION_BRIDGE_SELF_TEST") if self_test is None else self_test
    device = default_device(device)
    rank_check_in.build_timeout_s(build_timeout_s)  # raises naming the argument or the variable
    check_process_group(group)  # before anything collective: a forgotten init_process_group
    # Ranks check in through the store (no collective, bounded), then agree on every setting that
    # must be equal, before any other collective of the build.
    build_index = rank_check_in.check_in(group, timeout_s=build_timeout_s)
    rank_agreement.agree_on_settings(
        {
            "spec": spec.to_dict(),
            "requested_strategy": requested,
            "debug": debug,
            "self_test": run_self_test,
            "shadow": sampler.to_dict_settings() if sampler else None,
            "tuning": tuning,
            "measured_us_given": measured_us is not None,
            "excluded": ",".join(excluded),
            "eager_us_given": eager_us is not None,
        },
        group,
    )
    env = environment or detect(group, device)
    admitted = admit(
        spec,
        env,
        group,
        device,
        requested=requested,
        also_prepare=(sampler.strategy,) if sampler else (),
        run_self_test=run_self_test,
        excluded=excluded,
    )
    try:
        _check_shadow_admitted(sampler, admitted)
        table: Optional[dict] = None
        if measured_us is None and tuning == "auto" and device.type == "cuda":
            table = tuning_tables.load_table(spec, env, group)  # collective: rank 0 decides
            if table is not None:
                measured_us = tuning_tables.as_measurements(table)
                eager_us = tuning_tables.as_measurements(table, "eager_us")
        try:
            plan = select_for_modes(
                admitted.statuses,
                spec,
                requested,
                measured_us,
                eager_us,
                tuning_tables.margin_of(table),
            )
            also = (sampler.strategy,) if sampler else ()
            reserve_for(plan, admitted.instances, also, spec, device, env)
        except Exception as exc:  # noqa: BLE001 - every rank learns it in the plan's agreement
            plan = exc
        routes = bind_plan(plan, admitted.instances, env.world_size, group)
    except Exception:
        close_instances(admitted.instances)
        raise
    return BuiltBridge(
        spec=spec,
        group=group,
        requested=requested,
        debug=debug,
        device=device,
        build_index=build_index,
        env=env,
        statuses=admitted.statuses,
        instances=admitted.instances,
        shadow=sampler,
        table=table,
        routes=routes,
    )


def _check_shadow_admitted(sampler: Optional[Shadow], admitted: Admission) -> None:
    """The shadow strategy must have been admitted (prepared on every rank); raises ValueError
    with its reasons otherwise."""
    if sampler and sampler.strategy not in admitted.instances:
        status = next(s for s in admitted.statuses if s.name == sampler.strategy)
        raise ValueError(
            f"FusionBridge: shadow strategy {sampler.strategy!r} cannot run here: "
            + "; ".join(f"[{r.code}] {r.message}" for r in status.reasons)
        )


def close_instances(instances: dict[str, Strategy]) -> None:
    """Free the prepared strategies' workspaces, in registry order (as every rank prepared them:
    closing a collective workspace may wait for the other ranks)."""
    for inst in instances.values():
        inst.close()
