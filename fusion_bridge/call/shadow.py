"""Shadow mode: run a second strategy (e.g. the fp32 `reference`) beside the selected one on sampled
calls and record how far they diverge, without changing any output. An eager-mode rollout tool.

Sampling is by a call counter that advances on every call, so it is identical on every rank (calls
are collective): a shadow strategy with its own collective runs on all ranks or on none. During
CUDA-graph capture the shadow is skipped (and counted); graph replays never reach Python, so they
are not sampled.

Cost, on a sampled call only: one extra run of the shadow strategy (its kernels and, for
`reference`, an fp32 all-reduce), plus the comparison, which reads scalars to the host (a sync). Off
by default. Enable: FusionBridge(..., shadow="reference:100") or FUSION_BRIDGE_SHADOW=reference:100.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from fusion_bridge import env_vars, log
from fusion_bridge.epilogue_tensors import EpilogueInputs, EpilogueOutputs
from fusion_bridge.oracle.numerics import compare
from fusion_bridge.plan.status import StrategyStatus
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.strategies.base import Strategy


@dataclass
class Shadow:
    strategy: str
    every: int
    calls: int = 0
    sampled: int = 0
    skipped_in_capture: int = 0
    peer_failed: int = 0  # sampled calls a peer's failure made NaN on every rank: not compared
    outputs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"FusionBridge: shadow_every must be an int >= 1, got {self.every!r}")

    @staticmethod
    def parse(value: str, known: list[str], source: str = "shadow") -> "Shadow":
        """'reference' or 'reference:100' (every 100th call; the default) -> Shadow. `source`: the
        argument or the environment variable the value came from, named in the error (a
        ValueError; EnvVarError for the variable)."""
        text = value.strip() if isinstance(value, str) else value
        match = env_vars.SHADOW_PATTERN.fullmatch(text) if isinstance(text, str) else None
        if match is None or match["name"] not in known:
            expected = (
                f"'<strategy>[:<every>]' with a strategy among {known} and an int period "
                "<every> in 1..999999999, in ASCII digits"
            )
            if source.startswith(env_vars.PREFIX):
                raise env_vars.EnvVarError(source, expected, str(value))
            raise ValueError(f"FusionBridge: {source} must be {expected}, got {value!r}")
        return Shadow(match["name"], int(match["every"]) if match["every"] else 100)

    def due(self) -> bool:
        """Advance the call counter; True on every `every`-th call (the first call included)."""
        self.calls += 1
        if (self.calls - 1) % self.every:
            return False
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            self.skipped_in_capture += 1
            return False
        return True

    def record(
        self, spec: EpilogueSpec, selected: EpilogueOutputs, shadow: EpilogueOutputs
    ) -> dict[str, float]:
        """Accumulate this sample's statistics; returns {output: rel_err} of this sample."""
        self.sampled += 1
        errors = compare(spec, selected, shadow)
        for name, (rel, max_abs) in errors.items():
            tensor = selected.named()[name] if name != "quant" else None
            nan = int(torch.isnan(tensor).sum()) if tensor is not None else 0
            inf = int(torch.isinf(tensor).sum()) if tensor is not None else 0
            s = self.outputs.setdefault(
                name, {"max_abs": 0.0, "max_rel_err": 0.0, "last_rel_err": 0.0, "nan": 0, "inf": 0}
            )
            s["max_abs"] = _worst(s["max_abs"], max_abs)
            s["max_rel_err"] = _worst(s["max_rel_err"], rel)
            s["last_rel_err"] = rel
            s["nan"] += nan
            s["inf"] += inf
        return {name: rel for name, (rel, _) in errors.items()}

    def run_beside(
        self,
        spec: EpilogueSpec,
        inputs: EpilogueInputs,
        out: EpilogueOutputs,
        selected: str,
        instances: Mapping[str, Strategy],
        statuses: Sequence[StrategyStatus],
        bridge_name: str,
    ) -> None:
        """On a sampled call: run the shadow strategy (prepared among `instances`) on the call's
        inputs and record how far its outputs are from `out`, what the selected strategy (named
        `selected`) returned. A divergence beyond the selected strategy's error bound (its status
        among `statuses`; NaN included) logs a warning, at most once a minute per bridge."""
        shadow = instances[self.strategy].run(inputs)
        if bool(torch.isnan(out.residual_out).all()) and bool(
            torch.isnan(shadow.residual_out).all()
        ):
            # a peer failed this call and took part with its NaN payload in both collectives:
            # nothing to compare (every rank's outputs are NaN by design, not a divergence)
            self.peer_failed += 1
            return
        errors = self.record(spec, out, shadow)
        bound = next(s.error_bound for s in statuses if s.name == selected)
        worst = max(errors["residual_out"], errors["norm_out"])
        if not worst <= bound:  # NaN too
            log.log_every(
                (bridge_name, "shadow"),
                60.0,
                logging.WARNING,
                "fusion_bridge: shadow %s diverges from %s at T=%d: rel err %.3g > bound %.3g",
                self.strategy,
                selected,
                inputs.tokens,
                worst,
                bound,
            )

    def to_dict_settings(self) -> dict:
        """What must be equal on every rank (sampling is by a call counter that every rank
        advances)."""
        return {"strategy": self.strategy, "every": self.every}

    def to_dict(self) -> dict:
        return {
            "strategy": self.strategy,
            "every": self.every,
            "calls": self.calls,
            "sampled": self.sampled,
            "skipped_in_capture": self.skipped_in_capture,
            "peer_failed": self.peer_failed,
            "outputs": self.outputs,
        }


def _worst(a: float, b: float) -> float:
    return math.inf if (math.isnan(b) or math.isinf(b)) else max(a, b)
