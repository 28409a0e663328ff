"""The rule that picks a token bucket's route from measurements: keep the static-order choice
unless a measured alternative is faster by more than the measured spread, so neighbouring buckets do
not flip on noise. A pure function of the bucket's candidates and their times (planner.select calls
it per bucket).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from fusion_bridge.strategies.base import DEFAULT_VARIANT
from fusion_bridge.plan.status import StrategyStatus

Measurements = Mapping[str, Mapping[str, Mapping[int, float]]]  # strategy -> variant -> T -> us

#: The rule of a measured plan: a bucket keeps the static-order choice (the first fitting strategy,
#: its default variant) unless a measured alternative is faster by more than the measured spread,
#: so neighbouring buckets do not flip on noise. The spread comes from the table (`tune` times
#: every case twice and records it); measurements without one use DEFAULT_MARGIN: the median
#: run-to-run spread of the same code per token bucket (max - min over 3 runs, relative to the
#: median) in benchmarks/results/ab_auto_restructure_h200_tp2.jsonl (2x H200;
#: docs/performance.md#the-selection-restructure).
DEFAULT_MARGIN = 0.031
DEFAULT_MARGIN_SOURCE = (
    "default: run-to-run spread on 2x H200, benchmarks/results/ab_auto_restructure_h200_tp2.jsonl"
)


@dataclass(frozen=True)
class Margin:
    """How much faster (a fraction) a measured route must be to replace the static-order choice,
    and where that number comes from."""

    fraction: float = DEFAULT_MARGIN
    source: str = DEFAULT_MARGIN_SOURCE

    def to_dict(self) -> dict:
        return {"fraction": self.fraction, "source": self.source}


@dataclass(frozen=True)
class _Pick:
    us: Optional[float]
    strategy: str
    variant: str
    timed: tuple[tuple[str, str, float], ...]  # every measured candidate, fastest first
    why: str


def choose(
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
