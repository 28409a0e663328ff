"""Selection as a pure function: (strategy statuses, spec, request, measurements) -> Plan.

No torch.distributed, no GPU: the bridge gathers rank-agreed statuses first, then calls `select`.
Golden tests call it with hand-built statuses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Optional

from .buckets import bucket_bounds, bucket_index, bucket_ranges, tokens_text
from .spec import EpilogueSpec
from .strategies.base import DEFAULT_VARIANT
from .strategy_status import StrategyStatus

AUTO = "auto"

#: The rule of a measured plan: a bucket keeps the static-order choice (the first fitting strategy,
#: its default variant) unless a measured alternative is faster by more than the measured spread,
#: so neighbouring buckets do not flip on noise. The spread comes from the table (`tune` times
#: every case twice and records it); measurements without one use DEFAULT_MARGIN: the median
#: run-to-run spread of the same code per token bucket (max - min over 3 runs, relative to the
#: median), 3.1%, in benchmarks/results/ab_auto_restructure_h200_tp2.jsonl (2x H200).
DEFAULT_MARGIN = 0.031
DEFAULT_MARGIN_SOURCE = (
    "the run-to-run spread of the same code on 2x H200 "
    "(benchmarks/results/ab_auto_restructure_h200_tp2.jsonl; the measurements record none)"
)


@dataclass(frozen=True)
class Margin:
    """How much faster (a fraction) a measured route must be to replace the static-order choice,
    and where that number comes from."""

    fraction: float = DEFAULT_MARGIN
    source: str = DEFAULT_MARGIN_SOURCE

    def to_dict(self) -> dict:
        return {"fraction": self.fraction, "source": self.source}


class NoStrategyAvailable(RuntimeError):
    """Raised when the requested strategy (or, under auto, every strategy) cannot run; lists all
    reasons."""

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
    """Every registered strategy's status from its static checks alone (no prepare, no
    self-test)."""
    from .registry import strategy_classes

    return [
        StrategyStatus.of(c, spec, env, c.not_supported_reasons(spec, env))
        for c in strategy_classes()
    ]


@dataclass(frozen=True)
class Plan:
    """The whole decision: a (strategy, variant) route per token bucket, and the route above
    max_tokens.
    Identical on every rank (built from rank-agreed statuses and rank-0's measurements)."""

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
        (eager=True;
        the same unless the plan is mode-dependent); None when T > max_tokens has no route."""
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
    note. T above
    spec.max_tokens goes to the first candidate without a per-call limit, or raises. What the plan
    names is what runs: no strategy overrides it.
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
        picks = [_choose(i, rng, [st], measured, margin.fraction) for i, rng in enumerate(ranges)]
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
        picks.append(_choose(i, (low, high), fits, measured, margin.fraction))
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


@dataclass(frozen=True)
class _Pick:
    us: Optional[float]
    strategy: str
    variant: str
    timed: tuple[tuple[str, str, float], ...]  # every measured candidate, fastest first
    why: str


def _choose(
    bucket: int,
    tokens: tuple[int, int],
    fits: list[StrategyStatus],
    measured: Measurements,
    margin: float,
) -> _Pick:
    """The bucket's route under the rule (see DEFAULT_MARGIN): the static-order choice (the first
    fitting strategy, its default variant) unless a measured (strategy, variant) that can take every
    T of the bucket, timed at its largest T, is faster than it by more than `margin`."""
    low, bound = tokens
    timed = sorted(
        (per[bound], order, s.name, v)
        for order, s in enumerate(fits)
        for v, per in measured.get(s.name, {}).items()
        if bound in per and v in s.variants_for(low, bound)
    )
    listing = tuple((name, v, us) for us, _, name, v in timed)
    static = (fits[0].name, fits[0].variant_for(bucket))
    if not timed:
        return _Pick(None, *static, listing, "static order (unmeasured)")
    best_us, _, best, variant = timed[0]
    static_us = next((us for name, v, us in listing if (name, v) == static), None)
    if static_us is None:
        why = f"fastest measured (the static-order choice {_label(*static)} was not measured)"
        return _Pick(best_us, best, variant, listing, why)
    if (best, variant) == static:
        return _Pick(best_us, best, variant, listing, "static order, and fastest measured")
    gain = 1.0 - best_us / static_us
    if gain > margin:
        why = (
            f"measured {gain:.1%} faster than the static-order choice {_label(*static)} "
            f"(more than the {margin:.1%} margin)"
        )
        return _Pick(best_us, best, variant, listing, why)
    why = (
        f"static order kept: {_label(best, variant)} is only {gain:.1%} faster "
        f"(within the {margin:.1%} margin)"
    )
    return _Pick(static_us, *static, listing, why)


def _label(strategy: str, variant: str) -> str:
    return strategy if variant == DEFAULT_VARIANT else f"{strategy}:{variant}"


def _known_measurements(
    measured: Measurements, by_name: Mapping[str, StrategyStatus]
) -> tuple[dict[str, dict[str, Mapping[int, float]]], list[str]]:
    """The measurements of registered strategies and their declared variants; a note for the
    rest."""
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
    T,
    so one launch can beat two there even when two win under graphs. Both are pure functions."""
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
