"""Rank agreement at build: the collectives that make the ranks of a TP group agree before they
act: agree on settings (and the plan), AND the admission flags. The check-in that comes before
them (no collective) is in check_in.py; debug mode's agreement on each call in call_agreement.py.

Building a bridge and calling it are collective. When ranks disagree (one rank never builds, one
rank has another spec or environment override, one rank's call fails validation) the collectives
either hang or pair calls that do not belong together and return wrong values. These pieces turn
each such case into the same clear error on every rank:

  check_in(group)            (check_in.py) before any collective of a build: every rank
                             arrives, within a timeout (the process group's store, set/wait: no
                             collective, so it cannot hang)
  agree_on_settings(d, group) all-gather a dict of plain values and compare it field by field
  agree_flags(flags, group)  admission: elementwise AND of one 0/1 flag per strategy
  agree_call(ok, T, ...)     (call_agreement.py) debug mode, per call: one small all-gather

Each is a plain function of its arguments and the process group; none knows about the bridge.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from fusion_bridge.ranks.process_group import group_active, ranks_text, world_size
from fusion_bridge.reasons import Reason

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
