"""Collective admission: which strategies this group may run, agreed by every rank.

capability (static, per rank) -> resources (can this rank allocate?) -> agree -> prepare (collective
workspaces) -> agree -> self-test against the oracle -> agree. Every agreement is one all-reduce MIN
of a 0/1 flag per strategy (MIN of packed bitmasks would not be AND). A strategy that fails
anywhere, on any rank, is off on every rank, with the reasons kept for the report.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from fusion_bridge import log
from fusion_bridge import registry
from fusion_bridge.ranks.process_group import collective_device, my_rank
from fusion_bridge.ranks.agreement import agree_flags, other_rank_reason
from fusion_bridge.environment import Environment
from fusion_bridge.plan.planner import AUTO
from fusion_bridge.plan.status import StrategyStatus
from fusion_bridge.reasons import Reason, excluded_by_request
from fusion_bridge.assembly.selftest import self_test
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.strategies.base import Strategy


@dataclass
class Admission:
    statuses: list[StrategyStatus]  # every registered strategy, in registry order
    instances: dict[str, Strategy]  # the prepared ones, usable on every rank


def admit(
    spec: EpilogueSpec,
    env: Environment,
    group,
    device: torch.device,
    *,
    requested: str,
    also_prepare: tuple[str, ...] = (),
    run_self_test: bool = True,
    excluded: Optional[dict[str, str]] = None,
) -> Admission:
    """Collective. Prepares everything auto may pick (or only the requested strategy), the oracle,
    and `also_prepare` (e.g. the shadow strategy). Opt-in strategies only when requested by name.
    `excluded`: {strategy: where the request came from}, kept out (never prepared)."""
    classes = registry.strategy_classes()
    reasons: dict[str, list[Reason]] = {
        c.name: list(c.not_supported_reasons(spec, env)) for c in classes
    }
    for name, source in (excluded or {}).items():  # kept out of auto by the caller: not prepared
        reasons[name].append(excluded_by_request(name, source))
    wanted = [
        c
        for c in classes
        if (requested == AUTO and not c.opt_in)
        or requested == c.name
        or not c.auto_selectable
        or c.name in also_prepare
    ]
    instances: dict[str, Strategy] = {}
    for cls in wanted:
        if not reasons[cls.name]:
            inst = cls(spec, env, group, device)
            reasons[cls.name] += inst.this_rank_resource_reasons()
            if not reasons[cls.name]:
                instances[cls.name] = inst
    flag_device = collective_device(group, device) if env.world_size > 1 else device
    _agree(classes, reasons, instances, "capability or resources", env, group, flag_device)
    slow = slow_build_notice(
        [n for n, i in instances.items() if i.self_tested], device, run_self_test, my_rank(group)
    )
    if slow:
        log.once("slow build", logging.WARNING, slow)
    for name, inst in list(instances.items()):  # same order on every rank: registry order
        try:
            inst.prepare()
        except Exception as exc:
            reasons[name].append(
                Reason(
                    "prepare_failed",
                    f"prepare() raised {type(exc).__name__}: {exc}",
                    "see the exception; the strategy stays off",
                )
            )
    _agree(classes, reasons, instances, "prepare", env, group, flag_device)
    tests: dict[str, tuple[str, Optional[float]]] = {}
    rank = my_rank(group)
    for name, inst in list(instances.items()):
        if not (run_self_test and inst.self_tested and device.type == "cuda"):
            continue
        result = self_test(inst, spec, rank)
        tests[name] = ("passed" if result.passed else "failed", result.worst_rel_err)
        if result.reason:
            reasons[name].append(result.reason)
    _agree(classes, reasons, instances, "self-test", env, group, flag_device)
    statuses = []
    for cls in classes:
        inst = instances.get(cls.name)
        state, err = tests.get(
            cls.name, (_not_run_why(cls, run_self_test, device, prepared=inst is not None), None)
        )
        statuses.append(
            StrategyStatus.of(
                cls, spec, env, reasons[cls.name], state, err, inst.workspace_bytes if inst else 0
            )
        )
    return Admission(statuses, instances)


def slow_build_notice(
    gpu_strategies: list[str], device: torch.device, run_self_test: bool, rank: int
) -> Optional[str]:
    """The line logged (once per process, at WARNING so a script without logging set up shows it)
    before the build steps that can take minutes the first time: FlashInfer JIT-compiling its
    communication kernels while preparing, and Triton compiling our kernels on the self-test's
    first calls (docs/performance.md has a cold-cache measurement). None on CPU or when no GPU
    strategy is prepared."""
    if device.type != "cuda" or not gpu_strategies:
        return None
    steps = "preparing" + (" and self-testing" if run_self_test else "")
    return (
        f"fusion_bridge: rank {rank}: {steps} {', '.join(gpu_strategies)}. The first build in a "
        "process compiles kernels (FlashInfer's communication kernels, our Triton kernels) unless "
        "they are cached: with cold caches this can take minutes; later builds reuse them."
    )


def _not_run_why(cls, run_self_test: bool, device: torch.device, prepared: bool = True) -> str:
    if not cls.self_tested:
        return "not needed"
    if not run_self_test:
        return "off"
    if device.type != "cuda":
        return "not run (CUDA only)"
    return "not run (opt-in, not requested)" if cls.opt_in and not prepared else "not run"


def _agree(
    classes,
    reasons: dict[str, list[Reason]],
    instances: dict[str, Strategy],
    stage: str,
    env: Environment,
    group,
    flag_device: torch.device,
) -> None:
    """AND each strategy's local 'still usable' flag across ranks; drop and close the rest."""
    local = [int(not reasons[c.name]) for c in classes]
    flags = agree_flags(local, group, flag_device) if env.world_size > 1 else local
    for cls, ok in zip(classes, flags):
        if not ok and not reasons[cls.name]:
            reasons[cls.name].append(other_rank_reason(stage))
        if not ok and cls.name in instances:
            instances.pop(cls.name).close()
