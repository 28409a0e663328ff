"""What the bridge learned about one registered strategy (on every rank alike): a plain value that
the planner selects over and the report shows. Golden tests build it by hand."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from fusion_bridge.plan.buckets import bucket_ranges
from fusion_bridge.reasons import Reason
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.strategies.base import ANY_TOKENS, DEFAULT_VARIANT, Step, TokenRange


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
    self_test: str = "not run"  # "passed" | "failed" | "not run"
    self_test_error: Optional[float] = None
    workspace_bytes: int = 0
    variants: tuple[str, ...] = (DEFAULT_VARIANT,)
    #: the unmeasured choice of variant per token bucket (aligned with bucket_bounds) and above
    #: max_tokens; each one's variant_tokens hold its bucket whenever some variant's do
    default_variants: tuple[str, ...] = ()
    overflow_variant: str = DEFAULT_VARIANT
    opt_in: bool = False  # auto neither prepares nor picks it; a request by name does
    #: the token counts each variant can take (aligned with `variants`; empty: every variant, any T)
    variant_tokens: tuple[TokenRange, ...] = ()

    @property
    def available(self) -> bool:
        return not self.reasons

    @staticmethod
    def of(
        cls,
        spec: EpilogueSpec,
        env,
        reasons: list[Reason],
        self_test: str = "not run",
        self_test_error: Optional[float] = None,
        workspace_bytes: int = 0,
    ) -> "StrategyStatus":
        """The status of strategy class `cls` given the reasons gathered for it."""
        variants = tuple(cls.variants(spec, env))
        declared = cls.variant_tokens(spec, env)
        unknown = set(declared) - set(variants)
        if unknown:
            raise ValueError(f"{cls.name}: variant_tokens names undeclared variants {unknown}")
        status = StrategyStatus(
            name=cls.name,
            summary=cls.summary,
            reasons=tuple(reasons),
            steps=tuple(cls.steps(spec, env)),
            auto_selectable=cls.is_auto_selectable(spec, env),
            opt_in=cls.opt_in,
            max_tokens_per_call=cls.max_tokens_per_call(spec, env),
            error_bound=cls.error_bound(spec, env),
            self_test=self_test,
            self_test_error=self_test_error,
            workspace_bytes=workspace_bytes,
            variants=variants,
            variant_tokens=tuple(declared.get(v, ANY_TOKENS) for v in variants),
        )
        defaults = tuple(
            status.valid_variant(cls.default_variant(spec, env, high), low, high)
            for low, high in bucket_ranges(spec.max_tokens)
        )
        overflow = status.valid_variant(
            cls.default_variant(spec, env, None), spec.max_tokens + 1, None
        )
        return dataclasses.replace(status, default_variants=defaults, overflow_variant=overflow)

    def declared_range(self, variant: str) -> TokenRange:
        """(fewest, most) tokens `variant` declares (variant_tokens); most None: no own limit."""
        i = self.variants.index(variant)
        return self.variant_tokens[i] if i < len(self.variant_tokens) else ANY_TOKENS

    def token_range(self, variant: str) -> TokenRange:
        """(fewest, most) tokens `variant` can take; most None: no limit. Includes the
        strategy's max_tokens_per_call."""
        low, high = self.declared_range(variant)
        cap = self.max_tokens_per_call
        if cap is not None:
            high = cap if high is None else min(high, cap)
        return low, high

    def variants_for(self, low: int, high: Optional[int]) -> tuple[str, ...]:
        """The variants that can take every T in [low, high] (high None: unbounded above)."""
        out = []
        for v in self.variants:
            v_low, v_high = self.token_range(v)
            if low >= v_low and (v_high is None or (high is not None and high <= v_high)):
                out.append(v)
        return tuple(out)

    def valid_variant(self, preferred: str, low: int, high: Optional[int]) -> str:
        """`preferred` if it can take every T in [low, high], else the first variant that can (else
        `preferred`: then no variant fits and the planner does not give this strategy the range)."""
        valid = self.variants_for(low, high)
        return preferred if preferred in valid or not valid else valid[0]

    def variant_for(self, bucket: int) -> str:
        return (
            self.default_variants[bucket]
            if bucket < len(self.default_variants)
            else self.variants[0]
        )

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "summary": self.summary,
            "available": self.available,
            "reasons": [r.to_dict() for r in self.reasons],
            "steps": [s.name for s in self.steps],
            "step_stages": [s.to_dict() for s in self.steps],
            "auto_selectable": self.auto_selectable,
            "opt_in": self.opt_in,
            "max_tokens_per_call": self.max_tokens_per_call,
            "error_bound": self.error_bound,
            "self_test": self.self_test,
            "self_test_error": self.self_test_error,
            "workspace_bytes": self.workspace_bytes,
            "variants": list(self.variants),
            "variant_tokens": {v: list(self.token_range(v)) for v in self.variants},
        }
