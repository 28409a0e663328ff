"""FusionBridge's tools beside the call path: one strategy run directly (parity, benchmarks:
call/direct.py) and tuning (call/tools.py). A mixin of FusionBridge (bridge.py), split from it to
keep each module short: these methods read the bridge's built state (spec, env, group, device,
statuses, plan, prepared instances) and, after tuning, re-bind its routes (`_use_routes`)."""

from __future__ import annotations

from typing import Callable, Optional

from fusion_bridge.call import direct, failure, routes as call_routes, tools
from fusion_bridge.epilogue_tensors import EpilogueInputs, EpilogueOutputs


class BridgeTools:
    """FusionBridge's direct runs and tuning (see the module docstring)."""

    # ---------------------------------------------------------------- tools (call/direct.py)
    def run_strategy(
        self, name: str, inputs: EpilogueInputs, variant: Optional[str] = None
    ) -> EpilogueOutputs:
        """Run one prepared strategy by name on `inputs` (EpilogueInputs: the six tensors of
        finalize_epilogue, same shapes and dtypes), in its planned variant for this T unless
        `variant` is given, whatever the plan says. Validates the inputs; returns EpilogueOutputs.
        Collective when world > 1: every rank calls it with the same name."""
        return direct.run_strategy(
            name,
            inputs,
            variant,
            spec=self.spec,
            env=self.env,
            device=self.device,
            instances=self._instances,
            statuses=self.statuses,
            shared_once=self._shared_once,
        )

    def selected_run(
        self, tokens: int, eager: bool = False
    ) -> Callable[[EpilogueInputs], EpilogueOutputs]:
        """The planned strategy's own run for T tokens (eager=True: the eager plan's), without the
        bridge's validation and dispatch (what host-overhead benchmarks compare finalize_epilogue
        with): EpilogueInputs of T tokens -> EpilogueOutputs."""
        return direct.selected_run(tokens, eager, self.plan, self._instances, self.spec.max_tokens)

    # ---------------------------------------------------------------- tuning (call/tools.py)
    def tuning_candidates(self) -> list[tuple[str, str, Callable]]:
        """(strategy, variant, run(inputs, variant)) for every available auto-selectable strategy
        and each of its launch variants: what `tune` measures."""
        return tools.tuning_candidates(self.statuses, self._instances)

    def tune(
        self, buckets: Optional[list[int]] = None, progress: bool = True, save: bool = True
    ) -> dict:
        """Measure every (strategy, variant) per token bucket bound (`buckets`, default the plan's;
        CUDA graphs, inputs rotated beyond L2, max over ranks), re-plan from the measurements and
        cache the table (rank 0, with `save`). Returns the table (a JSON-able dict). Collective;
        CUDA only."""
        tuned = tools.measure_routes(
            spec=self.spec,
            env=self.env,
            group=self.group,
            device=self.device,
            candidates=self.tuning_candidates(),
            buckets=list(buckets or self.plan.bounds),
            statuses=self.statuses,
            progress=progress,
            save=save,
        )
        self.table = tuned.table
        plan = tuned.plan(self.statuses, self.spec, self.requested)
        shadow = (self._shadow.strategy,) if self._shadow else ()
        failure.reserve_for(plan, self._instances, shadow, self.spec, self.device, self.env)
        self._use_routes(
            call_routes.bind_plan(plan, self._instances, self.env.world_size, self.group)
        )
        return tuned.table
