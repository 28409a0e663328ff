"""Selection as a pure function: (strategy statuses, spec, request, measurements) -> Plan.

No torch.distributed, no GPU: the bridge gathers rank-agreed statuses first, then calls `select`.
Golden tests call it with hand-built statuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from .reasons import Reason
from .spec import EpilogueSpec
from .strategies.base import Step

AUTO = "auto"


@dataclass(frozen=True)
class StrategyStatus:
    """What the bridge learned about one registered strategy, on every rank alike."""

    name: str
    summary: str
    reasons: tuple[Reason, ...]
    steps: tuple[Step, ...]
    auto_selectable: bool
    max_tokens_per_call: Optional[int]
    error_bound: float
    self_test: str = "not run"            # "passed" | "failed" | "not run"
    self_test_error: Optional[float] = None
    workspace_bytes: int = 0

    @property
    def available(self) -> bool:
        return not self.reasons

    @staticmethod
    def of(cls, spec: EpilogueSpec, env, reasons: list[Reason], self_test: str = "not run",
           self_test_error: Optional[float] = None, workspace_bytes: int = 0,
           steps: Optional[list[Step]] = None) -> "StrategyStatus":
        """The status of strategy class `cls` given the reasons gathered for it (and, once prepared,
        the steps its instance actually runs)."""
        return StrategyStatus(
            name=cls.name, summary=cls.summary, reasons=tuple(reasons),
            steps=tuple(steps if steps is not None else cls.steps(spec, env)),
            auto_selectable=cls.is_auto_selectable(spec, env),
            max_tokens_per_call=cls.max_tokens_per_call(spec, env), error_bound=cls.error_bound(spec, env),
            self_test=self_test, self_test_error=self_test_error, workspace_bytes=workspace_bytes)

    def to_dict(self) -> dict:
        return {
            "name": self.name, "summary": self.summary, "available": self.available,
            "reasons": [r.to_dict() for r in self.reasons], "steps": [s.name for s in self.steps],
            "step_stages": [s.to_dict() for s in self.steps], "auto_selectable": self.auto_selectable,
            "max_tokens_per_call": self.max_tokens_per_call, "error_bound": self.error_bound,
            "self_test": self.self_test, "self_test_error": self.self_test_error,
            "workspace_bytes": self.workspace_bytes,
        }


class NoStrategyAvailable(RuntimeError):
    """Raised when the requested strategy (or, under auto, every strategy) cannot run; lists all reasons."""

    def __init__(self, requested: str, statuses: list[StrategyStatus]) -> None:
        self.requested, self.statuses = requested, statuses
        lines = [f"fusion_bridge: strategy {requested!r} cannot run:"]
        for st in statuses:
            if st.available and not st.auto_selectable and requested == AUTO:
                lines.append(f"  {st.name}: available but never auto-selected")
            for r in st.reasons:
                lines.append(f"  {st.name}: [{r.code}] {r.message}" + (f" -- {r.hint}" if r.hint else ""))
        super().__init__("\n".join(lines))


def static_statuses(spec: EpilogueSpec, env) -> list[StrategyStatus]:
    """Every registered strategy's status from its static checks alone (no prepare, no self-test)."""
    from .registry import strategy_classes
    return [StrategyStatus.of(c, spec, env, c.not_supported_reasons(spec, env)) for c in strategy_classes()]


def bucket_index(tokens: int) -> int:
    """Token buckets are powers of two: bucket i holds 2^(i-1) < T <= 2^i. O(1), no allocation."""
    return (tokens - 1).bit_length()


def bucket_bounds(max_tokens: int) -> tuple[int, ...]:
    """Upper bounds 1, 2, 4, ... of the buckets up to max_tokens (the last one clamped to it)."""
    bounds, b = [], 1
    while b < max_tokens:
        bounds.append(b)
        b *= 2
    bounds.append(max_tokens)
    return tuple(bounds)


@dataclass(frozen=True)
class Plan:
    requested: str
    bounds: tuple[int, ...]
    choice: tuple[str, ...]                 # strategy per bucket
    overflow: Optional[str]                 # strategy for T > max_tokens, None -> error
    measured_us: tuple[Optional[float], ...] = ()
    source: str = "static order"            # or "measured"
    notes: tuple[str, ...] = field(default=())

    def strategy_for(self, tokens: int) -> Optional[str]:
        i = bucket_index(tokens)
        return self.choice[i] if i < len(self.choice) else self.overflow

    def to_dict(self) -> dict:
        return {
            "requested": self.requested, "source": self.source, "overflow": self.overflow,
            "buckets": [{"max_tokens": b, "strategy": s,
                         "measured_us": self.measured_us[i] if i < len(self.measured_us) else None}
                        for i, (b, s) in enumerate(zip(self.bounds, self.choice))],
            "notes": list(self.notes),
        }


def select(statuses: list[StrategyStatus], spec: EpilogueSpec, requested: str = AUTO,
           measured_us: Optional[Mapping[str, Mapping[int, float]]] = None) -> Plan:
    """Pick a strategy per token bucket.

    requested: "auto" or a strategy name. An explicit name that cannot run raises NoStrategyAvailable
    with its reasons; it never falls back. Under auto, among available auto-selectable strategies that
    can take the bucket's largest T, the fastest measured one wins (measured_us: name -> {bucket upper
    bound: microseconds}); without a measurement the static order (the order of `statuses`) decides.
    T above spec.max_tokens goes to the first candidate without a per-call limit (auto) or raises.
    """
    by_name = {s.name: s for s in statuses}
    bounds = bucket_bounds(spec.max_tokens)
    if requested != AUTO:
        if requested not in by_name:
            raise ValueError(f"strategy must be 'auto' or one of {list(by_name)}, got {requested!r}")
        st = by_name[requested]
        if not st.available:
            raise NoStrategyAvailable(requested, [st])
        overflow = requested if st.max_tokens_per_call is None else None
        return Plan(requested, bounds, tuple(requested for _ in bounds), overflow, source="requested")

    candidates = [s for s in statuses if s.available and s.auto_selectable]
    if not candidates:
        raise NoStrategyAvailable(AUTO, statuses)
    choice, times, notes = [], [], []
    used_measurements = False
    for bound in bounds:
        fits = [s for s in candidates if s.max_tokens_per_call is None or s.max_tokens_per_call >= bound]
        if not fits:
            raise NoStrategyAvailable(AUTO, statuses)
        timed = [(measured_us[s.name][bound], i, s.name) for i, s in enumerate(fits)
                 if measured_us and bound in measured_us.get(s.name, {})]
        if timed:
            best_time, _, best = min(timed)
            used_measurements = True
            choice.append(best)
            times.append(best_time)
        else:
            choice.append(fits[0].name)
            times.append(None)
    unlimited = [s.name for s in candidates if s.max_tokens_per_call is None]
    overflow = unlimited[0] if unlimited else None
    if overflow is None:
        notes.append(f"T > max_tokens={spec.max_tokens} raises: every candidate has a per-call token limit")
    return Plan(AUTO, bounds, tuple(choice), overflow, tuple(times),
                "measured" if used_measurements else "static order", tuple(notes))
