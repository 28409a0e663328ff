"""FusionBridge: built once per layer; one `finalize_epilogue` call per forward.

Building it is collective over `group` (every rank builds its bridge in the same order): admission
(capabilities, resources, workspaces, self-test, each agreed across ranks; admission.py), then the
plan (planner.select over the agreed statuses and rank 0's measurements). A call validates metadata
(no sync) and dispatches by token bucket in O(1) to the planned (strategy, launch variant).
The failure path is in bridge_failures.py, the tool and report methods in bridge_tools.py.

Environment variables:
  FUSION_BRIDGE_STRATEGY=<name>   overrides the `strategy` argument (an explicit request: raises if
                                  that strategy cannot run, never falls back)
  FUSION_BRIDGE_DEBUG=1           value checks at every call (index range, T equal on all ranks);
                                  they sync, so keep it off on the hot path and under CUDA graphs
  FUSION_BRIDGE_SELF_TEST=0       skip the self-test at build time
  FUSION_BRIDGE_SHADOW=name[:N]   shadow mode: run `name` beside the selected strategy every N-th
                                  call and record divergence in explain() (see shadow.py for the
                                  cost)
  FUSION_BRIDGE_EXCLUDE=a,b       keep these strategies out of auto (as the `exclude` argument)
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Optional, Sequence

import torch

from fusion_bridge.call import protocol as call_protocol, custom_op
from fusion_bridge import env_vars, log
from fusion_bridge import registry
from fusion_bridge.tuning import tables as tuning_tables
from fusion_bridge.ranks import agreement as rank_agreement, check_in as rank_check_in
from fusion_bridge.build.admission import admit
from fusion_bridge.build.arguments import (
    check_group_membership,
    check_measurements,
    requested_exclusions,
    requested_strategy,
)
from fusion_bridge.call.failure import CallFailures
from fusion_bridge.call.tools import BridgeTools
from fusion_bridge.environment import Environment, default_device, detect
from fusion_bridge.epilogue_tensors import EpilogueInputs, EpilogueOutputs, allocate_outputs
from fusion_bridge.plan.buckets import bucket_index
from fusion_bridge.ranks.process_group import check_process_group
from fusion_bridge.plan.planner import AUTO, Plan, select_for_modes
from fusion_bridge.call.shadow import Shadow
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.strategies.base import CallStage, Strategy
from fusion_bridge.call.validation import (
    EpilogueInputError,
    check_token_limit,
    input_check,
    validate_index_values,
    validate_inputs,
)

_LIVE_BRIDGES: "weakref.WeakSet[FusionBridge]" = weakref.WeakSet()
_LOG = log.get_logger("bridge")


class FusionBridge(CallFailures, BridgeTools):
    """The MoE epilogue for one layer.

    spec: the layer's static EpilogueSpec. group: the TP process group (None: the default group if
    torch.distributed is initialised, else a single process). strategy: "auto" or a registered name.
    device: where the tensors live (default: the current CUDA device, else CPU). environment:
    override
    the detected Environment (tests). self_test / debug: see the module docstring. tuning: "auto"
    uses
    a cached or shipped measurement table on CUDA, "off" the static order; measured_us passes
    CUDA-graph measurements directly ({strategy: {variant: {bucket bound: us}}}) and eager_us eager
    wall times per call (then eager calls may take other routes). shadow: "name" or "name:N".
    build_timeout_s: how long the build waits for every rank to arrive
    (FUSION_BRIDGE_BUILD_TIMEOUT_S). exclude: strategy names kept out of `auto` (with
    FUSION_BRIDGE_EXCLUDE, comma-separated; compared across ranks at build; the report says
    "excluded by request"). Which route a call takes: route_for(T); how many calls each route took:
    route_calls() (also in explain()).
    """

    def __init__(
        self,
        spec: EpilogueSpec,
        group=None,
        strategy: str = AUTO,
        *,
        device: Optional[torch.device] = None,
        environment: Optional[Environment] = None,
        self_test: Optional[bool] = None,
        debug: Optional[bool] = None,
        tuning: str = "auto",
        measured_us: Optional[dict] = None,
        eager_us: Optional[dict] = None,
        shadow: Optional[str] = None,
        build_timeout_s: Optional[float] = None,
        exclude: Sequence[str] = (),
    ) -> None:
        if not isinstance(spec, EpilogueSpec):
            raise TypeError(
                f"FusionBridge: spec must be an EpilogueSpec, got {type(spec).__name__}"
            )
        # everything this rank can check alone, before the first collective (the check-in)
        env_vars.check_all()
        log.configure_once()
        check_group_membership(group)
        check_measurements(measured_us=measured_us, eager_us=eager_us)
        requested = requested_strategy(strategy)
        excluded = requested_exclusions(exclude, requested)
        if tuning not in ("auto", "off"):
            raise ValueError(f"FusionBridge: tuning must be 'auto' or 'off', got {tuning!r}")
        shadow = shadow if shadow is not None else env_vars.read("FUSION_BRIDGE_SHADOW")
        self._shadow = Shadow.parse(shadow, list(registry.REGISTRY)) if shadow else None
        self.spec, self.group, self.requested = spec, group, requested
        self.debug = env_vars.read("FUSION_BRIDGE_DEBUG") if debug is None else debug
        run_self_test = env_vars.read("FUSION_BRIDGE_SELF_TEST") if self_test is None else self_test
        self.device = default_device(device)
        rank_check_in.build_timeout_s(build_timeout_s)  # raises naming the argument or the variable
        check_process_group(group)  # before anything collective: a forgotten init_process_group
        # Ranks check in through the store (no collective, bounded), then agree on every setting
        # that
        # must be equal, before any other collective of the build.
        self.build_index = rank_check_in.check_in(group, timeout_s=build_timeout_s)
        rank_agreement.agree_on_settings(
            {
                "spec": spec.to_dict(),
                "requested_strategy": requested,
                "debug": self.debug,
                "self_test": run_self_test,
                "shadow": self._shadow.to_dict_settings() if self._shadow else None,
                "tuning": tuning,
                "measured_us_given": measured_us is not None,
                "excluded": ",".join(excluded),
                "eager_us_given": eager_us is not None,
            },
            group,
        )
        self.env = environment or detect(group, self.device)
        self._check_values = self.device.type == "cpu" or self.debug  # index range: a sync on GPU
        self._looks_valid = input_check(spec, self.device)
        self._max_tokens = spec.max_tokens
        # eager calls take the eager plan's routes when it differs: is this call being captured? (a
        # CPU-only torch raises on the CUDA query, and nothing captures there)
        self._capturing = (
            torch.cuda.is_current_stream_capturing if self.device.type == "cuda" else bool
        )
        self._agree_each_call = (
            self.debug and self.env.world_size > 1
        )  # one small collective per call
        self.reroutes = 0
        # calls per (strategy, variant, captured?): counted on the host, so a replayed CUDA graph
        # (which never reaches the host) is not counted; its capture is
        self._calls: dict[tuple[str, str, bool], int] = {}
        self.calls = 0  # calls that reached dispatch on this rank (debug mode agrees on it)
        self._closed = False
        self._broken: Optional[str] = None
        admitted = admit(
            spec,
            self.env,
            group,
            self.device,
            requested=requested,
            also_prepare=(self._shadow.strategy,) if self._shadow else (),
            run_self_test=run_self_test,
            excluded=excluded,
        )
        self.statuses, self._instances = admitted.statuses, admitted.instances
        if self.env.world_size > 1:  # the NaN payload a failing call takes part with
            call_protocol.reserve(
                self.device, spec.dtype, spec.hidden_size, spec.top_k, spec.max_tokens
            )
        _LIVE_BRIDGES.add(self)
        try:
            if self._shadow and self._shadow.strategy not in self._instances:
                status = next(s for s in self.statuses if s.name == self._shadow.strategy)
                raise ValueError(
                    f"FusionBridge: shadow strategy {self._shadow.strategy!r} cannot run here: "
                    + "; ".join(f"[{r.code}] {r.message}" for r in status.reasons)
                )
            self.table: Optional[dict] = None
            if measured_us is None and tuning == "auto" and self.device.type == "cuda":
                self.table = tuning_tables.load_table(
                    spec, self.env, group
                )  # collective: rank 0 decides
                if self.table is not None:
                    measured_us = tuning_tables.as_measurements(self.table)
                    eager_us = tuning_tables.as_measurements(self.table, "eager_us")
            self._use_plan(
                select_for_modes(
                    self.statuses,
                    spec,
                    requested,
                    measured_us,
                    eager_us,
                    tuning_tables.margin_of(self.table),
                )
            )
        except Exception:
            self.close()
            raise
        self.name = custom_op.register_bridge(self)
        _LOG.info(self._summary())

    def _use_plan(self, plan: Plan) -> None:
        """Check that every rank will execute the same plan, then bind it to the prepared instances:
        one (instance, variant, checks shapes?) per bucket."""
        if self.env.world_size > 1:
            rank_agreement.agree_on_settings(
                rank_agreement.plan_settings(plan), self.group, what="the plan"
            )
        self.plan = plan
        shape_checked = {
            name: type(inst).accepts is not Strategy.accepts
            for name, inst in self._instances.items()
        }
        self._routes = [
            (self._instances[name], variant, shape_checked[name])
            for name, variant in zip(plan.choice, plan.variants)
        ]
        self._mode_dependent = (
            plan.mode_dependent
        )  # then eager calls (not capturing) take their own routes
        self._eager_routes = (
            [
                (self._instances[name], variant, shape_checked[name])
                for name, variant in zip(plan.eager_choice, plan.eager_variants)
            ]
            if self._mode_dependent
            else self._routes
        )
        self._overflow = (
            (self._instances[plan.overflow], plan.overflow_variant) if plan.overflow else None
        )

    # ---------------------------------------------------------------- call
    def finalize_epilogue(
        self,
        gemm2_out: torch.Tensor,
        expanded_idx_to_permuted_idx: torch.Tensor,
        expert_weights: torch.Tensor,
        shared_output: Optional[torch.Tensor],
        residual: torch.Tensor,
        gamma: torch.Tensor,
    ) -> EpilogueOutputs:
        """Finalize + shared add + all-reduce + residual add + RMSNorm (+ quant), on every rank.

        gemm2_out [P, H] act dtype; expanded_idx_to_permuted_idx [T, K] int32 (-1 = skip);
        expert_weights [T, K] fp32/bf16/fp16; shared_output [T, H] or None (as the spec says);
        residual [T, H]; gamma [H]. Returns EpilogueOutputs (residual_out, norm_out [T, H] act
        dtype;
        quant/scale when the spec quantizes). The inputs are never modified. Collective when world >
        1.
        """
        if self._closed:
            raise RuntimeError("finalize_epilogue: this FusionBridge was closed")
        if (
            torch.compiler.is_compiling()
        ):  # one opaque node in the graph; the op runs this method eagerly
            return custom_op.outputs_from_op(
                self.spec,
                torch.ops.fusion_bridge.finalize_epilogue(
                    gemm2_out,
                    expanded_idx_to_permuted_idx,
                    expert_weights,
                    shared_output,
                    residual,
                    gamma,
                    self.name,
                ),
            )
        inputs = EpilogueInputs(
            gemm2_out, expanded_idx_to_permuted_idx, expert_weights, shared_output, residual, gamma
        )
        if self._broken is not None:
            raise EpilogueInputError(self._broken)
        self.calls += 1
        if self._agree_each_call:
            return self._agreed_call(inputs)
        try:
            if not self._looks_valid(inputs):
                validate_inputs(self.spec, inputs, self.device)  # raises, naming what is wrong
            tokens = residual.shape[0]  # valid inputs: every [T, ...] tensor agrees on T
            if self._check_values:
                validate_index_values(inputs)
            if tokens == 0:  # T is equal on all ranks, so every rank skips the collective together
                return allocate_outputs(self.spec, 0, self.device)
            strategy, variant = self._route(inputs, tokens)
        except Exception as exc:  # noqa: BLE001 - any failure here comes before the collective
            self._take_part_then_raise(inputs, exc)
        return self._run(inputs, strategy, variant)

    __call__ = finalize_epilogue

    def _run(self, inputs: EpilogueInputs, strategy: Strategy, variant: str) -> EpilogueOutputs:
        key = (strategy.name, variant, bool(self._capturing()))
        self._calls[key] = self._calls.get(key, 0) + 1
        strategy.call_stage = CallStage.BEFORE_COLLECTIVE
        try:
            out = strategy.run(inputs, variant)
        except Exception as exc:  # noqa: BLE001 - where it failed decides what keeps the group in step
            stage = strategy.call_stage if strategy.marks_collective else CallStage.IN_COLLECTIVE
            if self.env.world_size == 1 or stage is CallStage.AFTER_COLLECTIVE:
                raise  # the group is in step: this rank's collective ran
            if stage is CallStage.BEFORE_COLLECTIVE:
                self._take_part_then_raise(inputs, exc)
            self._break(exc, f"inside the collective of {strategy.name}")
            raise
        if self._shadow is not None and self._shadow.due():
            self._run_shadow(inputs, out, strategy.name)
        return out

    def _run_shadow(self, inputs: EpilogueInputs, out: EpilogueOutputs, selected: str) -> None:
        errors = self._shadow.record(
            self.spec, out, self._instances[self._shadow.strategy].run(inputs)
        )
        bound = next(s.error_bound for s in self.statuses if s.name == selected)
        worst = max(errors["residual_out"], errors["norm_out"])
        if not worst <= bound:  # NaN too
            log.log_every(
                (self.name, "shadow"),
                60.0,
                logging.WARNING,
                "fusion_bridge: shadow %s diverges from %s at T=%d: rel err %.3g > bound %.3g",
                self._shadow.strategy,
                selected,
                inputs.tokens,
                worst,
                bound,
            )

    def _bucket_route(self, tokens: int) -> tuple[Strategy, str, bool]:
        """(strategy, variant, checks shapes?) this call's mode (eager or captured) plans for 0 < T
        <=
        max_tokens."""
        routes = (
            self._eager_routes if self._mode_dependent and not self._capturing() else self._routes
        )
        return routes[bucket_index(tokens)]

    def _planned_route(self, tokens: int) -> Optional[tuple[Strategy, str]]:
        """(strategy, variant) planned for T before any shape check; the overflow route above
        max_tokens; None when there is none."""
        return self._bucket_route(tokens)[:2] if tokens <= self._max_tokens else self._overflow

    def _route(self, inputs: EpilogueInputs, tokens: int) -> tuple[Strategy, str]:
        """The planned (strategy, variant) for T; T above max_tokens or a shape the bucket's
        strategy
        refuses goes to the overflow route, or raises."""
        if tokens <= self._max_tokens:
            strategy, variant, checks_shape = self._bucket_route(tokens)
            if not checks_shape or strategy.accepts(inputs):
                return strategy, variant
            refused = strategy
        else:
            refused = None
        name = refused.name if refused is not None else self.plan.choice[-1]
        if self._overflow is None or self._overflow[0] is refused:
            check_token_limit(tokens, self._max_tokens, name)
            raise EpilogueInputError(
                f"finalize_epilogue: strategy {name!r} cannot take these inputs "
                f"(gemm2_out has {inputs.gemm2_out.numel()} elements, its kernel "
                "indexes with int32) and no other strategy was selected"
            )
        self.reroutes += 1
        log.log_every(
            (self.name, "reroute"),
            60.0,
            logging.INFO,
            "fusion_bridge: T=%d routed to %s (%s); %d reroutes so far",
            tokens,
            self._overflow[0].name,
            "above max_tokens" if refused is None else f"{name} refused the shapes",
            self.reroutes,
        )
        return self._overflow

    def close(self) -> None:
        """Free workspaces. Idempotent; also runs on leaving `with` and at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        for inst in self._instances.values():
            inst.close()

    def __enter__(self) -> "FusionBridge":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@atexit.register
def _close_all_bridges() -> None:
    from fusion_bridge.strategies import (
        symm_workspace,
    )  # at exit no rank waits for another: no collective in close()

    symm_workspace._EXITING[0] = True
    for bridge in list(_LIVE_BRIDGES):
        bridge.close()
