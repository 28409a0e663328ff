"""The report is a value: `to_dict()`/`to_json()` for tools (with "schema_version"), `str()`
for people."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from fusion_bridge.environment import Environment
from fusion_bridge.plan.planner import Plan
from fusion_bridge.plan.status import StrategyStatus
from fusion_bridge.reasons import EXCLUDED
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.strategies.base import DEFAULT_VARIANT

SCHEMA_VERSION = 1  # of Report.to_dict(); raise it when a field changes meaning or goes away
# reason codes that say "this machine has no GPU": on such a machine the text shows only that one
NEEDS_GPU = {
    "needs_cuda": "needs a CUDA GPU",
    "needs_cuda_or_interpreter": "needs a CUDA GPU (or TRITON_INTERPRET=1, for CPU tests)",
}


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
    #: calls per route so far (FusionBridge.route_calls); None: not a built bridge (explain --gpu)
    calls: Optional[list] = None

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
            "calls": self.calls,
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
        """The answer first (the strategy for T, then the plan per token range), then every
        strategy with its reasons. On a machine without CUDA a GPU strategy shows only that it
        needs a GPU: its other checks and hints are GPU-machine advice (`to_dict()` keeps them)."""
        lines = self._header() + [""] + self._answer() + ["", "strategies:"]
        chosen = set(self.plan.choice) if self.plan else set()
        for st in self.strategies:
            lines += self._strategy_lines(st, st.name in chosen)
        measured = self._measured_lines()
        if measured:
            lines += [""] + measured
        if self.shadow:
            lines += [""] + self._shadow_lines()
        return "\n".join(lines)

    def machine_text(self) -> str:
        """What `info` prints: this machine and what a bridge built here prepared (self-test,
        workspace), with the plan in one line; `str(report)` is the plan with every reason."""
        env = self.environment
        chosen = set(self.plan.choice) if self.plan else set()
        symm = (
            "not used without CUDA"
            if env.device_type != "cuda"
            else "usable"
            if env.symm_mem_error is None
            else f"unusable ({env.symm_mem_error})"
        )
        lines = self._header() + [
            "",
            "this machine:",
            f"  device:            {self._device_text()}",
            f"  triton:            {env.triton_version or f'missing ({env.triton_error})'}"
            + (" under the interpreter (TRITON_INTERPRET=1)" if env.triton_interpret else ""),
            f"  flashinfer:        {env.flashinfer_version or f'missing ({env.flashinfer_error})'}",
            f"  symmetric memory:  {symm}",
            f"  NVLink multicast:  {self._multicast_text()}",
            f"  process group:     {env.world_size} rank(s)"
            + ("" if env.single_node else ", several nodes"),
            "",
            f"{'strategy':22s} {'state':10s} {'self-test':30s} workspace/rank",
        ]
        for st in self.strategies:
            state = "SELECTED" if st.name in chosen else "available" if st.available else "rejected"
            test = st.self_test + (
                f" ({st.self_test_error:.1e})" if st.self_test_error is not None else ""
            )
            ws = f"{st.workspace_bytes / 2**20:.1f} MiB" if st.workspace_bytes else "-"
            lines.append(f"{st.name:22s} {state:10s} {test:30s} {ws}")
        lines += ["", *self._answer()[:1], f"plan: {self._plan_line()}"]
        lines.append(
            "(`python -m fusion_bridge explain` gives the plan per token range and every reason)"
        )
        return "\n".join(lines)

    def _multicast_text(self) -> str:
        off = self.environment.probes.get("multicast_off")
        if off is None:
            return "not probed"
        if off:
            return "off in this process (NCCL_NVLS_ENABLE=0 and the other two set)"
        return "this process leaves it to NCCL and torch (our kernels never use it either way)"

    def _device_text(self) -> str:
        env = self.environment
        if env.device_type != "cuda":
            return "cpu (no CUDA GPU visible to torch)"
        return f"cuda SM{env.sm} {env.gpu_name or ''}".rstrip()

    def _plan_line(self) -> str:
        """The plan as token ranges in one line, e.g. 'separate for 1..8192, separate above'."""
        if not self.plan:
            return "none (no strategy can run)"
        parts, low = [], 1
        for i, (bound, name) in enumerate(zip(self.plan.bounds, self.plan.choice)):
            nxt = self.plan.choice[i + 1] if i + 1 < len(self.plan.choice) else None
            if nxt == name:
                continue
            parts.append(f"{name} for T={low}..{bound}")
            low = bound + 1
        parts.append(f"{self.plan.overflow or 'an error'} above {self.spec.max_tokens}")
        return ", ".join(parts) + f" ({self.plan.source})"

    def _header(self) -> list[str]:
        env, spec = self.environment, self.spec
        where = env.device_type
        if env.device_type == "cuda":
            where += f" SM{env.sm}"
            name = (env.gpu_name or "").strip()
            if name and not name.upper().startswith(f"SM{env.sm}"):  # no "SM90 SM90 GPU"
                where += f" ({name})"
        return [
            f"fusion-bridge on {where}, world size {env.world_size}"
            f"{'' if env.single_node else ' (multi-node)'}; torch {env.torch_version}, "
            f"triton {env.triton_version or 'missing'}, flashinfer "
            f"{env.flashinfer_version or 'missing'}",
            f"spec: H={spec.hidden_size} K={spec.top_k} {spec.dtype_name} "
            f"quant={spec.quant.kind.value}{_quant_detail(spec)} "
            f"shared={'yes' if spec.has_shared_output else 'no'} max_tokens={spec.max_tokens}",
        ]

    def _answer(self) -> list[str]:
        """The selected strategy for `tokens` and the plan, merged into token ranges."""
        spec, lines = self.spec, []
        if self.tokens is not None:
            lines.append(f"selected for T={self.tokens}: {self._picked()}")
        if not self.plan:
            return lines
        plan = self.plan
        source = f"requested: {plan.requested}" if plan.source == "requested" else plan.source
        lines.append(f"plan ({source}):")
        if plan.margin is not None:
            lines.append(
                f"  (static-order choice kept unless a measured route is more than "
                f"{plan.margin.fraction:.1%} faster; margin: {plan.margin.source})"
            )
        for low, high, bucket_list in _ranges(plan.to_dict()["buckets"]):
            b = bucket_list[0]
            route = _route_text(b["strategy"], b["variant"])
            times = [x["measured_us"] for x in bucket_list if x["measured_us"] is not None]
            t = ""
            if times:
                low_us, high_us = min(times), max(times)
                t = (
                    f"  {low_us:.1f} us"
                    if low_us == high_us
                    else f"  {low_us:.1f}-{high_us:.1f} us"
                )
            lines.append(f"  {low:6d} <= T <= {high:6d}: {route}{t}")
        overflow = (
            _route_text(plan.overflow, plan.overflow_variant) if plan.overflow else "error (raises)"
        )
        lines.append(
            f"  T > {spec.max_tokens:6d}:           {overflow}"
            + (f", rerouted {self.reroutes} calls so far" if self.reroutes else "")
        )
        lines += [f"  note: {n}" for n in plan.notes]
        if self.table:
            lines.append(f"  measurements from {self.table}")
        if self.calls is not None:
            lines.append(f"calls so far: {self._calls_text()}")
        return lines

    def _calls_text(self) -> str:
        if not self.calls:
            return "none"
        parts = [
            f"{_route_text(c['strategy'], c['variant'])} {c['eager']} eager, "
            f"{c['captured']} in CUDA-graph captures"
            for c in self.calls
        ]
        return "; ".join(parts) + " (graph replays never reach the host: not counted)"

    def _why_not_chosen(self, name: str) -> Optional[str]:
        """For a strategy that can run but no bucket chose: how close it came, from measurements."""
        if not self.plan or self.plan.margin is None:
            return None
        behind = [
            (c["vs_chosen_pct"], b["max_tokens"])
            for b in self.plan.to_dict()["buckets"]
            for c in b["candidates"]
            if c["strategy"] == name and c["vs_chosen_pct"] is not None
        ]
        if not behind:
            return "not chosen: no measurement of it in the table"
        pct, bound = min(behind)
        if pct < 0:
            return (
                f"not chosen: at best {-pct:.1f}% faster (T<={bound}), within the margin, so the "
                "static-order choice stayed"
            )
        return (
            f"not chosen: slower than the chosen route in every measured bucket it could take "
            f"(closest: {pct:+.1f}% at T<={bound})"
        )

    def _measured_lines(self) -> list[str]:
        """Per measured bucket: why its route won, and every other candidate's time and distance."""
        if not self.plan or self.plan.margin is None:
            return []
        lines = ["measured, per token bucket (why the route won; the others, + = slower):"]
        low = 1
        for b in self.plan.to_dict()["buckets"]:
            if b["measured_us"] is not None:
                route = _route_text(b["strategy"], b["variant"])
                lines.append(
                    f"  {low:6d} <= T <= {b['max_tokens']:6d}: {route} {b['measured_us']:.1f} us"
                )
                lines += _candidate_lines(b)
            low = b["max_tokens"] + 1
        return lines

    def _picked(self) -> str:
        if self.tokens <= 0:
            return "none (T=0: nothing to compute, no launch)"
        if self.plan is None:
            return "none (no plan: the requested strategy cannot run, see its reasons below)"
        if self.selected is None:
            return (
                f"none (T > max_tokens={self.spec.max_tokens} and no strategy without a "
                "per-call limit: raises)"
            )
        return _route_text(*self.selected_route)

    def _strategy_lines(self, st: StrategyStatus, chosen: bool) -> list[str]:
        if chosen:
            state = "SELECTED"
        elif st.available:
            state = "available" + (
                ""
                if st.auto_selectable
                else " (opt-in: request it by name)"
                if st.opt_in
                else " (never auto-selected here)"
            )
        elif any(r.code == EXCLUDED for r in st.reasons):
            state = "excluded by request"
        else:
            state = "rejected"
        gpu_only = self.environment.device_type != "cuda" and any(
            r.code in NEEDS_GPU for r in st.reasons
        )
        if gpu_only:  # the rest is advice for a GPU machine
            need = next(r for r in st.reasons if r.code in NEEDS_GPU)
            excluded = [r for r in st.reasons if r.code == EXCLUDED]
            more = len(st.reasons) - 1 - len(excluded)
            return [
                f"{st.name:22s} {state}: {NEEDS_GPU[need.code]} [{need.code}]"
                + (
                    f" (+{more} more for GPU machines: in the report's JSON, `to_dict()` in "
                    "Python, `--json` on the command line)"
                    if more
                    else ""
                )
            ] + [f"{'':22s} [{r.code}] {r.message}" for r in excluded]
        extra = f", self-test: {st.self_test}" + (
            f" (rel err {st.self_test_error:.2e})" if st.self_test_error is not None else ""
        )
        ws = f", workspace {st.workspace_bytes / 2**20:.1f} MiB/rank" if st.workspace_bytes else ""
        lines = [
            f"{st.name:22s} {state}{extra}{ws}",
            f"{'':22s} steps: {' -> '.join(s.name for s in st.steps)}",
        ]
        lost = self._why_not_chosen(st.name) if st.available and not chosen else None
        if lost:
            lines.append(f"{'':22s} {lost}")
        for r in st.reasons:
            lines.append(
                f"{'':22s} [{r.code}] {r.message}" + (f"\n{'':24s}hint: {r.hint}" if r.hint else "")
            )
        return lines

    def _shadow_lines(self) -> list[str]:
        sh = self.shadow
        lines = [
            f"shadow {sh['strategy']} every {sh['every']} calls: {sh['sampled']} sampled of "
            f"{sh['calls']} ({sh['skipped_in_capture']} skipped in CUDA-graph capture)"
        ]
        for name, s in sh["outputs"].items():
            lines.append(
                f"  {name:13s} max rel err {s['max_rel_err']:.2e}, max abs {s['max_abs']:.2e}, "
                f"NaN {s['nan']}, Inf {s['inf']}"
            )
        return lines


def _route_text(strategy: str, variant: str) -> str:
    """ "name" for a strategy's only ("default") variant, else "name:variant": what runs."""
    return strategy if variant == DEFAULT_VARIANT else f"{strategy}:{variant}"


def _candidate_lines(bucket: dict) -> list[str]:
    """Why a measured bucket's route won, and every other measured candidate's time and its
    distance to the chosen route (+: slower)."""
    others = [
        f"{_route_text(c['strategy'], c['variant'])} {c['measured_us']:.1f} "
        f"({c['vs_chosen_pct']:+.1f}%)"
        for c in bucket["candidates"]
        if (c["strategy"], c["variant"]) != (bucket["strategy"], bucket["variant"])
    ]
    pad = " " * 10
    lines = [f"{pad}{bucket['why']}"] if bucket.get("why") else []
    return lines + ([f"{pad}others: " + ", ".join(others)] if others else [])


def _ranges(buckets: list[dict]) -> list[tuple[int, int, list[dict]]]:
    """Neighbouring buckets with the same route, all measured or all not, merged: (first T, last T,
    the buckets)."""
    out: list[tuple[int, int, list[dict]]] = []
    low = 1

    def key(b: dict) -> tuple:
        return b["strategy"], b["variant"], b["measured_us"] is None

    for b in buckets:
        same = out and key(out[-1][2][0]) == key(b)
        if same:
            out[-1] = (out[-1][0], b["max_tokens"], out[-1][2] + [b])
        else:
            out.append((low, b["max_tokens"], [b]))
        low = b["max_tokens"] + 1
    return out


def _quant_detail(spec) -> str:
    """The dynamic FP8 kinds' group size and scale layout, as the report's spec line shows them."""
    q = spec.quant
    if q.group_size is None:
        return ""
    return f"(group_size={q.group_size}, scale_layout={q.scale_layout.value})"
