"""FusionBridge: built once per layer; one `finalize_epilogue` call per forward.

Building it is collective over `group` (every rank builds its bridge in the same order); that is
assembly/build.py, returning the BuiltBridge the bridge keeps. A call validates metadata (no sync)
and dispatches by token bucket in O(1) to the planned (strategy, launch variant): that hot path is
this module. When one rank's call fails: call/failure.py; one strategy run directly (parity,
benchmarks): call/direct.py; tuning and the reports: call/tools.py.

Its environment variables (FUSION_BRIDGE_STRATEGY, _DEBUG, _SHADOW, _EXCLUDE, ...) are read and
checked in env_vars.py, which says what each changes.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Optional, Sequence

import torch

from fusion_bridge import log
from fusion_bridge.assembly.build import build_bridge, close_instances
from fusion_bridge.call import custom_op, failure, one_caller, out_check, tools
from fusion_bridge.call import routes as call_routes
from fusion_bridge.call.bridge_tools import BridgeTools
from fusion_bridge.call.debug_call import CallAgreement
from fusion_bridge.call.shared_once import shared_once
from fusion_bridge.call.failure_path import _DONE, _IDLE, _REFUSED, FailurePath
from fusion_bridge.call.validation import (
    EpilogueInputError,
    input_check,
    validate_index_values,
    validate_inputs,
)
from fusion_bridge.environment import Environment
from fusion_bridge.epilogue_tensors import EpilogueInputs, EpilogueOutputs, outputs_for
from fusion_bridge.plan.buckets import bucket_index
from fusion_bridge.plan.planner import AUTO
from fusion_bridge.plan.report import Report
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.strategies.base import CallStage, Strategy

_LIVE_BRIDGES: "weakref.WeakSet[FusionBridge]" = weakref.WeakSet()
_LOG = log.get_logger("bridge")


class FusionBridge(FailurePath, BridgeTools):
    """The MoE epilogue for one layer.

    spec: the layer's static EpilogueSpec. group: the TP process group (None: the default group if
    torch.distributed is initialised, else a single process). strategy: "auto" or a registered name.
    device: where the tensors live (default: the current CUDA device, else CPU). environment:
    override the detected Environment (tests). self_test / debug: see the module docstring.
    tuning: "auto" uses a cached or shipped measurement table on CUDA, "off" the static order;
    measured_us passes CUDA-graph measurements directly ({strategy: {variant: {bucket bound: us}}})
    and eager_us eager wall times per call (then eager calls may take other routes). shadow: "name"
    or "name:N". build_timeout_s: how long the build waits for every rank to arrive
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
        built = build_bridge(
            spec,
            group,
            strategy,
            device=device,
            environment=environment,
            self_test=self_test,
            debug=debug,
            tuning=tuning,
            measured_us=measured_us,
            eager_us=eager_us,
            shadow=shadow,
            build_timeout_s=build_timeout_s,
            exclude=exclude,
        )
        self.spec, self.group, self.requested = built.spec, built.group, built.requested
        self.debug, self.device, self.env = built.debug, built.device, built.env
        self.build_index, self.statuses, self.table = built.build_index, built.statuses, built.table
        self._instances, self._shadow = built.instances, built.shadow
        self._use_routes(built.routes)
        # the call path's own state: what every call checks, and its counters
        self._check_values = self.device.type == "cpu" or self.debug  # index range: a sync on GPU
        self._looks_valid = input_check(self.spec, self.device)
        self._out_looks_valid = out_check.output_check(self.spec, self.device)  # out=: the same
        self._max_tokens = self.spec.max_tokens
        # a replicated shared output is added once: zeros in its place off rank 0 (None: as given)
        self._shared_once = shared_once(self.spec, self.group, self.env.world_size, self.device)
        # eager calls take the eager plan's routes when it differs: is this call being captured? (a
        # CPU-only torch raises on the CUDA query, and nothing captures there)
        self._capturing = (  # torch.cuda.is_current_stream_capturing's own query, unwrapped
            torch._C._cuda_isCurrentStreamCapturing if self.device.type == "cuda" else bool
        )
        # debug mode over several ranks: one small collective per call (call/debug_call.py)
        self._agreement = (
            CallAgreement(self.spec, self.device, self.group, self.build_index)
            if self.debug and self.env.world_size > 1
            else None
        )
        self.reroutes = 0
        # calls per (strategy, variant, captured?): counted on the host, so a replayed CUDA graph
        # (which never reaches the host) is not counted; its capture is
        self._calls: dict[tuple[str, str, bool], int] = {}
        self.calls = 0  # calls made on this rank, failed ones included (debug mode agrees on it)
        # where the call in progress stands, for its failure path (finalize_epilogue)
        self._running: object = _IDLE
        self._group_key = one_caller.group_key(self.group, self.env.world_size, self)
        self._closed = False
        self._broken: Optional[str] = None
        _LIVE_BRIDGES.add(self)
        self.name = custom_op.register_bridge(self)
        _LOG.info(tools.summary(self.spec, self.env, self.statuses, self.plan))

    def _use_routes(self, routes: call_routes.Routes) -> None:
        """Dispatch by `routes` from now on (a plan agreed by every rank, bound: call/routes.py)."""
        self.plan = routes.plan
        self._routes, self._eager_routes = routes.graph, routes.eager
        self._mode_dependent = routes.mode_dependent  # then eager calls take their own routes
        self._overflow = routes.overflow

    # ---------------------------------------------------------------- call
    def finalize_epilogue(
        self,
        gemm2_out: torch.Tensor,
        expanded_idx_to_permuted_idx: torch.Tensor,
        expert_weights: torch.Tensor,
        shared_output: Optional[torch.Tensor],
        residual: torch.Tensor,
        gamma: torch.Tensor,
        *,
        out: Optional[EpilogueOutputs] = None,
    ) -> EpilogueOutputs:
        """Finalize + shared add + all-reduce + residual add + RMSNorm (+ quant), on every rank.

        gemm2_out [P, H] act dtype; expanded_idx_to_permuted_idx [T, K] int32 (-1 = skip);
        expert_weights [T, K] fp32/bf16/fp16; shared_output [T, H] or None (as the spec says);
        residual [T, H]; gamma [H]. Returns EpilogueOutputs (residual_out, norm_out [T, H] act
        dtype; quant/scale when the spec quantizes; unpacks as `norm_out, residual_out`). The
        inputs are never modified. Collective when world > 1.

        out: preallocated outputs, or None (allocated per call). An EpilogueOutputs of exactly this
        call's (`allocate_outputs(spec, T, device)` makes one): shapes, dtypes, device, contiguous,
        quant/scale where the spec quantizes and None where it does not; no tensor of it may share
        memory with an input (residual_out over residual is refused) or with another of its own.
        Checked from metadata (no sync); every route writes into it with no output allocation
        (capture-safe), and the call returns `out` itself. Under torch.compile the op's outputs are
        copied into it (the overlap check needs real tensors and is skipped there). When the call
        raises, `out` holds no result: untouched, partly written, or (its route's collective having
        run) NaN rows; read it only after a call that returned. A peer whose rank failed returns
        normally with NaN rows in its `out` (call/failure.py).

        Every line of it runs inside the one `try` (the first statement): whatever leaves any of
        them, an interrupt raised by a signal handler included, goes to `_call_failed`, which keeps
        the group in step (call/failure.py). One thread's call at a time per process group
        (call/one_caller.py).
        """
        try:  # the first statement: see the docstring
            try:
                if torch.compiler.is_compiling():  # one opaque graph node; the op runs it eagerly
                    return out_check.compiled_call(
                        self.spec,
                        self.name,
                        out,
                        (gemm2_out, expanded_idx_to_permuted_idx, expert_weights),
                        (shared_output, residual, gamma),
                    )
                one_caller.enter(self)
                # one statement of plain stores: no interrupt lands between them
                previous, self._running, self.calls = self._running, None, self.calls + 1
                inputs = EpilogueInputs(
                    gemm2_out,
                    expanded_idx_to_permuted_idx,
                    expert_weights,
                    shared_output,
                    residual,
                    gamma,
                )
                if previous is not _DONE and previous is not _IDLE:
                    self._break_unfinished(previous)
                if self._broken is not None:
                    self._running = _REFUSED
                    raise EpilogueInputError(self._broken)
                if self._agreement is not None:
                    out = self._agreed_call(inputs, out)
                else:
                    out = self._default_call(inputs, residual, out)
                if self._broken is not None and self.env.world_size > 1:
                    self._running = _REFUSED  # a refusal came during the call (one_caller.py)
                    raise EpilogueInputError(self._broken)
                self._running = _DONE  # and nothing that can be interrupted until the return
                return out
            except BaseException as exc:  # noqa: BLE001 - every failure keeps the group in step
                self._call_failed(
                    exc,
                    EpilogueInputs(
                        gemm2_out,
                        expanded_idx_to_permuted_idx,
                        expert_weights,
                        shared_output,
                        residual,
                        gamma,
                    ),
                )
        finally:
            one_caller.leave(self)

    __call__ = finalize_epilogue

    def _default_call(self, inputs: EpilogueInputs, residual, out) -> EpilogueOutputs:
        """The call without debug mode: checks with no sync (and the index range on CPU), route,
        run into `out` (None: allocated). Raises whatever fails; the failure path handles it."""
        if self._closed:  # a failure like any other: this rank still takes part
            raise failure.BridgeClosedError("finalize_epilogue: this FusionBridge was closed")
        if not self._looks_valid(inputs):
            validate_inputs(self.spec, inputs, self.device)  # raises, naming what is wrong
        tokens = residual.shape[0]  # valid inputs: every [T, ...] tensor agrees on T
        if out is not None and not self._out_looks_valid(inputs, out, tokens):
            out_check.validate_out(self.spec, inputs, out, tokens, self.device)
        if self._check_values:
            validate_index_values(inputs)
        if tokens == 0:  # T is equal on all ranks, so every rank skips the collective together
            return outputs_for(self.spec, 0, self.device, out)
        if self._shared_once is not None:
            inputs = self._shared_once(inputs, tokens)
        strategy, variant = self._route(inputs, tokens)
        return self._run(inputs, strategy, variant, out)

    def _run(self, inputs: EpilogueInputs, strategy: Strategy, variant: str, out=None):
        strategy.call_stage = CallStage.BEFORE_COLLECTIVE
        self._running = (strategy, variant, True)  # from here, its stage says where a failure is
        key = (strategy.name, variant, bool(self._capturing()))
        self._calls[key] = self._calls.get(key, 0) + 1
        if out is None:  # run_into's own two common cases, without its frame
            out = strategy.run(inputs, variant)
        elif out_check.TAKES_OUT.get(type(strategy)):
            out = strategy.run(inputs, variant, out=out)
        else:  # a class not seen yet, or a run without `out`: its outputs copied into `out`
            out = out_check.run_into(strategy, inputs, variant, out)
        if self._shadow is not None and self._shadow.due():
            shadow = self._instances[self._shadow.strategy]
            shadow.call_stage = CallStage.BEFORE_COLLECTIVE
            self._running = (shadow, None, False)
            self._shadow.run_beside(
                self.spec, inputs, out, strategy.name, self._instances, self.statuses, self.name
            )
        return out

    def _bucket_route(self, tokens: int) -> tuple[Strategy, str, bool]:
        """(strategy, variant, checks shapes?) this call's mode (eager or captured) plans for
        0 < T <= max_tokens."""
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
        strategy refuses goes to the overflow route, or raises."""
        if tokens <= self._max_tokens:
            strategy, variant, checks_shape = self._bucket_route(tokens)
            if not checks_shape or strategy.accepts(inputs):
                return strategy, variant
            refused = strategy
        else:
            refused = None
        route = call_routes.overflow_route(  # raises when there is none
            inputs, tokens, refused, self._overflow, self._max_tokens, self.plan.choice[-1]
        )
        self.reroutes += 1
        call_routes.log_reroute(self.name, tokens, route[0], refused, self.reroutes)
        return route

    def _break(self, error: BaseException, where: str) -> None:
        message = failure.broken_message(self.calls, error, where)
        failure.break_group(list(_LIVE_BRIDGES), self, message)

    def _agreed_call(self, inputs: EpilogueInputs, out) -> EpilogueOutputs:
        """Debug mode over several ranks: every rank checks (`out` before the agreement, when the
        inputs pass: invalid inputs fail in it on every rank), then all agree, then run (or all
        raise the same error)."""
        if out is not None and self._looks_valid(inputs):
            out_check.validate_out(self.spec, inputs, out, inputs.tokens, self.device)
        route = self._agreement.agree(inputs, self.calls, self._route, self._closed)
        if route is None:
            return outputs_for(self.spec, 0, self.device, out)
        if self._shared_once is not None:
            inputs = self._shared_once(inputs, inputs.tokens)
        return self._run(inputs, *route, out)

    # ---------------------------------------------------------------- report (call/tools.py)
    def strategy_for(self, tokens: int) -> Optional[str]:
        """The strategy a call with T tokens runs under CUDA graphs, or None (T == 0, no route)."""
        return call_routes.strategy_for(self.plan, tokens)

    def route_for(self, tokens: int, eager: bool = False) -> Optional[tuple[str, str]]:
        """(strategy, variant) a call with T tokens runs under CUDA graphs (eager=True: outside
        capture), or None (T == 0, or no route above max_tokens)."""
        return call_routes.route_for(self.plan, tokens, eager)

    def explain(self, tokens: Optional[int] = None) -> Report:
        """The structured report: environment, every strategy (selected or rejected, with all
        reasons), the plan per token bucket, workspace bytes and reroutes; with `tokens`, the
        route for that T. `.to_dict()`, `.to_json()`, `str()`."""
        return tools.report(
            spec=self.spec,
            env=self.env,
            statuses=self.statuses,
            plan=self.plan,
            tokens=None if tokens is None else call_routes.token_count(tokens, "explain"),
            reroutes=self.reroutes,
            shadow=self._shadow,
            table=self.table,
            calls=self._calls,
        )

    def route_calls(self) -> list[dict]:
        """Calls per route so far: [{strategy, variant, eager, captured}], eager = calls outside
        CUDA-graph capture, captured = calls made while a graph was being captured. A replay of a
        captured graph runs on the GPU without reaching the host, so replays are not counted."""
        return tools.route_calls(self._calls)

    @property
    def prepared(self) -> list[str]:
        """Names of the prepared strategies (usable on every rank), in registry order."""
        return list(self._instances)

    @property
    def workspace_bytes(self) -> int:
        """Bytes of workspace the prepared strategies hold on this rank."""
        return tools.workspace_bytes(self._instances)

    def close(self) -> None:
        """Free workspaces. Idempotent; also runs on leaving `with` and at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        close_instances(self._instances)

    def __enter__(self) -> "FusionBridge":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@atexit.register
def _close_all_bridges() -> None:
    # at exit no rank waits for another: no collective in close()
    from fusion_bridge.strategies import symm_workspace

    symm_workspace._EXITING[0] = True
    for bridge in list(_LIVE_BRIDGES):
        bridge.close()
