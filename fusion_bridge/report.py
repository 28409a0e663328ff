"""The report is a value: `to_dict()`/`to_json()` for tools (with "schema_version"), `str()` for
people."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from .environment import Environment
from .planner import Plan
from .strategy_status import StrategyStatus
from .spec import EpilogueSpec
from .strategies.base import DEFAULT_VARIANT

SCHEMA_VERSION = 1  # of Report.to_dict(); raise it when a field changes meaning or goes away


@dataclass(frozen=True)
class Report:
    environment: Environment
    spec: EpilogueSpec
    strategies: list[StrategyStatus]
    plan: Optional[Plan]
    tokens: Optional[int] = None
    reroutes: int = 0
    shadow: Optional[dict] = None
    table: Optional[str] = None  # the tuning table the plan came from

    @property
    def selected(self) -> Optional[str]:
        route = self.selected_route
        return route[0] if route else None

    @property
    def selected_route(self) -> Optional[tuple[str, str]]:
        """(strategy, variant) a call with `tokens` runs under CUDA graphs, as planned."""
        if self.plan is None or self.tokens is None or self.tokens <= 0:
            return None
        return self.plan.route_for(self.tokens)

    def to_dict(self) -> dict:
        chosen = set(self.plan.choice) if self.plan else set()
        strategies = []
        for st in self.strategies:
            d = st.to_dict()
            d["selected"] = st.name in chosen
            strategies.append(d)
        out = {
            "schema_version": SCHEMA_VERSION,
            "environment": self.environment.to_dict(),
            "spec": self.spec.to_dict(),
            "strategies": strategies,
            "plan": self.plan.to_dict() if self.plan else None,
            "workspace_bytes": sum(s.workspace_bytes for s in self.strategies),
            "reroutes": self.reroutes,
            "shadow": self.shadow,
            "tuning_table": self.table,
        }
        if self.tokens is not None:
            out["tokens"] = self.tokens
            out["selected"] = self.selected
            route = self.selected_route
            out["selected_variant"] = route[1] if route else None
        return out

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        env, spec = self.environment, self.spec
        where = env.device_type
        if env.device_type == "cuda":
            where += f" SM{env.sm}"
            name = (env.gpu_name or "").strip()
            if name and not name.upper().startswith(f"SM{env.sm}"):  # no "SM90 SM90 GPU"
                where += f" ({name})"
        lines = [
            f"fusion-bridge on {where}, world size {env.world_size}"
            f"{'' if env.single_node else ' (multi-node)'}; torch {env.torch_version}, "
            f"triton {env.triton_version or 'missing'}, flashinfer "
            f"{env.flashinfer_version or 'missing'}",
            f"spec: H={spec.hidden_size} K={spec.top_k} {spec.dtype_name} "
            f"quant={spec.quant.kind.value} "
            f"shared={'yes' if spec.has_shared_output else 'no'} max_tokens={spec.max_tokens}",
            "",
        ]
        chosen = set(self.plan.choice) if self.plan else set()
        for st in self.strategies:
            if st.name in chosen:
                state = "SELECTED"
            elif st.available:
                state = "available" + (
                    ""
                    if st.auto_selectable
                    else " (opt-in: request it by name)"
                    if st.opt_in
                    else " (never auto-selected here)"
                )
            else:
                state = "rejected"
            extra = f", self-test: {st.self_test}" + (
                f" (rel err {st.self_test_error:.2e})" if st.self_test_error is not None else ""
            )
            ws = (
                f", workspace {st.workspace_bytes / 2**20:.1f} MiB/rank"
                if st.workspace_bytes
                else ""
            )
            lines.append(f"{st.name:22s} {state}{extra}{ws}")
            lines.append(f"{'':22s} steps: {' -> '.join(s.name for s in st.steps)}")
            for r in st.reasons:
                lines.append(
                    f"{'':22s} [{r.code}] {r.message}"
                    + (f"\n{'':24s}hint: {r.hint}" if r.hint else "")
                )
        if self.plan:
            lines += ["", f"plan ({self.plan.source}, requested {self.plan.requested}):"]
            low = 1
            buckets = self.plan.to_dict()["buckets"]
            for i, b in enumerate(buckets):  # merge neighbours with the same route and no timing
                nxt = buckets[i + 1] if i + 1 < len(buckets) else None
                if (
                    nxt
                    and b["measured_us"] is None
                    and nxt["measured_us"] is None
                    and (nxt["strategy"], nxt["variant"]) == (b["strategy"], b["variant"])
                ):
                    continue
                t = f"  {b['measured_us']:.1f} us" if b["measured_us"] is not None else ""
                route = _route_text(b["strategy"], b["variant"])
                lines.append(f"  {low:6d} <= T <= {b['max_tokens']:6d}: {route}{t}")
                low = b["max_tokens"] + 1
            overflow = (
                _route_text(self.plan.overflow, self.plan.overflow_variant)
                if self.plan.overflow
                else "error (raises)"
            )
            lines.append(
                f"  T > {spec.max_tokens:6d}:           {overflow}"
                + (f", rerouted {self.reroutes} calls so far" if self.reroutes else "")
            )
            lines += [f"  note: {n}" for n in self.plan.notes]
            if self.table:
                lines.append(f"  measurements from {self.table}")
        if self.shadow:
            sh = self.shadow
            lines += [
                "",
                f"shadow {sh['strategy']} every {sh['every']} calls: {sh['sampled']} sampled of "
                f"{sh['calls']} ({sh['skipped_in_capture']} skipped in CUDA-graph capture)",
            ]
            for name, s in sh["outputs"].items():
                lines.append(
                    f"  {name:13s} max rel err {s['max_rel_err']:.2e}, max abs {s['max_abs']:.2e}, "
                    f"NaN {s['nan']}, Inf {s['inf']}"
                )
        if self.tokens is not None:
            if self.tokens <= 0:
                picked = "none (T=0: nothing to compute, no launch)"
            elif self.plan is None:
                picked = "none (no plan: the requested strategy cannot run, see its reasons above)"
            elif self.selected is None:
                picked = (
                    f"none (T > max_tokens={spec.max_tokens} and no strategy without a "
                    "per-call limit: raises)"
                )
            else:
                picked = _route_text(*self.selected_route)
            lines.append(f"selected for T={self.tokens}: {picked}")
        return "\n".join(lines)


def _route_text(strategy: str, variant: str) -> str:
    """ "name" for a strategy's only ("default") variant, else "name:variant": what runs."""
    return strategy if variant == DEFAULT_VARIANT else f"{strategy}:{variant}"
