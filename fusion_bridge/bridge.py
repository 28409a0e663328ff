"""FusionBridge: built once per layer; one `finalize_epilogue` call per forward.

Building it is collective over `group` (every rank builds its bridge in the same order):
static capability checks -> per-rank resource checks -> agreement -> collective prepare (workspaces)
-> self-test against the oracle -> agreement -> plan. A call then validates metadata (no sync) and
dispatches by token bucket in O(1).

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
import dataclasses
import os
import weakref
from typing import Optional

import torch

from . import registry
from . import tuning as tuning_tables
from .agreement import agree_flags, collective_device, other_rank_reason
from .environment import Environment, detect
from .io import EpilogueInputs, EpilogueOutputs
from .planner import AUTO, Plan, StrategyStatus, select
from .reasons import Reason
from .report import Report
from .selftest import agreed_rank, self_test
from .shadow import Shadow, parse_env as parse_shadow_env
from .spec import EpilogueSpec, QuantKind
from .quant_ref import sf_shape
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
    the detected Environment (tests). self_test / debug: see the module docstring.
    """

    def __init__(self, spec: EpilogueSpec, group=None, strategy: str = AUTO, *,
                 device: Optional[torch.device] = None, environment: Optional[Environment] = None,
                 self_test: Optional[bool] = None, debug: Optional[bool] = None,
                 tuning: str = "auto", measured_us: Optional[dict] = None,
                 shadow: Optional[str] = None, shadow_every: int = 100) -> None:
        if not isinstance(spec, EpilogueSpec):
            raise TypeError(f"FusionBridge: spec must be an EpilogueSpec, got {type(spec).__name__}")
        requested = os.environ.get("FUSION_BRIDGE_STRATEGY") or strategy
        if requested != AUTO and requested not in registry.REGISTRY:
            raise ValueError(f"FusionBridge: strategy must be 'auto' or one of {list(registry.REGISTRY)}, "
                             f"got {requested!r}")
        if tuning not in ("auto", "off"):
            raise ValueError(f"FusionBridge: tuning must be 'auto' or 'off', got {tuning!r}")
        self.spec, self.group, self.requested = spec, group, requested
        if shadow is None and os.environ.get("FUSION_BRIDGE_SHADOW"):
            shadow, shadow_every = parse_shadow_env(os.environ["FUSION_BRIDGE_SHADOW"])
        if shadow is not None and shadow not in registry.REGISTRY:
            raise ValueError(f"FusionBridge: shadow must be one of {list(registry.REGISTRY)}, got {shadow!r}")
        self._shadow = Shadow(shadow, shadow_every) if shadow else None
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # compare against the tensors' cuda:N
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.env = environment or detect(group, device)
        self.debug = _env_flag("FUSION_BRIDGE_DEBUG", False) if debug is None else debug
        self._check_values = self.device.type == "cpu" or self.debug  # index range: a sync on GPU
        self._check_tokens = self.debug and self.env.world_size > 1    # T equal on all ranks: a collective
        run_self_test = _env_flag("FUSION_BRIDGE_SELF_TEST", True) if self_test is None else self_test
        self.reroutes = 0
        self._closed = False
        self._instances: dict[str, Strategy] = {}
        self.statuses = self._build_statuses(run_self_test)
        self._max_tokens = spec.max_tokens
        self.table: Optional[dict] = None
        if measured_us is None and tuning == "auto" and self.device.type == "cuda":
            self.table = tuning_tables.load_table(spec, self.env, group)  # collective: rank 0 decides
            if self.table is not None:
                measured_us = tuning_tables.as_measurements(self.table)
        try:
            self._plan_from(measured_us)
        except Exception:
            self.close()
            raise
        _LIVE_BRIDGES.add(self)

    def _plan_from(self, measured_us: Optional[dict]) -> None:
        """Plan per token bucket from measurements (candidate labels may name local_fused sub-paths)."""
        best, subpaths = tuning_tables.per_strategy(measured_us or {})
        self.plan: Plan = select(self.statuses, self.spec, self.requested, best or None)
        local = self._instances.get("local_fused")
        if local is not None and subpaths:
            local.subpath_by_bucket = [subpaths.get(b, "") for b in self.plan.bounds]
            chosen = ", ".join(f"T<={b}: {subpaths[b]}" for b in self.plan.bounds if b in subpaths)
            self.plan = dataclasses.replace(self.plan, notes=self.plan.notes + (
                f"local_fused all-reduce+norm sub-path, measured per bucket: {chosen}",))
        self._by_bucket = [self._instances[name] for name in self.plan.choice]
        self._bucket_checks_shape = [type(s).accepts is not Strategy.accepts for s in self._by_bucket]
        self._overflow = self._instances.get(self.plan.overflow) if self.plan.overflow else None

    # ---------------------------------------------------------------- build
    def _build_statuses(self, run_self_test: bool) -> list[StrategyStatus]:
        classes = registry.strategy_classes()
        reasons: dict[str, list[Reason]] = {c.name: list(c.not_supported_reasons(self.spec, self.env))
                                           for c in classes}
        # Prepare what could be picked: everything available under auto, only the request otherwise.
        # (the oracle always: parity and shadow runs compare against it; it has nothing to prepare)
        shadow = self._shadow.strategy if self._shadow else None
        wanted = [c for c in classes if self.requested in (AUTO, c.name) or not c.auto_selectable
                  or c.name == shadow]
        for cls in wanted:
            if not reasons[cls.name]:
                inst = cls(self.spec, self.env, self.group, self.device)
                reasons[cls.name] += inst.local_resource_reasons()
                if not reasons[cls.name]:
                    self._instances[cls.name] = inst
        self._agree(classes, reasons, "capability or resources")
        for name, inst in list(self._instances.items()):  # same order on every rank: registry order
            try:
                inst.prepare()
            except Exception as exc:
                reasons[name].append(Reason("prepare_failed", f"prepare() raised {type(exc).__name__}: {exc}",
                                            "see the exception; the strategy stays off"))
        self._agree(classes, reasons, "prepare")
        self_tests: dict[str, tuple[str, Optional[float]]] = {}
        rank = agreed_rank(self.group) if self.env.world_size > 1 else 0
        for name, inst in list(self._instances.items()):
            if not (run_self_test and inst.self_tested and self.device.type == "cuda"):
                continue
            result = self_test(inst, self.spec, rank)
            self_tests[name] = ("passed" if result.passed else "failed", result.worst_rel_err)
            if result.reason:
                reasons[name].append(result.reason)
        self._agree(classes, reasons, "self-test")
        statuses = []
        for cls in classes:
            inst = self._instances.get(cls.name)
            test_state, test_err = self_tests.get(cls.name, ("not run", None))
            statuses.append(StrategyStatus.of(cls, self.spec, self.env, reasons[cls.name], test_state, test_err,
                                              inst.workspace_bytes if inst else 0,
                                              inst.instance_steps() if inst else None))
        return statuses

    def _agree(self, classes, reasons: dict[str, list[Reason]], stage: str) -> None:
        """AND each strategy's local 'still usable' flag across ranks; drop and close the rest."""
        if self.env.world_size <= 1:
            flags = [int(not reasons[c.name]) for c in classes]
        else:
            flags = agree_flags([int(not reasons[c.name]) for c in classes], self.group,
                                collective_device(self.group, self.device))
        for cls, ok in zip(classes, flags):
            if not ok and not reasons[cls.name]:
                reasons[cls.name].append(other_rank_reason(stage))
            if not ok and cls.name in self._instances:
                self._instances.pop(cls.name).close()

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
            return self._empty_outputs()
        if tokens <= self._max_tokens:
            bucket = (tokens - 1).bit_length()
            strategy = self._by_bucket[bucket]
            if self._bucket_checks_shape[bucket] and not strategy.accepts(inputs):
                strategy = self._reroute(inputs, strategy)
        else:
            strategy = self._reroute(inputs, None)
        out = strategy.run(inputs)
        if self._shadow is not None and self._shadow.due():
            self._run_shadow(inputs, out)
        return out

    def _run_shadow(self, inputs: EpilogueInputs, out: EpilogueOutputs) -> None:
        name = self._shadow.strategy
        if name not in self._instances:
            raise RuntimeError(f"shadow strategy {name!r} cannot run here: "
                               f"{[r.code for s in self.statuses if s.name == name for r in s.reasons]}")
        self._shadow.record(self.spec, out, self._instances[name].run(inputs))

    __call__ = finalize_epilogue

    def _reroute(self, inputs: EpilogueInputs, refused: Optional[Strategy]) -> Strategy:
        """T above max_tokens, or a shape the bucket's strategy refuses: the overflow path, or an error."""
        name = refused.name if refused is not None else self.plan.choice[-1]
        if self._overflow is None or self._overflow is refused:
            check_token_limit(inputs.tokens, self._max_tokens, name)
            raise EpilogueInputError(f"finalize_epilogue: strategy {name!r} cannot take these inputs "
                                     f"(gemm2_out has {inputs.gemm2_out.numel()} elements, its kernel "
                                     "indexes with int32) and no other strategy was selected")
        self.reroutes += 1
        return self._overflow

    def run_strategy(self, name: str, inputs: EpilogueInputs) -> EpilogueOutputs:
        """Run one prepared strategy by name on validated inputs, whatever the plan says (parity, shadow).
        Collective when world > 1: every rank must call it with the same name."""
        if name not in self._instances:
            raise ValueError(f"run_strategy: strategy must be one of the prepared {list(self._instances)}, "
                             f"got {name!r}")
        validate_inputs(self.spec, inputs, self.device)
        if inputs.tokens == 0:
            return self._empty_outputs()
        check_token_limit(inputs.tokens, self._instances[name].max_tokens_per_call(self.spec, self.env), name)
        return self._instances[name].run(inputs)

    @property
    def prepared(self) -> list[str]:
        return list(self._instances)

    def _empty_outputs(self) -> EpilogueOutputs:
        h, dev = self.spec.hidden_size, self.device
        empty = torch.empty(0, h, dtype=self.spec.dtype, device=dev)
        q = self.spec.quant
        if q.kind is QuantKind.FP8:
            return EpilogueOutputs(empty, empty.clone(), torch.empty(0, h, dtype=torch.float8_e4m3fn, device=dev))
        if q.kind is QuantKind.NVFP4:
            return EpilogueOutputs(empty, empty.clone(), torch.empty(0, h // 2, dtype=torch.uint8, device=dev),
                                   torch.empty(sf_shape(0, h, q.sf_layout), dtype=torch.uint8, device=dev))
        return EpilogueOutputs(empty, empty.clone())

    # ---------------------------------------------------------------- tuning
    def tuning_candidates(self) -> list[tuple[str, object]]:
        """(label, run(inputs)) for every available auto-selectable strategy, one per sub-path."""
        out = []
        for st in self.statuses:
            inst = self._instances.get(st.name)
            if inst is None or not st.available or not st.auto_selectable:
                continue
            subpaths = inst.subpaths() if hasattr(inst, "subpaths") else []
            for sub in subpaths:
                out.append((f"{st.name}{tuning_tables.SUBPATH_SEP}{sub}", _forced(inst, sub)))
            if not subpaths:
                out.append((st.name, inst.run))
        return out

    def tune(self, buckets: Optional[list[int]] = None, progress: bool = True, save: bool = True) -> dict:
        """Measure every candidate per token bucket (CUDA graphs, inputs rotated beyond L2, max over
        ranks), re-plan from the measurements and cache the table (rank 0). Collective."""
        if self.device.type != "cuda":
            raise RuntimeError("tune: needs a CUDA device (it times CUDA graphs); this bridge is on "
                               f"{self.device.type}")
        measured = tuning_tables.measure(self, self.tuning_candidates(), list(buckets or self.plan.bounds),
                                         progress=progress)
        table = {"gpu": self.env.gpu_name, "world_size": self.env.world_size, "spec": tuning_tables.spec_key(self.spec),
                 "versions": {"torch": self.env.torch_version, "triton": self.env.triton_version,
                              "flashinfer": self.env.flashinfer_version},
                 "measured_us": {label: {str(b): us for b, us in per.items()} for label, per in measured.items()}}
        if save and (self.env.world_size == 1 or torch.distributed.get_rank(self.group) == 0):
            path = tuning_tables.cache_path(self.spec, self.env)
            tuning_tables.save_table(table, path)
            table["path"] = str(path)
        self.table = table
        self._plan_from(measured)
        return table

    # ---------------------------------------------------------------- report & lifecycle
    def strategy_for(self, tokens: int) -> Optional[str]:
        return self.plan.strategy_for(tokens) if tokens > 0 else None

    def explain(self, tokens: Optional[int] = None) -> Report:
        """The structured report: environment, every strategy (selected or rejected, with all reasons),
        the plan per token bucket, workspace bytes and reroutes. `.to_dict()`, `.to_json()`, `str()`."""
        return Report(self.env, self.spec, self.statuses, self.plan, tokens=tokens, reroutes=self.reroutes,
                      shadow=self._shadow.to_dict() if self._shadow else None,
                      table=(self.table or {}).get("path"))

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


def _forced(strategy, subpath: str):
    def run(inputs: EpilogueInputs) -> EpilogueOutputs:
        strategy.forced_subpath = subpath
        try:
            return strategy.run(inputs)
        finally:
            strategy.forced_subpath = None
    return run


@atexit.register
def _close_all_bridges() -> None:
    for bridge in list(_LIVE_BRIDGES):
        bridge.close()
