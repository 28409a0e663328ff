"""FusionBridge: built once per layer; one `finalize_epilogue` call per forward.

Building it is collective over `group` (every rank builds its bridge in the same order): admission
(capabilities, resources, workspaces, self-test, each agreed across ranks; admission.py), then the
plan (planner.select over the agreed statuses and rank 0's measurements). A call validates metadata
(no sync) and dispatches by token bucket in O(1) to the planned (strategy, launch variant).

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
from typing import Callable, Optional, Sequence

import torch

from . import call_protocol, custom_op, env_vars, log, registry, table_format
from . import tuning as tuning_tables
from . import rank_agreement
from .admission import admit
from .environment import Environment, default_device, detect
from .epilogue_tensors import EpilogueInputs, EpilogueOutputs, allocate_outputs
from .process_group import check_process_group, collective_device
from .buckets import bucket_index, tokens_text
from .planner import AUTO, Plan, check_exclusions, select_for_modes
from .report import Report
from .shadow import Shadow
from .spec import EpilogueSpec
from .strategies.base import CallStage, Strategy
from .validation import (
    EpilogueInputError,
    check_token_limit,
    input_check,
    validate_index_values,
    validate_inputs,
)

_LIVE_BRIDGES: "weakref.WeakSet[FusionBridge]" = weakref.WeakSet()
_LOG = log.get_logger("bridge")


def _check_group_membership(group) -> None:
    """A rank outside `group` cannot take part in its collectives (torch would answer -100)."""
    if group is None or not (
        torch.distributed.is_available() and torch.distributed.is_initialized()
    ):
        return
    if torch.distributed.get_rank(group) < 0:
        raise ValueError(
            f"FusionBridge: group must be a process group this process belongs to; global rank "
            f"{torch.distributed.get_rank()} is not one of its ranks "
            f"{torch.distributed.get_process_group_ranks(group)}"
        )


class FusionBridge:
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
        _check_group_membership(group)
        for name, given in (("measured_us", measured_us), ("eager_us", eager_us)):
            problem = None if given is None else table_format.measurements_problem(given, name)
            if problem:
                raise ValueError(f"FusionBridge: {problem}")
        env_strategy = env_vars.read("FUSION_BRIDGE_STRATEGY")
        requested = env_strategy or strategy
        if requested != AUTO and requested not in registry.REGISTRY:
            source = "FUSION_BRIDGE_STRATEGY" if env_strategy else "strategy"
            raise ValueError(
                f"FusionBridge: {source} must be 'auto' or one of {list(registry.REGISTRY)}, "
                f"got {requested!r}"
            )
        excluded = _exclusions(exclude, requested)
        if tuning not in ("auto", "off"):
            raise ValueError(f"FusionBridge: tuning must be 'auto' or 'off', got {tuning!r}")
        shadow = shadow if shadow is not None else env_vars.read("FUSION_BRIDGE_SHADOW")
        self._shadow = Shadow.parse(shadow, list(registry.REGISTRY)) if shadow else None
        self.spec, self.group, self.requested = spec, group, requested
        self.debug = env_vars.read("FUSION_BRIDGE_DEBUG") if debug is None else debug
        run_self_test = env_vars.read("FUSION_BRIDGE_SELF_TEST") if self_test is None else self_test
        self.device = default_device(device)
        rank_agreement.build_timeout_s(
            build_timeout_s
        )  # raises naming the argument or the variable
        check_process_group(group)  # before anything collective: a forgotten init_process_group
        # Ranks check in through the store (no collective, bounded), then agree on every setting
        # that
        # must be equal, before any other collective of the build.
        self.build_index = rank_agreement.check_in(group, timeout_s=build_timeout_s)
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

    def _take_part_then_raise(self, inputs: EpilogueInputs, error: BaseException) -> None:
        """This rank's call failed before its collective, but its peers are already in (or on their
        way to) the call's collectives. Run the launches and collectives they run for the group's T,
        on a NaN payload, so the group stays in step and the peers get NaN outputs; then raise the
        original error. If T is unreadable or has no route, this rank cannot take part: the bridge
        refuses every later call (call_protocol.broken_message says what recovers)."""
        tokens = call_protocol.group_tokens(inputs)
        if self.env.world_size == 1 or tokens == 0:
            raise error
        route = self._planned_route(tokens) if tokens is not None else None
        if route is None:
            where = (
                "before its collective, and none of its [T, ...] inputs is a 2-D tensor, so it "
                "cannot tell the group's T"
                if tokens is None
                else f"before its collective, and T={tokens} has no route"
            )
            self._break(error, where)
            raise EpilogueInputError(self._broken) from error
        spec = self.spec
        try:
            poison = call_protocol.nan_payload(
                self.device,
                spec.dtype,
                spec.hidden_size,
                spec.top_k,
                tokens,
                spec.has_shared_output,
            )
            route[0].call_stage = CallStage.BEFORE_COLLECTIVE
            route[0].run(poison, route[1])
            if self._shadow is not None and self._shadow.due():  # the peers sample this call too
                self._instances[self._shadow.strategy].run(poison)
        except Exception as exc:  # noqa: BLE001 - reported with the original error
            self._break(
                error, f"before its collective; taking part with a NaN payload failed too ({exc!r})"
            )
            raise EpilogueInputError(self._broken) from error
        call_protocol.add_note(
            error,
            f"fusion_bridge: this rank took part in call {self.calls} with a NaN payload of "
            f"T={tokens}, so its peers got NaN outputs and the next call is in step",
        )
        raise error

    def _break(self, error: BaseException, where: str) -> None:
        self._broken = call_protocol.broken_message(self.calls, error, where)

    def _agreed_call(self, inputs: EpilogueInputs) -> EpilogueOutputs:
        """Debug mode over several ranks: local checks (index range included), then one small
        collective on (ok, T, call number) before the epilogue's collectives; if any rank failed,
        T differs or a rank is on another call, every rank raises the same error."""
        tokens = call_protocol.group_tokens(inputs)
        error, route = None, None
        try:
            validate_inputs(self.spec, inputs, self.device)
            validate_index_values(inputs)
            if tokens:
                route = self._route(inputs, tokens)
        except Exception as exc:  # noqa: BLE001 - every rank learns it below
            error = exc
        rank_agreement.agree_call(
            error is None,
            -1 if tokens is None else tokens,
            None if error is None else f"{type(error).__name__}: {error}",
            self.group,
            collective_device(self.group, self.device),
            call=self.calls,
            bridge=self.build_index,
            fingerprint=call_protocol.replicated_fingerprint(inputs) if error is None else 0,
        )
        if not tokens:
            return allocate_outputs(self.spec, 0, self.device)
        return self._run(inputs, *route)

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

    # ---------------------------------------------------------------- tools (parity, tuning,
    # benchmarks)
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

    # ---------------------------------------------------------------- report & lifecycle
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


EXCLUDE_ENV = "FUSION_BRIDGE_EXCLUDE"


def _exclusions(exclude: Sequence[str], requested: str) -> dict[str, str]:
    """{strategy to keep out of auto: where the request came from}, validated: the `exclude`
    argument and FUSION_BRIDGE_EXCLUDE (comma-separated, read through env_vars) together."""
    if isinstance(exclude, str):
        raise ValueError(f"FusionBridge: exclude must be a list of strategy names, got {exclude!r}")
    from_env = list(env_vars.read(EXCLUDE_ENV))
    known = list(registry.REGISTRY)
    out = dict.fromkeys(check_exclusions(from_env, known, requested, EXCLUDE_ENV), EXCLUDE_ENV)
    out.update(
        dict.fromkeys(check_exclusions(list(exclude), known, requested, "exclude"), "exclude")
    )
    return dict(sorted(out.items()))


@atexit.register
def _close_all_bridges() -> None:
    from .strategies import (
        symm_workspace,
    )  # at exit no rank waits for another: no collective in close()

    symm_workspace._EXITING[0] = True
    for bridge in list(_LIVE_BRIDGES):
        bridge.close()
