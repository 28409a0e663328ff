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
  FUSION_BRIDGE_SHADOW=name[:N]   shadow mode: run `name` beside the selected strategy every N-th call
                                  and record divergence in explain() (see shadow.py for the cost)
"""

from __future__ import annotations

import atexit
import os
import weakref
from typing import Callable, Optional

import torch

from . import registry
from . import tuning as tuning_tables
from .admission import admit
from .agreement import collective_device
from .environment import Environment, default_device, detect
from .io import EpilogueInputs, EpilogueOutputs, allocate_outputs
from .planner import AUTO, Plan, bucket_index, select
from .report import Report
from .shadow import Shadow
from .spec import EpilogueSpec
from .strategies.base import Strategy
from .validation import (EpilogueInputError, check_token_limit, inputs_look_valid, validate_index_values,
                         validate_inputs, validate_tokens_agree)

_LIVE_BRIDGES: "weakref.WeakSet[FusionBridge]" = weakref.WeakSet()


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() not in ("0", "false", "no", "off", "")


class FusionBridge:
    """The MoE epilogue for one layer.

    spec: the layer's static EpilogueSpec. group: the TP process group (None: the default group if
    torch.distributed is initialised, else a single process). strategy: "auto" or a registered name.
    device: where the tensors live (default: the current CUDA device, else CPU). environment: override
    the detected Environment (tests). self_test / debug: see the module docstring. tuning: "auto" uses
    a cached or shipped measurement table on CUDA, "off" the static order; measured_us passes
    measurements directly ({strategy: {variant: {bucket bound: us}}}). shadow: "name" or "name:N".
    """

    def __init__(self, spec: EpilogueSpec, group=None, strategy: str = AUTO, *,
                 device: Optional[torch.device] = None, environment: Optional[Environment] = None,
                 self_test: Optional[bool] = None, debug: Optional[bool] = None,
                 tuning: str = "auto", measured_us: Optional[dict] = None,
                 shadow: Optional[str] = None) -> None:
        if not isinstance(spec, EpilogueSpec):
            raise TypeError(f"FusionBridge: spec must be an EpilogueSpec, got {type(spec).__name__}")
        requested = os.environ.get("FUSION_BRIDGE_STRATEGY") or strategy
        if requested != AUTO and requested not in registry.REGISTRY:
            raise ValueError(f"FusionBridge: strategy must be 'auto' or one of {list(registry.REGISTRY)}, "
                             f"got {requested!r}")
        if tuning not in ("auto", "off"):
            raise ValueError(f"FusionBridge: tuning must be 'auto' or 'off', got {tuning!r}")
        shadow = shadow if shadow is not None else os.environ.get("FUSION_BRIDGE_SHADOW") or None
        self._shadow = Shadow.parse(shadow, list(registry.REGISTRY)) if shadow else None
        self.spec, self.group, self.requested = spec, group, requested
        self.device = default_device(device)
        self.env = environment or detect(group, self.device)
        self.debug = _env_flag("FUSION_BRIDGE_DEBUG", False) if debug is None else debug
        self._check_values = self.device.type == "cpu" or self.debug  # index range: a sync on GPU
        self._check_tokens = self.debug and self.env.world_size > 1    # T equal on all ranks: a collective
        self.reroutes = 0
        self._closed = False
        admitted = admit(spec, self.env, group, self.device, requested=requested,
                         also_prepare=(self._shadow.strategy,) if self._shadow else (),
                         run_self_test=_env_flag("FUSION_BRIDGE_SELF_TEST", True) if self_test is None else self_test)
        self.statuses, self._instances = admitted.statuses, admitted.instances
        _LIVE_BRIDGES.add(self)
        try:
            if self._shadow and self._shadow.strategy not in self._instances:
                status = next(s for s in self.statuses if s.name == self._shadow.strategy)
                raise ValueError(f"FusionBridge: shadow strategy {self._shadow.strategy!r} cannot run here: "
                                 + "; ".join(f"[{r.code}] {r.message}" for r in status.reasons))
            self.table: Optional[dict] = None
            if measured_us is None and tuning == "auto" and self.device.type == "cuda":
                self.table = tuning_tables.load_table(spec, self.env, group)  # collective: rank 0 decides
                if self.table is not None:
                    measured_us = tuning_tables.as_measurements(self.table)
            self._use_plan(select(self.statuses, spec, requested, measured_us))
        except Exception:
            self.close()
            raise

    def _use_plan(self, plan: Plan) -> None:
        """Bind the plan to the prepared instances: one (instance, variant, checks shapes?) per bucket."""
        self.plan = plan
        shape_checked = {name: type(inst).accepts is not Strategy.accepts for name, inst in self._instances.items()}
        self._routes = [(self._instances[name], variant, shape_checked[name])
                        for name, variant in zip(plan.choice, plan.variants)]
        self._overflow = ((self._instances[plan.overflow], plan.overflow_variant) if plan.overflow else None)
        self._max_tokens = self.spec.max_tokens

    # ---------------------------------------------------------------- call
    def finalize_epilogue(self, gemm2_out: torch.Tensor, expanded_idx_to_permuted_idx: torch.Tensor,
                          expert_weights: torch.Tensor, shared_output: Optional[torch.Tensor],
                          residual: torch.Tensor, gamma: torch.Tensor) -> EpilogueOutputs:
        """Finalize + shared add + all-reduce + residual add + RMSNorm (+ quant), on every rank.

        gemm2_out [P, H] act dtype; expanded_idx_to_permuted_idx [T, K] int32 (-1 = skip);
        expert_weights [T, K] fp32/bf16/fp16; shared_output [T, H] or None (as the spec says);
        residual [T, H]; gamma [H]. Returns EpilogueOutputs (residual_out, norm_out [T, H] act dtype;
        quant/scale when the spec quantizes). The inputs are never modified. Collective when world > 1.
        """
        if self._closed:
            raise RuntimeError("finalize_epilogue: this FusionBridge was closed")
        inputs = EpilogueInputs(gemm2_out, expanded_idx_to_permuted_idx, expert_weights, shared_output,
                                residual, gamma)
        if not inputs_look_valid(self.spec, inputs, self.device):
            validate_inputs(self.spec, inputs, self.device)  # raises, naming what is wrong
        tokens = expanded_idx_to_permuted_idx.shape[0]
        if self._check_values:
            validate_index_values(inputs)
        if self._check_tokens:
            validate_tokens_agree(tokens, self.group, collective_device(self.group, self.device))
        if tokens == 0:  # T is equal on all ranks, so every rank skips the collective together
            return allocate_outputs(self.spec, 0, self.device)
        strategy, variant = self._route(inputs, tokens)
        out = strategy.run(inputs, variant)
        if self._shadow is not None and self._shadow.due():
            self._shadow.record(self.spec, out, self._instances[self._shadow.strategy].run(inputs))
        return out

    __call__ = finalize_epilogue

    def _route(self, inputs: EpilogueInputs, tokens: int) -> tuple[Strategy, str]:
        """The planned (strategy, variant) for T; T above max_tokens or a shape the bucket's strategy
        refuses goes to the overflow route, or raises."""
        if tokens <= self._max_tokens:
            strategy, variant, checks_shape = self._routes[bucket_index(tokens)]
            if not checks_shape or strategy.accepts(inputs):
                return strategy, variant
            refused = strategy
        else:
            refused = None
        name = refused.name if refused is not None else self.plan.choice[-1]
        if self._overflow is None or self._overflow[0] is refused:
            check_token_limit(tokens, self._max_tokens, name)
            raise EpilogueInputError(f"finalize_epilogue: strategy {name!r} cannot take these inputs "
                                     f"(gemm2_out has {inputs.gemm2_out.numel()} elements, its kernel "
                                     "indexes with int32) and no other strategy was selected")
        self.reroutes += 1
        return self._overflow

    # ---------------------------------------------------------------- tools (parity, tuning, benchmarks)
    def run_strategy(self, name: str, inputs: EpilogueInputs, variant: Optional[str] = None) -> EpilogueOutputs:
        """Run one prepared strategy by name (its planned variant for this T unless given), whatever the
        plan says. Validates the inputs. Collective when world > 1: every rank calls it with the same name."""
        if name not in self._instances:
            raise ValueError(f"run_strategy: strategy must be one of the prepared {list(self._instances)}, "
                             f"got {name!r}")
        validate_inputs(self.spec, inputs, self.device)
        if inputs.tokens == 0:
            return allocate_outputs(self.spec, 0, self.device)
        inst = self._instances[name]
        check_token_limit(inputs.tokens, inst.max_tokens_per_call(self.spec, self.env), name)
        status = next(s for s in self.statuses if s.name == name)
        if variant is None:
            variant = status.variant_for(bucket_index(inputs.tokens))
        elif variant not in status.variants:
            raise ValueError(f"run_strategy: variant of {name!r} must be one of {list(status.variants)}, "
                             f"got {variant!r}")
        return inst.run(inputs, variant)

    def selected_run(self, tokens: int) -> Callable[[EpilogueInputs], EpilogueOutputs]:
        """The planned strategy's own run for T tokens, without the bridge's validation and dispatch
        (what host-overhead benchmarks compare finalize_epilogue with)."""
        route = self.plan.route_for(tokens)
        if route is None:
            raise ValueError(f"selected_run: no route for T={tokens} (max_tokens={self.spec.max_tokens})")
        inst, variant = self._instances[route[0]], route[1]
        return lambda inputs: inst.run(inputs, variant)

    def tuning_candidates(self) -> list[tuple[str, str, Callable]]:
        """(strategy, variant, run(inputs, variant)) for every available auto-selectable strategy and
        each of its launch variants: what `tune` measures."""
        return [(st.name, variant, self._instances[st.name].run) for st in self.statuses
                if st.available and st.auto_selectable and st.name in self._instances for variant in st.variants]

    def tune(self, buckets: Optional[list[int]] = None, progress: bool = True, save: bool = True) -> dict:
        """Measure every (strategy, variant) per token bucket (CUDA graphs, inputs rotated beyond L2, max
        over ranks), re-plan from the measurements and cache the table (rank 0). Collective."""
        if self.device.type != "cuda":
            raise RuntimeError("tune: needs a CUDA device (it times CUDA graphs); this bridge is on "
                               f"{self.device.type}")
        measured = tuning_tables.measure(self.spec, self.env, self.group, self.device, self.tuning_candidates(),
                                         list(buckets or self.plan.bounds), progress=progress)
        table = tuning_tables.make_table(self.spec, self.env, measured)
        if save and (self.env.world_size == 1 or torch.distributed.get_rank(self.group) == 0):
            path = tuning_tables.cache_path(self.spec, self.env)
            tuning_tables.save_table(table, path)
            table["path"] = str(path)
        self.table = table
        self._use_plan(select(self.statuses, self.spec, self.requested, measured))
        return table

    # ---------------------------------------------------------------- report & lifecycle
    def strategy_for(self, tokens: int) -> Optional[str]:
        return self.plan.strategy_for(tokens) if tokens > 0 else None

    def route_for(self, tokens: int) -> Optional[tuple[str, str]]:
        """(strategy, variant) a call with T tokens runs, or None (T == 0, or no route above max_tokens)."""
        return self.plan.route_for(tokens) if tokens > 0 else None

    def explain(self, tokens: Optional[int] = None) -> Report:
        """The structured report: environment, every strategy (selected or rejected, with all reasons),
        the plan per token bucket, workspace bytes and reroutes. `.to_dict()`, `.to_json()`, `str()`."""
        return Report(self.env, self.spec, self.statuses, self.plan, tokens=tokens, reroutes=self.reroutes,
                      shadow=self._shadow.to_dict() if self._shadow else None,
                      table=(self.table or {}).get("path"))

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


@atexit.register
def _close_all_bridges() -> None:
    for bridge in list(_LIVE_BRIDGES):
        bridge.close()
