"""What FusionBridge's tool and report methods compute, off the call path: the candidates `tune`
measures and the table it makes, the build's one log line, the structured report (`explain`) and
the calls counted per route. Functions of explicit arguments; the bridge passes its state in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch

from fusion_bridge import log
from fusion_bridge.call.shadow import Shadow
from fusion_bridge.environment import Environment
from fusion_bridge.plan.planner import AUTO, Plan, select_for_modes
from fusion_bridge.plan.report import Report
from fusion_bridge.plan.status import StrategyStatus
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.strategies.base import Strategy
from fusion_bridge.tuning import tables as tuning_tables

#: calls per (strategy, variant, made during CUDA-graph capture?), as FusionBridge counts them
CallCounts = Mapping[tuple[str, str, bool], int]


def tuning_candidates(
    statuses: Sequence[StrategyStatus], instances: Mapping[str, Strategy]
) -> list[tuple[str, str, Callable]]:
    """(strategy, variant, run(inputs, variant)) for every available auto-selectable strategy
    among the prepared `instances` and each of its launch variants: what `tune` measures."""
    return [
        (st.name, variant, instances[st.name].run)
        for st in statuses
        if st.available and st.auto_selectable and st.name in instances
        for variant in st.variants
    ]


@dataclass(frozen=True)
class Tuned:
    """What `measure_routes` found: the table (as cached; with "path" when saved) and the
    measurements the new plan is selected from ({strategy: {variant: {bucket bound: time}}})."""

    table: dict
    measured: dict
    eager: dict

    def plan(self, statuses: list[StrategyStatus], spec: EpilogueSpec, requested: str) -> Plan:
        """The plan these measurements select, under the table's margin rule."""
        margin = tuning_tables.margin_of(self.table)
        return select_for_modes(statuses, spec, requested, self.measured, self.eager, margin)


def measure_routes(
    *,
    spec: EpilogueSpec,
    env: Environment,
    group,
    device: torch.device,
    candidates: list[tuple[str, str, Callable]],
    buckets: list[int],
    statuses: Sequence[StrategyStatus],
    progress: bool,
    save: bool,
) -> Tuned:
    """Measure every candidate per token bucket bound in `buckets` (CUDA graphs, inputs rotated
    beyond L2, max over ranks; eager wall times too), make the table and, with `save`, cache it
    (rank 0 writes). Collective. Raises RuntimeError off CUDA."""
    if device.type != "cuda":
        raise RuntimeError(
            f"tune: needs a CUDA device (it times CUDA graphs); this bridge is on {device.type}"
        )
    eager: dict = {}
    differences: list = []
    measured = tuning_tables.measure(
        spec,
        env,
        group,
        device,
        candidates,
        buckets,
        progress=progress,
        eager_out=eager,
        token_ranges=tuning_tables.token_ranges(statuses),
        spread_out=differences,
    )
    spread = tuning_tables.spread_summary(differences)
    table = tuning_tables.make_table(spec, env, measured, eager, spread)
    if save and (env.world_size == 1 or torch.distributed.get_rank(group) == 0):
        path = tuning_tables.cache_path(spec, env)
        tuning_tables.save_table(table, path)
        table["path"] = str(path)
    return Tuned(table, measured, eager)


def summary(
    spec: EpilogueSpec, env: Environment, statuses: Sequence[StrategyStatus], plan: Plan
) -> str:
    """The one INFO line logged when a bridge is built: the route per bucket and who was rejected
    (log.build_summary)."""
    rejected = {s.name: [r.code for r in s.reasons] for s in statuses if s.reasons}
    return log.build_summary(
        spec.hidden_size,
        spec.top_k,
        env.world_size,
        list(zip(plan.bounds, plan.choice)),
        rejected,
        overflow=plan.overflow,
        dtype=spec.dtype_name,
        quant=spec.quant.kind.value,
        requested=None if plan.requested == AUTO else plan.requested,
        source=plan.source,
    )


def report(
    *,
    spec: EpilogueSpec,
    env: Environment,
    statuses: list[StrategyStatus],
    plan: Plan,
    tokens: Optional[int],
    reroutes: int,
    shadow: Optional[Shadow],
    table: Optional[dict],
    calls: CallCounts,
) -> Report:
    """The structured report of a built bridge (FusionBridge.explain)."""
    return Report(
        env,
        spec,
        statuses,
        plan,
        tokens=tokens,
        reroutes=reroutes,
        shadow=shadow.to_dict() if shadow else None,
        table=(table or {}).get("path"),
        calls=route_calls(calls),
    )


def route_calls(calls: CallCounts) -> list[dict]:
    """The counts per (strategy, variant, captured?) as rows per route: [{strategy, variant, eager,
    captured}], sorted by route."""
    routes: dict[tuple[str, str], dict] = {}
    for (name, variant, captured), n in sorted(calls.items()):
        row = routes.setdefault(
            (name, variant), {"strategy": name, "variant": variant, "eager": 0, "captured": 0}
        )
        row["captured" if captured else "eager"] += n
    return list(routes.values())


def workspace_bytes(instances: Mapping[str, Strategy]) -> int:
    """Bytes of workspace held by the prepared strategies."""
    return sum(i.workspace_bytes for i in instances.values())
