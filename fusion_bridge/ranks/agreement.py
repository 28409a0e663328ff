"""Rank agreement: every collective that makes the ranks of a TP group agree before they act:
agree on settings (and the plan), AND the admission flags, agree on each debug call. The check-in
that comes before them (no collective) is in check_in.py.

Building a bridge and calling it are collective. When ranks disagree (one rank never builds, one
rank has another spec or environment override, one rank's call fails validation) the collectives
either hang or pair calls that do not belong together and return wrong values. These pieces turn
each such case into the same clear error on every rank:

  check_in(group)            (check_in.py) before any collective of a build: every rank
                             arrives, within a timeout (the process group's store, set/wait: no
                             collective, so it cannot hang)
  agree_on_settings(d, group) all-gather a dict of plain values and compare it field by field
  agree_flags(flags, group)  admission: elementwise AND of one 0/1 flag per strategy
  agree_call(ok, T, ...)     debug mode, per call: one small all-gather of (ok flag, T)

Each is a plain function of its arguments and the process group; none knows about the bridge.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from fusion_bridge.ranks.process_group import (
    collective_device,
    group_active,
    ranks_text,
    world_size,
)
from fusion_bridge.reasons import Reason
from fusion_bridge.epilogue_tensors import EpilogueInputError

MAX_FIELDS_SHOWN = 20  # a mismatch lists at most this many fields, then says how many more
MAX_REASON_CHARS = 500  # a failing rank's reason, as shared with its peers


class RankAgreementError(RuntimeError):
    """The ranks of a process group are not doing the same thing, so the collective
    work cannot go on.

    Raised on every rank that can still tell (a rank that never arrived cannot), with one message
    that names the group size and the ranks involved: for a check-in, the ranks that did not arrive
    in time (`missing_ranks`); for settings, each differing field with every rank's value (`fields`:
    field -> list of per-rank values). Nothing collective ran after the disagreement was found; the
    fix is on the caller's side (same spec, same environment, same build order on every rank).
    """

    def __init__(
        self,
        message: str,
        *,
        missing_ranks: tuple[int, ...] = (),
        fields: Optional[dict[str, list]] = None,
    ) -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks
        self.fields = fields or {}


class GroupInputError(EpilogueInputError):
    """Debug mode: some rank's call failed its checks, or T differs across ranks; raised on every
    rank with the same message. `failed` maps each failing rank to its reason; `tokens` is T per
    rank (-1 where that rank could not tell)."""

    def __init__(self, message: str, failed: dict[int, str], tokens: list[int]) -> None:
        super().__init__(message)
        self.failed, self.tokens = failed, tokens


_CPU = torch.device("cpu")


# ---------------------------------------------------------------- admission flags
def agree_flags(flags: list[int], group, device: torch.device) -> list[int]:
    """Elementwise AND of 0/1 flags across the ranks of `group`: one all-reduce MIN over an int
    tensor with one slot per flag (MIN of packed bitmasks is not AND). Collective; the identity
    without a group or in a group of one."""
    if not flags or not group_active(group) or dist.get_world_size(group) == 1:
        return list(flags)
    t = torch.tensor(flags, dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t.tolist()]


def other_rank_reason(stage: str) -> Reason:
    """Why a strategy that passed every check on this rank is off: another rank failed `stage`."""
    return Reason(
        "unavailable_on_another_rank",
        f"another rank of the group cannot run this strategy ({stage}); every rank must pick "
        "the same plan, so it is off on all ranks",
        "run `python -m fusion_bridge info` on each rank to see which one and why",
    )


# ---------------------------------------------------------------- settings
def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    """Nested dicts and lists -> {'a.b': leaf, 'a.c[0]': leaf}; a leaf is anything else."""
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, (list, tuple)) and value:
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}[{i}]", out)
    else:
        out[prefix] = value
    return out


_ABSENT = object()


def _same(a: Any, b: Any) -> bool:
    """Leaf equality: NaN equals NaN, 2 equals 2.0, True is not 1, '1' is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or (
            isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
        )
    return type(a) is type(b) and a == b


def differing_fields(per_rank: list[dict]) -> dict[str, list]:
    """The leaves (dotted names) whose value is not the same on every rank: name -> per-rank values
    (a rank that lacks the field shows '<absent>'). Pure: the comparison agree_on_settings makes."""
    flat = [_flatten(d, "", {}) for d in per_rank]
    names = list(dict.fromkeys(k for f in flat for k in f))
    out = {}
    for name in names:
        values = [f.get(name, _ABSENT) for f in flat]
        if not all(_same(values[0], v) for v in values[1:]):
            out[name] = ["<absent>" if v is _ABSENT else v for v in values]
    return out


def _describe_values(values: list, group) -> str:
    """ "'bf16' on ranks 0, 2; 'fp16' on rank 1": every rank's value, grouped."""
    groups: list[tuple[Any, list[int]]] = []
    for rank, v in enumerate(values):
        for seen, ranks in groups:
            if _same(seen, v):
                ranks.append(rank)
                break
        else:
            groups.append((v, [rank]))
    return "; ".join(
        f"{v!r} on rank{'s' if len(r) > 1 else ''} {ranks_text(r, group)}" for v, r in groups
    )


SAME_BUILD_HINT = (
    "Every rank must build the bridge with the same arguments and environment variables."
)


def agree_on_settings(
    settings: dict, group=None, *, what: str = "settings", hint: str = SAME_BUILD_HINT
) -> list[dict]:
    """Check that `settings` is the same on every rank of `group`; return every rank's settings.

    settings: plain JSON-able values, nested dicts and lists allowed (compared leaf by leaf, so an
    error names e.g. `spec.quant.scale` or `strategy_by_bucket.T<=64`). Collective: one
    all_gather_object; every rank must call it, with its own values. A single process returns
    [settings]. `what` names the thing compared in the message ("settings", "the plan"); `hint`, the
    message's last line, says what to fix.

    Raises RankAgreementError on every rank, with the same message, naming each differing field and
    every rank's value (at most MAX_FIELDS_SHOWN fields, then a count).
    """
    world = world_size(group)
    if world == 1:
        return [settings]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, settings, group=group)
    diff = differing_fields(gathered)
    if diff:
        lines = [
            f"  {name}: {_describe_values(values, group)}"
            for name, values in list(diff.items())[:MAX_FIELDS_SHOWN]
        ]
        if len(diff) > MAX_FIELDS_SHOWN:
            lines.append(f"  ... and {len(diff) - MAX_FIELDS_SHOWN} more")
        raise RankAgreementError(
            f"the {world} ranks of the group disagree on {what} ({len(diff)} field"
            f"{'s' if len(diff) > 1 else ''} that must be equal on every rank):\n"
            + "\n".join(lines)
            + f"\n{hint}",
            fields=diff,
        )
    return gathered


def gather_reasons(reason: Optional[str], group) -> dict[int, str]:
    """{rank: its reason} for every rank of `group` whose `reason` is not None (each cut to
    MAX_REASON_CHARS). Collective: one all_gather_object; every rank calls it, with or without a
    reason of its own."""
    gathered: list = [None] * world_size(group)
    mine = None if reason is None else reason[:MAX_REASON_CHARS]
    dist.all_gather_object(gathered, mine, group=group)
    return {r: text for r, text in enumerate(gathered) if text is not None}


def plan_settings(plan) -> dict:
    """The part of a plan that decides which collectives a call runs, as plain values for
    agree_on_settings(..., what="the plan"): the (strategy, launch variant) per token bucket and the
    overflow route. `plan` needs `bounds`, `choice`, `variants`, `overflow` and `overflow_variant`;
    measured times are left out (they may differ per rank without changing what runs)."""
    out = {
        "route_by_bucket": {
            f"T<={b}": f"{s}:{v}" for b, s, v in zip(plan.bounds, plan.choice, plan.variants)
        },
        "overflow": f"{plan.overflow}:{plan.overflow_variant}" if plan.overflow else None,
    }
    eager = tuple(getattr(plan, "eager_choice", ()))
    if eager:
        out["eager_route_by_bucket"] = {
            f"T<={b}": f"{s}:{v}" for b, s, v in zip(plan.bounds, eager, plan.eager_variants)
        }
    return out


# ---------------------------------------------------------------- per call (debug mode)
def agree_call(
    ok: bool,
    tokens: int,
    error: Optional[str],
    group=None,
    device: torch.device = _CPU,
    *,
    call: int = 0,
    bridge: int = 0,
    fingerprint: Sequence[int] = (0, 0),
    previous: Sequence[int] = (0, 0),
    progress: Optional[list] = None,
) -> int:
    """Debug mode: agree, before the epilogue's collectives, that every rank's call is good and has
    the same T and is on the same call of the bridge (`call`, counted per bridge).
    Returns T when so.

    ok: this rank's local checks passed. tokens: this rank's T (-1 when it could not be read).
    error: this rank's reason when not ok. device: the bridge's device (the flags travel on the GPU
    for NCCL, on the CPU for gloo). call / bridge: this rank's call number of bridge number
    `bridge`. fingerprint: a checksum of each input every rank must hold identical at this step
    (REPLICATED: residual, expert weights; 0: none, e.g. this rank's checks failed); previous: this
    rank's fingerprint at its previous call of the bridge, so a rank whose step is a peer's
    previous one is named as behind. Collective: one all_gather of 8 int64 per rank; only when
    some rank failed, one all_gather_object of the reasons. Every rank must call it once per call,
    whatever its own checks said. progress: a one-element list this sets to "in" just before the
    all_gather and to the gathered rows right after it, so a caller interrupted anywhere in here
    can tell (`agreed_outcome`) whether its peers went on to the epilogue.

    Raises GroupInputError (an EpilogueInputError) on every rank with the same message when any rank
    failed (naming each failing rank and its reason) or T differs (naming T on each rank).
    """
    world = world_size(group)
    if world == 1:
        if not ok:
            raise _call_error({0: error or "no reason given"}, [tokens], group)
        return tokens
    prints_mine, previous_mine = [int(f) for f in fingerprint], [int(f) for f in previous]
    for what, values in (("fingerprint", prints_mine), ("previous", previous_mine)):
        if len(values) != len(REPLICATED):
            raise ValueError(
                f"agree_call: {what} must hold {len(REPLICATED)} checksums (one per "
                f"{', '.join(REPLICATED)}), got {len(values)}"
            )
    flags = torch.tensor(
        [int(bool(ok)), int(tokens), int(call), int(bridge), *prints_mine, *previous_mine],
        dtype=torch.int64,
        device=collective_device(group, torch.device(device)),
    )
    gathered = [torch.empty_like(flags) for _ in range(world)]
    progress = [None] if progress is None else progress
    progress[0] = "in"
    dist.all_gather(gathered, flags, group=group)
    progress[0] = gathered  # a plain store right after the return: no interrupt lands between
    table = torch.stack(gathered).tolist()  # one device-to-host copy
    oks, token_counts = [bool(row[0]) for row in table], [int(row[1]) for row in table]
    calls = [(int(row[3]), int(row[2])) for row in table]  # (bridge, call number)
    n = len(REPLICATED)
    prints = [tuple(int(v) for v in row[4 : 4 + n]) for row in table]
    previous_prints = [tuple(int(v) for v in row[4 + n : 4 + 2 * n]) for row in table]
    same_t = len(set(token_counts)) == 1  # else the T message below says more
    if all(oks) and same_t and (len(set(calls)) > 1 or len(set(prints)) > 1):
        # A rank skipped a call or made an extra one (its calls would pair with the peers' other
        # calls from here on), or the ranks were fed different inputs. The replicated inputs tell
        # steps apart where call numbers cannot (a rank that skipped one call of a bridge is on the
        # same count at its next one).
        raise GroupInputError(_out_of_step(calls, prints, previous_prints, group), {}, token_counts)
    if all(oks) and len(set(token_counts)) == 1:
        return token_counts[0]
    failed: dict[int, str] = {}
    if not all(oks):  # every rank sees the same flags, so every rank takes this path together
        reasons: list = [None] * world
        mine = None if ok else (error or "no reason given")[:MAX_REASON_CHARS]
        progress[0] = "in"
        dist.all_gather_object(reasons, mine, group=group)
        progress[0] = "raises"
        failed = {r: reasons[r] for r in range(world) if not oks[r]}
    raise _call_error(failed, token_counts, group)


def agreed_outcome(progress: list) -> Optional[str]:
    """What agree_call's `progress` says every rank does next: None (its all_gather not begun),
    "in" (a collective begun; whether it finished cannot be told), "runs" (every rank goes on to
    the epilogue), "reasons" (the peers wait in the all_gather of the failing ranks' reasons:
    join it with `join_reasons`) or "raises" (every rank raises GroupInputError, nothing pending).
    The same test as agree_call's own."""
    if progress[0] is None or isinstance(progress[0], str):
        return progress[0]
    table = torch.stack(progress[0]).tolist()
    n = len(REPLICATED)
    keys = {(int(row[1]), int(row[2]), int(row[3]), *row[4 : 4 + n]) for row in table}
    if not all(row[0] for row in table):
        return "reasons"
    return "runs" if len(keys) == 1 else "raises"


def join_reasons(error: Optional[str], group) -> None:
    """Take part in agree_call's all_gather of reasons (its peers found a failing rank) on behalf
    of a rank interrupted before it did; `error`: this rank's reason, when it is one of them."""
    reasons: list = [None] * world_size(group)
    dist.all_gather_object(
        reasons, None if error is None else error[:MAX_REASON_CHARS], group=group
    )


#: what every rank of the group passes identical at each step, in the order of the fingerprint. The
#: index map is not among them: it is per rank in an expert-parallel layout (the Hugging Face
#: patch's: -1 for the slots another rank's experts hold).
REPLICATED = ("residual", "expert weights")


def _out_of_step(
    calls: list[tuple[int, int]],
    prints: list[tuple[int, ...]],
    previous: list[tuple[int, ...]],
    group,
) -> str:
    """Debug mode's message when the ranks' calls do not belong together: their call numbers
    differ (say which), or the numbers agree and their replicated inputs differ (say which inputs,
    on which ranks); and each rank whose inputs are the ones a peer passed at its previous call is
    named as one call behind that peer."""
    if len(set(calls)) > 1:
        head = "the ranks of the group are on different calls: " + ", ".join(
            f"bridge {b} call {c} on rank {r}" for r, (b, c) in enumerate(calls)
        )
    else:
        b, c = calls[0]
        head = f"the ranks of the group are on the same call (bridge {b} call {c})"
    differ = []
    for i, name in enumerate(REPLICATED):
        others = [r for r in range(1, len(prints)) if prints[r][i] != prints[0][i]]
        if others:
            differ.append(
                f"the {name} {'differ' if name.endswith('s') else 'differs'} on "
                f"rank{'s' if len(others) > 1 else ''} "
                + (", ".join(map(str, others)))
                + " from rank 0"
            )
    if differ:
        head += (
            "; also " if len(set(calls)) > 1 else " but with different replicated inputs: "
        ) + "; ".join(differ)
    return (
        "finalize_epilogue (debug mode): "
        + head
        + _behind_text(prints, previous, group)
        + ". Every rank must call every bridge the same number of times, in the same order, with "
        "the same residual and expert weights (in a model: every rank runs the same forward on "
        "the same inputs, e.g. the same prompt); ranks fed different inputs, or a rank that "
        "skipped a call or made an extra one, get here. None of the epilogue's collectives ran "
        "for this call; every rank raises this error. A rank a call apart stays a call apart: "
        "every later call of this bridge raises it too, until every rank rebuilds its bridges "
        "(or the rank behind makes the call it skipped)."
    )


def _behind_text(prints: list[tuple[int, ...]], previous: list[tuple[int, ...]], group) -> str:
    """'; rank 1 is one call behind rank 0 (...)' for each rank whose replicated inputs are the
    ones a peer passed at its previous call; '' when no rank's are."""
    pairs = [
        (r, q)
        for r, p in enumerate(prints)
        for q, before in enumerate(previous)
        if r != q and all(p) and p == before and prints[q] != p
    ]
    return "".join(
        f"; rank {ranks_text([r], group)} is one call behind rank {ranks_text([q], group)} (its "
        f"replicated inputs are the ones rank {ranks_text([q], group)} passed at its previous "
        "call)"
        for r, q in pairs
    )


def _call_error(failed: dict[int, str], token_counts: list[int], group) -> GroupInputError:
    """The one message every rank raises for a failed debug-mode agreement."""
    world, parts = len(token_counts), []
    if failed:
        parts.append(
            f"rank{'s' if len(failed) > 1 else ''} {ranks_text(failed, group)} of the "
            f"{world}-rank group failed the call's checks: "
            + "; ".join(f"rank {r}: {reason}" for r, reason in failed.items())
        )
    known = {t for t in token_counts if t >= 0}
    if len(known) > 1 or not failed:
        parts.append(
            "the token count T must be identical on every rank of the group, got "
            + ", ".join(
                f"{t if t >= 0 else 'unknown'} on rank {r}" for r, t in enumerate(token_counts)
            )
        )
    return GroupInputError(
        "finalize_epilogue (debug mode, agreed on every rank before any collective): "
        + "; and ".join(parts)
        + ". None of the epilogue's collectives ran for this call; "
        "every rank raises this error.",
        failed,
        token_counts,
    )
