"""What a call does when something fails on one rank, so the group's collectives stay in step.

Every rank of a TP group runs each call's collectives in the same order: the route's, then the
shadow strategy's on a sampled call. A rank that fails and simply raises leaves its peers waiting in
the call's collective, and its *next* call would pair with the peers' pending one: plausible but
wrong values everywhere. So whatever leaves a rank's call before one of its collectives (any
BaseException: a validation error, a tensor whose metadata cannot be read, an allocation or launch
failure, KeyboardInterrupt, SystemExit, asyncio's CancelledError, a call on a closed bridge) makes
the rank take part in the collectives its peers still run in that call (`take_part`), with a NaN
payload of the group's T (payload.py), and only then re-raise the original. The peers get NaN
outputs (loud, never plausible), and the next call is in step on every rank. A failure after the
route's collective still takes part in the shadow strategy's, when the call is sampled.

Taking part needs nothing that may just have failed: the payload is reserved at build, a route
whose collective is a torch.distributed all-reduce joins it with reserved NaN rows alone
(`Strategy.take_part`), so neither an allocation that just failed nor a closed bridge's freed
workspaces stand in the way. Only routes whose collective lives inside their own kernels run them.

Where a rank cannot take part, the process group is out of step on this rank: every bridge of this
process on that group is marked broken (`break_group`; every later call raises at once) with a
message that says what recovers (`broken_message`). That happens when T itself cannot be told
(none of the [T, ...] inputs is a 2-D tensor, or two of them disagree: payload.unanimous_tokens),
when the planned route for T does not exist, when taking part fails too, when a closed bridge's
route needed the workspaces close() freed, or when the failure came while this rank was inside a
collective (it cannot tell whether the peers finished it).

Debug mode over several ranks replaces all this with one small collective per call before the
epilogue's own (debug_call.py).

These are functions of explicit arguments; FusionBridge (bridge.py) calls them from its failure
path and keeps the resulting state (the broken message) itself.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional

import torch

from fusion_bridge.call.payload import (
    group_tokens,
    nan_payload,
    nan_rows,
    reserve,
    unanimous_tokens,
    votes_text,
)
from fusion_bridge.call.shadow import Shadow
from fusion_bridge.environment import Environment
from fusion_bridge.epilogue_tensors import EpilogueInputs
from fusion_bridge.plan.planner import Plan
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.strategies.base import CallStage, Strategy

PlannedRoute = Callable[[int], Optional[tuple[Strategy, str]]]


class BridgeClosedError(RuntimeError):
    """finalize_epilogue on a FusionBridge after its close()."""


def stage_of(strategy: Strategy) -> CallStage:
    """Where `strategy`'s last run stood when it raised: a strategy that does not mark its
    collective is taken to have been inside it (the bridge cannot tell where it failed)."""
    return strategy.call_stage if strategy.marks_collective else CallStage.IN_COLLECTIVE


def take_part(
    inputs: EpilogueInputs,
    error: BaseException,
    *,
    spec: EpilogueSpec,
    device: torch.device,
    world_size: int,
    call: int,
    route: Optional[tuple[Strategy, str]] | PlannedRoute,
    shadow: Optional[Shadow],
    shadow_strategy: Optional[Strategy],
    closed: bool = False,
) -> Optional[str]:
    """This rank's call number `call` failed with `error` before one of its collectives, but its
    peers are already in (or on their way to) them. Join, on a NaN payload of the group's T, the
    collectives they still run: `route`'s (the (strategy, variant) they run, or a function of T
    that plans it; None when the route's collective already ran), then `shadow_strategy`'s when
    `shadow` samples this call (every rank advances its counter here, as the peers do). `closed`:
    the bridge was closed, so only a route that needs nothing prepare() built can take part.

    Returns None when the group is in step: this rank took part (then `error` carries a note saying
    so), or there was nothing to take part in (one rank, or T == 0); the caller raises `error`.
    Otherwise returns why this rank could not take part (the `where` of broken_message); the caller
    marks the group broken on this rank."""
    if world_size == 1:
        return None
    tokens = unanimous_tokens(inputs, spec.has_shared_output)
    if tokens is None:
        majority = group_tokens(inputs, spec.has_shared_output)
        return (
            "before its collective, and its [T, ...] inputs do not give the group's T ("
            + ("more than half of them must agree" if majority is None else "they disagree")
            + f"; {votes_text(inputs)}), so it cannot tell which T its peers run (taking part "
            "with the wrong T would pair its peers' collective with its next call, or make gloo "
            "abort a peer)"
        )
    if tokens == 0:
        return None
    runs: list[tuple[Strategy, Optional[str]]] = []
    if route is not None:
        planned = route(tokens) if callable(route) else route
        if planned is None:
            return f"before its collective, and T={tokens} has no route"
        runs.append(planned)
    if shadow is not None and shadow_strategy is not None and shadow.due():
        runs.append((shadow_strategy, None))  # the peers sample this call too (run's default)
    if closed and any(inst.partial_dtype() is None for inst, _ in runs):
        names = ", ".join(inst.name for inst, _ in runs if inst.partial_dtype() is None)
        return f"after close(), which freed what {names} needs to take part in its collective"
    try:
        _join(runs, spec, device, tokens)
    except BaseException as exc:  # noqa: BLE001 - reported with the original error
        return f"before its collective; taking part with a NaN payload failed too ({exc!r})"
    if runs:
        add_note(
            error,
            f"fusion_bridge: this rank took part in call {call} with a NaN payload of "
            f"T={tokens}, so its peers got NaN outputs and the next call is in step",
        )
    return None


def _join(
    runs: Iterable[tuple[Strategy, Optional[str]]],
    spec: EpilogueSpec,
    device: torch.device,
    tokens: int,
) -> None:
    """Each (strategy, variant)'s collectives on NaN: reserved NaN rows for a strategy whose
    collective is an all-reduce of the partial, its own run on the NaN payload otherwise."""
    payload = None
    for inst, variant in runs:
        dtype = inst.partial_dtype()
        inst.call_stage = CallStage.BEFORE_COLLECTIVE
        if dtype is not None:
            inst.take_part(None, variant, nan_rows(device, dtype, spec.hidden_size, tokens))
            continue
        if payload is None:
            payload = nan_payload(
                device, spec.dtype, spec.hidden_size, spec.top_k, tokens, spec.has_shared_output
            )
        inst.take_part(payload, variant)


def reserve_for(
    plan: Plan,
    instances: Mapping[str, Strategy],
    also: Iterable[str],
    spec: EpilogueSpec,
    device: torch.device,
    env: Environment,
) -> None:
    """On several ranks, reserve what taking part needs (payload.reserve) for a bridge that runs
    `plan` and the strategies named in `also` (the shadow): the NaN payload, and NaN rows in the
    dtype of each all-reduced partial among them."""
    if env.world_size == 1:
        return
    names = {*plan.choice, *getattr(plan, "eager_choice", ()), *also}
    if plan.overflow:
        names.add(plan.overflow)
    dtypes = [instances[n].partial_dtype() for n in sorted(names) if n in instances]
    partials = tuple(dict.fromkeys(d for d in dtypes if d is not None))
    reserve(device, spec.dtype, spec.hidden_size, spec.top_k, spec.max_tokens, partials)


def broken_message(call: int, error: BaseException, where: str) -> str:
    """Why a bridge refuses every later call, and what recovers."""
    return (
        f"finalize_epilogue: this FusionBridge is unusable: call {call} failed on this rank "
        f"({type(error).__name__}: {str(error)[:500]}) {where}, so this rank could not keep the "
        "group's collectives in step. If the other ranks called with valid inputs, they wait in "
        "that call until the route's own timeout: the process group's timeout for NCCL/gloo and "
        "FlashInfer routes (after which the process group itself is unusable), "
        "FUSION_BRIDGE_SYMM_TIMEOUT_S for our symmetric-memory kernels. To recover, on every "
        "rank: torch.distributed.destroy_process_group(), init_process_group() again, and rebuild "
        "every FusionBridge."
    )


def break_group(bridges: Iterable, broken, message: str) -> None:
    """Mark `broken` and every other bridge among `bridges` on the same process group unusable:
    the group is out of step on this rank, so a call on any of them would pair with a peer's
    pending collective. The others say which bridge broke first."""
    broken._broken = message
    for bridge in bridges:
        same = bridge.group is broken.group or (
            {bridge.group, broken.group} <= {None, _world_group()}
        )
        if bridge is not broken and same and bridge._broken is None:
            bridge._broken = (
                f"finalize_epilogue: this FusionBridge is unusable: another FusionBridge on the "
                f"same process group ({broken.name}) broke it: {message}"
            )


def _world_group():
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def add_note(error: BaseException, note: str) -> None:
    """Attach `note` to the exception's report where Python supports notes (3.11+)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
