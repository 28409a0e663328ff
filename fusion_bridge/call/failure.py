"""What a call does when something fails on one rank, so the group's collectives stay in step.

Every rank of a TP group runs each call's collectives in the same order. A rank that fails and
simply raises leaves its peers waiting in the call's collective, and its *next* call would pair with
the peers' pending one: plausible but wrong values everywhere. So a failure anywhere before this
rank's collective (validation, reading an exotic tensor's metadata, allocation, a kernel launch)
makes the rank take part in the call anyway (`take_part`), with a NaN payload of the group's T
through the route its peers run (payload.py), and only then raise. The peers get NaN outputs (loud,
never plausible), and the next call is in step on every rank.

Where a rank cannot take part, its bridge is marked broken (every later call raises) with a message
that says what recovers (`broken_message`); that happens when T itself is unreadable (none of the
[T, ...] inputs is a 2-D tensor), when the planned route for T does not exist, when taking part
fails too, or when the failure came while this rank was inside the collective (it cannot tell
whether the peers finished it).

Debug mode over several ranks replaces all this with one small collective per call before the
epilogue's own (`agree_on_call`): if any rank failed its checks, T differs or a rank is on another
call, every rank raises the same error and none runs the epilogue.

These are functions of explicit arguments; FusionBridge (bridge.py) calls them from its failure
path and keeps the resulting state (the broken message) itself.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from fusion_bridge.call.payload import group_tokens, nan_payload
from fusion_bridge.call.shadow import Shadow
from fusion_bridge.call.validation import validate_index_values, validate_inputs
from fusion_bridge.epilogue_tensors import EpilogueInputs
from fusion_bridge.ranks import agreement as rank_agreement
from fusion_bridge.ranks.process_group import collective_device
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.strategies.base import CallStage, Strategy

PlannedRoute = Callable[[int], Optional[tuple[Strategy, str]]]


def take_part(
    inputs: EpilogueInputs,
    error: BaseException,
    *,
    spec: EpilogueSpec,
    device: torch.device,
    world_size: int,
    call: int,
    planned_route: PlannedRoute,
    shadow: Optional[Shadow],
    instances: Mapping[str, Strategy],
) -> Optional[str]:
    """This rank's call number `call` failed with `error` before its collective, but its peers are
    already in (or on their way to) the call's collectives. Run the launches and collectives they
    run for the group's T (`planned_route(T)`: the (strategy, variant) the bridge plans for T), on a
    NaN payload, so the group stays in step and the peers get NaN outputs; the shadow strategy runs
    too when the peers sample this call.

    Returns None when the group is in step: this rank took part (then `error` carries a note saying
    so), or there was nothing to take part in (one rank, or T == 0); the caller raises `error`.
    Otherwise returns why this rank could not take part (the `where` of broken_message): T is
    unreadable, T has no route, or taking part failed too; the caller marks its bridge broken."""
    tokens = group_tokens(inputs)
    if world_size == 1 or tokens == 0:
        return None
    route = planned_route(tokens) if tokens is not None else None
    if route is None:
        return (
            "before its collective, and none of its [T, ...] inputs is a 2-D tensor, so it "
            "cannot tell the group's T"
            if tokens is None
            else f"before its collective, and T={tokens} has no route"
        )
    try:
        poison = nan_payload(
            device, spec.dtype, spec.hidden_size, spec.top_k, tokens, spec.has_shared_output
        )
        route[0].call_stage = CallStage.BEFORE_COLLECTIVE
        route[0].run(poison, route[1])
        if shadow is not None and shadow.due():  # the peers sample this call too
            instances[shadow.strategy].run(poison)
    except Exception as exc:  # noqa: BLE001 - reported with the original error
        return f"before its collective; taking part with a NaN payload failed too ({exc!r})"
    add_note(
        error,
        f"fusion_bridge: this rank took part in call {call} with a NaN payload of "
        f"T={tokens}, so its peers got NaN outputs and the next call is in step",
    )
    return None


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


def add_note(error: BaseException, note: str) -> None:
    """Attach `note` to the exception's report where Python supports notes (3.11+)."""
    if hasattr(error, "add_note"):
        error.add_note(note)


def agree_on_call(
    inputs: EpilogueInputs,
    *,
    spec: EpilogueSpec,
    device: torch.device,
    group,
    call: int,
    bridge_index: int,
    route: Callable[[EpilogueInputs, int], tuple[Strategy, str]],
) -> Optional[tuple[Strategy, str]]:
    """Debug mode over several ranks: local checks (index range included) and the route for T
    (`route(inputs, T)`, which may raise), then one small collective on (ok, T, call number `call`
    of bridge `bridge_index`, a fingerprint of the replicated inputs) before the epilogue's
    collectives. If any rank failed, T differs or a rank is on another call, every rank raises the
    same GroupInputError. Returns the (strategy, variant) to run, or None when T == 0 (nothing to
    run, on every rank)."""
    tokens = group_tokens(inputs)
    error, planned = None, None
    try:
        validate_inputs(spec, inputs, device)
        validate_index_values(inputs)
        if tokens:
            planned = route(inputs, tokens)
    except Exception as exc:  # noqa: BLE001 - every rank learns it below
        error = exc
    rank_agreement.agree_call(
        error is None,
        -1 if tokens is None else tokens,
        None if error is None else f"{type(error).__name__}: {error}",
        group,
        collective_device(group, device),
        call=call,
        bridge=bridge_index,
        fingerprint=replicated_fingerprint(inputs) if error is None else (0, 0, 0),
    )
    return planned if tokens else None


def replicated_fingerprint(inputs: EpilogueInputs) -> tuple[int, int, int]:
    """A checksum of each input every rank of the TP group holds identical (residual, index map,
    expert weights: rank_agreement.REPLICATED), for debug mode: ranks whose fingerprints differ are
    not on the same step, and the message says which input differs. Reads every byte (a sync and
    a pass over [T, H]): debug mode only."""
    out = []
    for t in (inputs.residual, inputs.expanded_idx_to_permuted_idx, inputs.expert_weights):
        raw = t.contiguous().view(torch.uint8).reshape(-1).to(torch.int64)
        weights = torch.arange(raw.numel(), device=raw.device, dtype=torch.int64) % 65521 + 1
        out.append(int((raw * weights).sum()) % (1 << 61))
    return tuple(out)
