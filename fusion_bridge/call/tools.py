"""The FusionBridge methods that tools and reports use, off the call path: run one prepared strategy
by name (parity checks, benchmarks), measure every route and re-plan (`tune`), and say what runs
(`route_for`, `explain`, `route_calls`).

`BridgeTools` is mixed into FusionBridge (bridge.py) and reads the state its build binds: spec, env,
group, device, requested, statuses, plan, table, reroutes, _instances, _calls, _shadow, _use_plan.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from fusion_bridge import log
from fusion_bridge.tuning import tables as tuning_tables
from fusion_bridge.plan.buckets import bucket_index, tokens_text
from fusion_bridge.epilogue_tensors import EpilogueInputs, EpilogueOutputs, allocate_outputs
from fusion_bridge.plan.planner import AUTO, select_for_modes
from fusion_bridge.plan.report import Report
from fusion_bridge.call.validation import check_token_limit, validate_inputs


class BridgeTools:
    """FusionBridge's tool and report methods (see the module docstring)."""

    # ------------------------------------------------ tools (parity, tuning, benchmarks)
    def run_strategy(
        self, name: str, inputs: EpilogueInputs, variant: Optional[str] = None
    ) -> EpilogueOutputs:
        """Run one prepared strategy by name (its planned variant for this T unless given), whatever
        the
        plan says. Validates the inputs. Collective when world > 1: every rank calls it with the
        same name."""
        if name not in self._instances:
            raise ValueError(
                f"run_strategy: strategy must be one of the prepared {list(self._instances)}, "
                f"got {name!r}"
            )
        validate_inputs(self.spec, inputs, self.device)
        if inputs.tokens == 0:
            return allocate_outputs(self.spec, 0, self.device)
        inst = self._instances[name]
        check_token_limit(inputs.tokens, inst.max_tokens_per_call(self.spec, self.env), name)
        status = next(s for s in self.statuses if s.name == name)
        if variant is None:
            variant = status.variant_for(bucket_index(inputs.tokens))
        elif variant not in status.variants:
            raise ValueError(
                f"run_strategy: variant of {name!r} must be one of {list(status.variants)}, "
                f"got {variant!r}"
            )
        low, high = status.token_range(variant)
        if inputs.tokens < low or (high is not None and inputs.tokens > high):
            raise ValueError(
                f"run_strategy: {name}:{variant} takes {tokens_text(low, high)}, "
                f"got T={inputs.tokens}"
            )
        return inst.run(inputs, variant)

    def selected_run(
        self, tokens: int, eager: bool = False
    ) -> Callable[[EpilogueInputs], EpilogueOutputs]:
        """The planned strategy's own run for T tokens (eager=True: the eager plan's), without the
        bridge's validation and dispatch (what host-overhead benchmarks compare finalize_epilogue
        with)."""
        route = self.route_for(tokens, eager)
        if route is None:
            raise ValueError(
                f"selected_run: no route for T={tokens} (max_tokens={self.spec.max_tokens})"
            )
        inst, variant = self._instances[route[0]], route[1]
        return lambda inputs: inst.run(inputs, variant)

    def tuning_candidates(self) -> list[tuple[str, str, Callable]]:
        """(strategy, variant, run(inputs, variant)) for every available auto-selectable strategy
        and
        each of its launch variants: what `tune` measures."""
        return [
            (st.name, variant, self._instances[st.name].run)
            for st in self.statuses
            if st.available and st.auto_selectable and st.name in self._instances
            for variant in st.variants
        ]

    def tune(
        self, buckets: Optional[list[int]] = None, progress: bool = True, save: bool = True
    ) -> dict:
        """Measure every (strategy, variant) per token bucket (CUDA graphs, inputs rotated beyond
        L2, max
        over ranks), re-plan from the measurements and cache the table (rank 0). Collective."""
        if self.device.type != "cuda":
            raise RuntimeError(
                "tune: needs a CUDA device (it times CUDA graphs); this bridge is on "
                f"{self.device.type}"
            )
        eager: dict = {}
        differences: list = []
        measured = tuning_tables.measure(
            self.spec,
            self.env,
            self.group,
            self.device,
            self.tuning_candidates(),
            list(buckets or self.plan.bounds),
            progress=progress,
            eager_out=eager,
            token_ranges=tuning_tables.token_ranges(self.statuses),
            spread_out=differences,
        )
        spread = tuning_tables.spread_summary(differences)
        table = tuning_tables.make_table(self.spec, self.env, measured, eager, spread)
        if save and (self.env.world_size == 1 or torch.distributed.get_rank(self.group) == 0):
            path = tuning_tables.cache_path(self.spec, self.env)
            tuning_tables.save_table(table, path)
            table["path"] = str(path)
        self.table = table
        margin = tuning_tables.margin_of(table)
        self._use_plan(
            select_for_modes(self.statuses, self.spec, self.requested, measured, eager, margin)
        )
        return table

    def _summary(self) -> str:
        plan, spec = self.plan, self.spec
        rejected = {s.name: [r.code for r in s.reasons] for s in self.statuses if s.reasons}
        return log.build_summary(
            spec.hidden_size,
            spec.top_k,
            self.env.world_size,
            list(zip(plan.bounds, plan.choice)),
            rejected,
            overflow=plan.overflow,
            dtype=spec.dtype_name,
            quant=spec.quant.kind.value,
            requested=None if plan.requested == AUTO else plan.requested,
            source=plan.source,
        )

    # ------------------------------------------------ report
    def strategy_for(self, tokens: int) -> Optional[str]:
        return self.plan.strategy_for(tokens) if tokens > 0 else None

    def route_for(self, tokens: int, eager: bool = False) -> Optional[tuple[str, str]]:
        """(strategy, variant) a call with T tokens runs under CUDA graphs (eager=True: outside
        capture),
        or None (T == 0, or no route above max_tokens)."""
        return self.plan.route_for(tokens, eager) if tokens > 0 else None

    def explain(self, tokens: Optional[int] = None) -> Report:
        """The structured report: environment, every strategy (selected or rejected, with all
        reasons),
        the plan per token bucket, workspace bytes and reroutes. `.to_dict()`, `.to_json()`,
        `str()`."""
        return Report(
            self.env,
            self.spec,
            self.statuses,
            self.plan,
            tokens=tokens,
            reroutes=self.reroutes,
            shadow=self._shadow.to_dict() if self._shadow else None,
            table=(self.table or {}).get("path"),
            calls=self.route_calls(),
        )

    def route_calls(self) -> list[dict]:
        """Calls per route so far: [{strategy, variant, eager, captured}], eager = calls outside
        CUDA-graph capture, captured = calls made while a graph was being captured. A replay of a
        captured graph runs on the GPU without reaching the host, so replays are not counted."""
        routes: dict[tuple[str, str], dict] = {}
        for (name, variant, captured), n in sorted(self._calls.items()):
            row = routes.setdefault(
                (name, variant), {"strategy": name, "variant": variant, "eager": 0, "captured": 0}
            )
            row["captured" if captured else "eager"] += n
        return list(routes.values())

    @property
    def prepared(self) -> list[str]:
        return list(self._instances)

    @property
    def workspace_bytes(self) -> int:
        return sum(i.workspace_bytes for i in self._instances.values())
