"""Selection as a pure function: (strategy statuses, spec, request, measurements) -> Plan.

No torch.distributed, no GPU: the bridge gathers rank-agreed statuses first, then calls `select`.
Golden tests call it with hand-built statuses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Optional

from fusion_bridge.reasons import excluded_by_request
from fusion_bridge.plan.buckets import bucket_bounds, bucket_index, bucket_ranges, tokens_text
from fusion_bridge.plan.rule import DEFAULT_MARGIN, Margin, choose  # noqa: F401 (DEFAULT_MARGIN re-exported)
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.strategies.base import DEFAULT_VARIANT
from fusion_bridge.plan.status import StrategyStatus

AUTO = "auto"


class NoStrategyAvailable(RuntimeError):
    """Raised when the requested strategy (or, under auto, every strategy) cannot run; lists
    all reasons."""

    def __init__(self, requested: str, statuses: list[StrategyStatus]) -> None:
        self.requested, self.statuses = requested, statuses
        lines = [f"fusion_bridge: strategy {requested!r} cannot run:"]
        for st in statuses:
            if st.available and not st.auto_selectable and requested == AUTO:
                lines.append(
                    f"  {st.name}: available but "
                    + ("opt-in (request it by name)" if st.opt_in else "never auto-selected")
                )
            for r in st.reasons:
                lines.append(
                    f"  {st.name}: [{r.code}] {r.message}" + (f" -- {r.hint}" if r.hint else "")
                )
        super().__init__("\n".join(lines))


def static_statuses(spec: EpilogueSpec, env) -> list[StrategyStatus]:
    """Every registered strategy's status from its static checks alone (no prepare,
    no self-test)."""
    from fusion_bridge.registry import strategy_classes

    return [
        StrategyStatus.of(c, spec, env, c.not_supported_reasons(spec, env))
        for c in strategy_classes()
    ]


def check_exclusions(names, known: list[str], requested: str, source: str) -> tuple[str, ...]:
    """The strategies to keep out of auto, validated: a list of registered names (not the oracle
    `reference`, which the self-test needs, nor a strategy requested by name). Sorted, no
    duplicates: every rank compares them at build."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{source} must be a list of strategy names, got {names!r}")
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"{source} names unknown strategies {unknown}; known: {known}")
    if "reference" in names:
        raise ValueError(f"{source} cannot exclude 'reference': it is the self-test's oracle")
    if requested in names:
        raise ValueError(f"{source} excludes {requested!r}, which is requested by name")
    return tuple(sorted(set(names)))


def exclude(statuses: list[StrategyStatus], names, source: str) -> list[StrategyStatus]:
    """`statuses` with each strategy in `names` marked excluded by request (so auto never picks it
    and the report says why)."""
    return [
        dataclasses.replace(s, reasons=s.reasons + (excluded_by_request(s.name, source),))
        if s.name in names
        else s
        for s in statuses
    ]


@dataclass(frozen=True)
class Plan:
    """The whole decision: a (strategy, variant) route per token bucket, and the route above
    max_tokens. Identical on every rank (built from rank-agreed statuses and
    rank-0's measurements)."""

    requested: str
    bounds: tuple[int, ...]
    choice: tuple[str, ...]  # strategy per bucket
    variants: tuple[str, ...]  # launch variant per bucket
    overflow: Optional[str]  # strategy for T > max_tokens, None -> error
    overflow_variant: str = DEFAULT_VARIANT
    measured_us: tuple[Optional[float], ...] = ()
    source: str = "static order"  # or "measured", "requested"
    notes: tuple[str, ...] = field(default=())
    #: the plan for eager calls (outside CUDA-graph capture), where host cost can change the winner;
    #: empty = the same as the graph plan above
    eager_choice: tuple[str, ...] = ()
    eager_variants: tuple[str, ...] = ()
    eager_measured_us: tuple[Optional[float], ...] = ()
    #: per bucket, every measured (strategy, variant, us) that could take it, fastest first
    candidates: tuple[tuple[tuple[str, str, float], ...], ...] = ()
    why: tuple[str, ...] = ()  # per bucket, why its route was chosen
    margin: Optional[Margin] = None  # the rule's margin, when measurements were used

    @property
    def mode_dependent(self) -> bool:
        return bool(self.eager_choice) and (self.eager_choice, self.eager_variants) != (
            self.choice,
            self.variants,
        )

    def route_for(self, tokens: int, eager: bool = False) -> Optional[tuple[str, str]]:
        """(strategy, variant) for T tokens (T >= 1) under CUDA graphs, or for an eager call
        (eager=True; the same unless the plan is mode-dependent); None when T > max_tokens
        has no route."""
        i = bucket_index(tokens)
        if i < len(self.choice):
            if eager and self.mode_dependent:
                return self.eager_choice[i], self.eager_variants[i]
            return self.choice[i], self.variants[i]
        return (self.overflow, self.overflow_variant) if self.overflow else None

    def strategy_for(self, tokens: int) -> Optional[str]:
        route = self.route_for(tokens)
        return route[0] if route else None

    def to_dict(self) -> dict:
        return {
            "requested": self.requested,
            "source": self.source,
            "overflow": self.overflow,
            "overflow_variant": self.overflow_variant,
            "buckets": [
                {
                    "max_tokens": b,
                    "strategy": s,
                    "variant": v,
                    "measured_us": self.measured_us[i] if i < len(self.measured_us) else None,
                    "why": self.why[i] if i < len(self.why) else None,
                    "candidates": _candidates_dict(
                        self.candidates[i] if i < len(self.candidates) else (), s, v
                    ),
                }
                for i, (b, s, v) in enumerate(zip(self.bounds, self.choice, self.variants))
            ],
            "margin": self.margin.to_dict() if self.margin else None,
            "notes": list(self.notes),
            "eager_buckets": [
                {
                    "max_tokens": b,
                    "strategy": s,
                    "variant": v,
                    "wall_us": self.eager_measured_us[i]
                    if i < len(self.eager_measured_us)
                    else None,
                }
                for i, (b, s, v) in enumerate(
                    zip(self.bounds, self.eager_choice, self.eager_variants)
                )
            ],
        }


def _candidates_dict(timed, strategy: str, variant: str) -> list[dict]:
    """Each measured candidate with its time and how far it is behind the chosen route."""
    chosen = next((us for s, v, us in timed if (s, v) == (strategy, variant)), None)
    return [
        {
            "strategy": s,
            "variant": v,
            "measured_us": us,
            "vs_chosen_pct": None if chosen is None else round(100.0 * (us / chosen - 1.0), 1),
        }
        for s, v, us in timed
    ]


Measurements = Mapping[
    str, Mapping[str, Mapping[int, float]]
]  # strategy -> variant -> bucket bound -> us


def select(
    statuses: list[StrategyStatus],
    spec: EpilogueSpec,
    requested: str = AUTO,
    measured_us: Optional[Measurements] = None,
    margin: Optional[Margin] = None,
) -> Plan:
    """Pick a (strategy, variant) per token bucket.

    requested: "auto" or a strategy name. An explicit name that cannot run raises
    NoStrategyAvailable with its reasons; it never falls back. Under auto, among available
    auto-selectable strategies with a variant that can take every T of the bucket
    (max_tokens_per_call and variant_tokens), the first in the static order (the order of
    `statuses`) with its default variant is chosen, unless a measured (strategy, variant) is faster
    than it by more than `margin` (default: Margin(), see DEFAULT_MARGIN); then the fastest wins.
    A requested strategy follows the same rule among its variants. Measurements naming a strategy
    or variant that is not registered, or a token count the variant cannot take, are ignored, with a
    note. T above spec.max_tokens goes to the first candidate without a per-call limit, or raises.
    What the plan names is what runs: no strategy overrides it.
    """
    by_name = {s.name: s for s in statuses}
    bounds = bucket_bounds(spec.max_tokens)
    ranges = bucket_ranges(spec.max_tokens)
    measured, notes = _known_measurements(measured_us or {}, by_name)
    margin = margin or Margin()
    if requested != AUTO:
        if requested not in by_name:
            raise ValueError(
                f"strategy must be 'auto' or one of {list(by_name)}, got {requested!r}"
            )
        st = by_name[requested]
        if not st.available:
            raise NoStrategyAvailable(requested, [st])
        picks = [choose(i, rng, [st], measured, margin.fraction) for i, rng in enumerate(ranges)]
        overflow = requested if st.max_tokens_per_call is None else None
        return Plan(
            requested,
            bounds,
            tuple(requested for _ in bounds),
            tuple(p.variant for p in picks),
            overflow,
            st.overflow_variant,
            tuple(p.us for p in picks),
            "requested",
            tuple(notes),
            candidates=tuple(p.timed for p in picks),
            why=tuple(p.why for p in picks),
            margin=margin if measured else None,
        )

    candidates = [s for s in statuses if s.available and s.auto_selectable]
    if not candidates:
        raise NoStrategyAvailable(AUTO, statuses)
    picks = []
    for i, (low, high) in enumerate(ranges):
        fits = [s for s in candidates if s.variants_for(low, high)]
        if not fits:
            raise NoStrategyAvailable(AUTO, statuses)
        picks.append(choose(i, (low, high), fits, measured, margin.fraction))
    times = [p.us for p in picks]
    unlimited = [s for s in candidates if s.max_tokens_per_call is None]
    overflow = unlimited[0] if unlimited else None
    if overflow is None:
        notes.append(
            f"T > max_tokens={spec.max_tokens} raises: every candidate has a per-call token limit"
        )
    source = "measured" if any(t is not None for t in times) else "static order"
    return Plan(
        AUTO,
        bounds,
        tuple(p.strategy for p in picks),
        tuple(p.variant for p in picks),
        overflow.name if overflow else None,
        overflow.overflow_variant if overflow else DEFAULT_VARIANT,
        tuple(times),
        source,
        tuple(notes),
        candidates=tuple(p.timed for p in picks),
        why=tuple(p.why for p in picks),
        margin=margin if source == "measured" else None,
    )


def _known_measurements(
    measured: Measurements, by_name: Mapping[str, StrategyStatus]
) -> tuple[dict[str, dict[str, Mapping[int, float]]], list[str]]:
    """The measurements of registered strategies and their declared variants; a note
    for the rest."""
    known: dict[str, dict[str, Mapping[int, float]]] = {}
    notes = []
    for name, per_variant in measured.items():
        if name not in by_name:
            notes.append(
                f"measurements for unknown strategy {name!r} ignored (not registered here)"
            )
            continue
        for variant, per in per_variant.items():
            if variant not in by_name[name].variants:
                notes.append(
                    f"measurements for unknown variant {name}:{variant} ignored "
                    f"(declared: {', '.join(by_name[name].variants)})"
                )
                continue
            low, high = by_name[name].declared_range(variant)
            outside = sorted(t for t in per if t < low or (high is not None and t > high))
            if outside:
                notes.append(
                    f"measurements for {name}:{variant} at T={outside} ignored (it takes "
                    f"{tokens_text(low, high)})"
                )
                per = {t: us for t, us in per.items() if t not in outside}
            known.setdefault(name, {})[variant] = per
    return known, notes


def select_for_modes(
    statuses: list[StrategyStatus],
    spec: EpilogueSpec,
    requested: str = AUTO,
    measured_us: Optional[Measurements] = None,
    eager_us: Optional[Measurements] = None,
    margin: Optional[Margin] = None,
) -> Plan:
    """The graph plan from CUDA-graph times (`measured_us`) and, when eager wall times per call were
    measured on this host (`eager_us`), an eager plan from them: eager calls are host-bound at small
    T, so one launch can beat two there even when two win under graphs. Both are pure functions."""
    plan = select(statuses, spec, requested, measured_us, margin)
    if not eager_us:
        return plan
    eager = select(statuses, spec, requested, eager_us, margin)
    # a bucket without an eager time keeps the graph plan's measured route, not the static order
    keep = [t is None for t in eager.measured_us]
    eager = dataclasses.replace(
        eager,
        choice=tuple(g if k else e for g, e, k in zip(plan.choice, eager.choice, keep)),
        variants=tuple(g if k else e for g, e, k in zip(plan.variants, eager.variants, keep)),
    )
    differ = [
        f"T<={b}: {s}:{v}"
        for b, s, v, gs, gv in zip(
            plan.bounds, eager.choice, eager.variants, plan.choice, plan.variants
        )
        if (s, v) != (gs, gv)
    ]
    notes = plan.notes + tuple(n for n in eager.notes if n not in plan.notes)
    if differ:
        notes += (
            "eager calls (measured wall time on this host) take another route: "
            + ", ".join(differ),
        )
    return dataclasses.replace(
        plan,
        notes=notes,
        eager_choice=eager.choice,
        eager_variants=eager.variants,
        eager_measured_us=eager.measured_us,
    )
