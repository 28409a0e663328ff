"""Debug mode's agreement on each call of a bridge: before the epilogue's collectives, one small
all-gather of (ok, T, call number, bridge, the replicated inputs' fingerprint and its previous one)
on which every rank decides together that the call runs, or raises the same GroupInputError
(naming each failing rank's reason, T per rank, or which rank is a call behind). The build's
agreements (settings, the plan, the admission flags) are in agreement.py.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from fusion_bridge.epilogue_tensors import EpilogueInputError
from fusion_bridge.ranks.agreement import MAX_REASON_CHARS
from fusion_bridge.ranks.process_group import collective_device, ranks_text, world_size

_CPU = torch.device("cpu")


class GroupInputError(EpilogueInputError):
    """Debug mode: some rank's call failed its checks, or T differs across ranks; raised on every
    rank with the same message. `failed` maps each failing rank to its reason; `tokens` is T per
    rank (-1 where that rank could not tell)."""

    def __init__(self, message: str, failed: dict[int, str], tokens: list[int]) -> None:
        super().__init__(message)
        self.failed, self.tokens = failed, tokens


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
