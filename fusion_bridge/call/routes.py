"""The plan bound to the prepared strategy instances: what a call's dispatch reads.

A Plan (plan/planner.py) names a (strategy, launch variant) per token bucket by name; `bind_plan`
first checks that every rank will execute the same plan (one collective), then turns it into
`Routes`, lists of (instance, variant, checks shapes?) that FusionBridge indexes by bucket in O(1)
on every call. Binding happens at build and again after `tune`.

A call its bucket's route cannot take (T above max_tokens, or a shape the bucket's strategy
refuses) goes to the plan's overflow route (`overflow_route`), logged at most once a minute.

`route_for` / `strategy_for` answer the same question from the plan's names, for reports and tools.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Optional

from fusion_bridge import log
from fusion_bridge.call.validation import EpilogueInputError, check_token_limit
from fusion_bridge.epilogue_tensors import EpilogueInputs
from fusion_bridge.plan.planner import Plan
from fusion_bridge.ranks import agreement as rank_agreement
from fusion_bridge.strategies.base import Strategy

#: (strategy instance, launch variant, does the strategy check shapes in `accepts`?)
Route = tuple[Strategy, str, bool]


@dataclass(frozen=True)
class Routes:
    """One plan, bound. graph: the route per token bucket for calls under CUDA-graph capture (and
    for every call when the plan is not mode-dependent); eager: the route per bucket for calls
    outside capture (the same list unless mode_dependent); overflow: the (instance, variant) for T
    above max_tokens or a shape a bucket's strategy refuses, None when there is none."""

    plan: Plan
    graph: list[Route]
    eager: list[Route]
    mode_dependent: bool
    overflow: Optional[tuple[Strategy, str]]


def bind_plan(
    plan: Plan | Exception, instances: Mapping[str, Strategy], world_size: int, group
) -> Routes:
    """Check that every rank will execute the same plan (collective when world_size > 1: raises
    RankAgreementError on every rank when they differ), then bind it to the prepared `instances`:
    one (instance, variant, checks shapes?) per bucket. Every strategy the plan names is prepared
    (the planner picks among the admitted ones). `plan` may be the exception planning raised on
    this rank: it is agreed like a plan (a rank whose planning failed differs from one whose did
    not, and every rank raises naming it), then raised when every rank failed alike."""
    failed = isinstance(plan, Exception)
    if world_size > 1:
        # the error's class is compared (its text may name per-rank reasons); when it differs, every
        # rank gathers every failing rank's text for the message
        settings = (
            {"planning_failed": type(plan).__name__}
            if failed
            else rank_agreement.plan_settings(plan)
        )
        try:
            rank_agreement.agree_on_settings(settings, group, what="the plan")
        except rank_agreement.RankAgreementError as exc:
            if "planning_failed" not in exc.fields:
                raise
            mine = f"{type(plan).__name__}: {plan}" if failed else None
            reasons = rank_agreement.gather_reasons(mine, group)
            raise rank_agreement.RankAgreementError(
                f"{exc}\nplanning failed on "
                + "; ".join(f"rank {r}: {reason}" for r, reason in reasons.items()),
                fields=exc.fields,
            ) from (plan if failed else None)
    if failed:
        raise plan
    shape_checked = {
        name: type(inst).accepts is not Strategy.accepts for name, inst in instances.items()
    }
    graph = [
        (instances[name], variant, shape_checked[name])
        for name, variant in zip(plan.choice, plan.variants)
    ]
    mode_dependent = plan.mode_dependent  # then eager calls (not capturing) take their own routes
    eager = (
        [
            (instances[name], variant, shape_checked[name])
            for name, variant in zip(plan.eager_choice, plan.eager_variants)
        ]
        if mode_dependent
        else graph
    )
    overflow = (instances[plan.overflow], plan.overflow_variant) if plan.overflow else None
    return Routes(plan, graph, eager, mode_dependent, overflow)


def overflow_route(
    inputs: EpilogueInputs,
    tokens: int,
    refused: Optional[Strategy],
    overflow: Optional[tuple[Strategy, str]],
    max_tokens: int,
    last_choice: str,
) -> tuple[Strategy, str]:
    """The route for a call of T tokens that its bucket's route cannot take: T above `max_tokens`
    (refused is None) or a shape the bucket's strategy `refused` rejects. Returns the `overflow`
    (instance, variant) when there is one and it is not the strategy that refused; otherwise raises
    EpilogueInputError naming the token limit or the refusing strategy (the last bucket's strategy,
    `last_choice`, when T is above max_tokens)."""
    name = refused.name if refused is not None else last_choice
    if overflow is None or overflow[0] is refused:
        check_token_limit(tokens, max_tokens, name)
        raise EpilogueInputError(
            f"finalize_epilogue: strategy {name!r} cannot take these inputs "
            f"(gemm2_out has {inputs.gemm2_out.numel()} elements, its kernel "
            "indexes with int32) and no other strategy was selected"
        )
    return overflow


def log_reroute(
    bridge_name: str, tokens: int, to: Strategy, refused: Optional[Strategy], reroutes: int
) -> None:
    """Log (INFO, at most once a minute per bridge) that a call of T tokens went to the overflow
    strategy `to`, and the bridge's reroute count so far."""
    log.log_every(
        (bridge_name, "reroute"),
        60.0,
        logging.INFO,
        "fusion_bridge: T=%d routed to %s (%s); %d reroutes so far",
        tokens,
        to.name,
        "above max_tokens" if refused is None else f"{refused.name} refused the shapes",
        reroutes,
    )


def route_for(plan: Plan, tokens: int, eager: bool = False) -> Optional[tuple[str, str]]:
    """(strategy, variant) names a call with T tokens runs under CUDA graphs (eager=True: outside
    capture), or None (T == 0, or no route above max_tokens)."""
    tokens = token_count(tokens, "route_for")
    return plan.route_for(tokens, eager) if tokens > 0 else None


def strategy_for(plan: Plan, tokens: int) -> Optional[str]:
    """The strategy name a captured call with T tokens runs, or None (T == 0, or no route)."""
    tokens = token_count(tokens, "strategy_for")
    return plan.strategy_for(tokens) if tokens > 0 else None


def token_count(tokens, where: str) -> int:
    """`tokens` as an int >= 0 (an int, or an integral torch/numpy scalar), or TypeError /
    ValueError naming `where`'s argument, what it must be and what it got."""
    if isinstance(tokens, bool) or not hasattr(tokens, "__index__"):
        raise TypeError(
            f"{where}: tokens must be an int (the token count T), got {type(tokens).__name__} "
            f"{tokens!r}"
        )
    value = tokens.__index__()
    if value < 0:
        raise ValueError(f"{where}: tokens must be >= 0, got {value}")
    return value
