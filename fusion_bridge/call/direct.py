"""Running one prepared strategy directly, around the bridge's plan: what parity checks and
benchmarks compare against `finalize_epilogue` (FusionBridge.run_strategy and .selected_run
delegate here)."""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch

from fusion_bridge.call.routes import route_for
from fusion_bridge.call.validation import check_token_limit, validate_inputs
from fusion_bridge.environment import Environment
from fusion_bridge.call.shared_once import SharedOnce
from fusion_bridge.epilogue_tensors import EpilogueInputs, EpilogueOutputs, allocate_outputs
from fusion_bridge.plan.buckets import bucket_index, tokens_text
from fusion_bridge.plan.planner import Plan
from fusion_bridge.plan.status import StrategyStatus
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.strategies.base import Strategy


def run_strategy(
    name: str,
    inputs: EpilogueInputs,
    variant: Optional[str],
    *,
    spec: EpilogueSpec,
    env: Environment,
    device: torch.device,
    instances: Mapping[str, Strategy],
    statuses: Sequence[StrategyStatus],
    shared_once: Optional[SharedOnce] = None,
) -> EpilogueOutputs:
    """Run the prepared strategy `name` (one of `instances`) on `inputs`, with `variant` or, when
    None, its status's variant for this T's bucket, whatever the plan says. Validates the inputs
    against `spec` and `device`, the token limit of the strategy's workspace and the variant's
    token range; raises ValueError (EpilogueInputError for the inputs) naming what is wrong.
    Collective when the world size is above 1: every rank calls it with the same name. shared_once:
    the bridge's (call/shared_once.py), so a replicated shared output is added once here too."""
    if name not in instances:
        raise ValueError(
            f"run_strategy: strategy must be one of the prepared {list(instances)}, got {name!r}"
        )
    validate_inputs(spec, inputs, device)
    if inputs.tokens == 0:
        return allocate_outputs(spec, 0, device)
    inst = instances[name]
    check_token_limit(inputs.tokens, inst.max_tokens_per_call(spec, env), name)
    status = next(s for s in statuses if s.name == name)
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
            f"run_strategy: {name}:{variant} takes {tokens_text(low, high)}, got T={inputs.tokens}"
        )
    if shared_once is not None:
        inputs = shared_once(inputs, inputs.tokens)
    return inst.run(inputs, variant)


def selected_run(
    tokens: int, eager: bool, plan: Plan, instances: Mapping[str, Strategy], max_tokens: int
) -> Callable[[EpilogueInputs], EpilogueOutputs]:
    """The run of the (strategy, variant) `plan` routes T tokens to (eager=True: the eager plan's),
    bound to its prepared instance, without the bridge's validation and dispatch. Raises
    ValueError when T has no route (T == 0, or above `max_tokens` without an overflow route)."""
    route = route_for(plan, tokens, eager)
    if route is None:
        raise ValueError(f"selected_run: no route for T={tokens} (max_tokens={max_tokens})")
    inst, variant = instances[route[0]], route[1]
    return lambda inputs: inst.run(inputs, variant)
