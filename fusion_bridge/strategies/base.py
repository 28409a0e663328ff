"""What every strategy declares: its capability checks, its steps, its error bound, how it runs.

A strategy is one cover of the epilogue's stages (finalize, shared add, all-reduce, residual+norm,
quant) by launch steps. Its class-level methods are pure functions of (spec, environment) so the
planner and the golden tests need no hardware; an instance holds what `prepare()`
built (workspaces).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import ClassVar, Mapping, Optional

import torch
import torch.distributed as dist

from fusion_bridge.environment import Environment, Probe
from fusion_bridge.epilogue_tensors import EpilogueInputs, EpilogueOutputs
from fusion_bridge.kernels.quant_codes import quant_args as kernel_quant_args  # noqa: F401 (strategies use it)
from fusion_bridge.reasons import Reason
from fusion_bridge.spec import EpilogueSpec, QuantKind, Stage

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
DEFAULT_VARIANT = "default"
#: the token counts a launch variant can take: (fewest, most); most None = up to max_tokens_per_call
TokenRange = tuple[int, Optional[int]]
ANY_TOKENS: TokenRange = (1, None)


@dataclass(frozen=True)
class Step:
    """One launch (or one library call) of a strategy, named `<library>.<what>`, and the
    stages it covers."""

    name: str
    stages: tuple[Stage, ...]

    def to_dict(self) -> dict:
        return {"name": self.name, "stages": [s.value for s in self.stages]}


def required_stages(spec: EpilogueSpec, world_size: int) -> tuple[Stage, ...]:
    stages = [Stage.FINALIZE]
    if spec.has_shared_output:
        stages.append(Stage.SHARED_ADD)
    if world_size > 1:
        stages.append(Stage.ALL_REDUCE)
    stages.append(Stage.RESIDUAL_NORM)
    if spec.quant.kind is not QuantKind.NONE:
        stages.append(Stage.QUANT)
    return tuple(stages)


def rounding_error_bound(dtype: torch.dtype, roundings: int) -> float:
    """Norm-wise relative error bound for `roundings` independent roundings to `dtype`.

    Each rounding moves every element by at most u relative (u = 2^-8 bf16, 2^-11 fp16), so its
    norm-wise error is at most u; independent zero-mean errors add in quadrature: sqrt(n) * u.
    Inputs are random in every parity test, which is what makes the roundings independent.
    """
    return math.sqrt(max(roundings, 1)) * UNIT_ROUNDOFF[dtype]


class CallStage(enum.Enum):
    """Where a call of a strategy's `run` is relative to its collective (what the bridge needs to
    know when `run` raises: before, this rank can still take part; inside, it cannot tell whether
    the peers finished; after, the group is in step)."""

    BEFORE_COLLECTIVE = "before the collective"
    IN_COLLECTIVE = "inside the collective"
    AFTER_COLLECTIVE = "after the collective"


class Strategy:
    name: ClassVar[str]
    summary: ClassVar[str]
    #: auto may pick it (the fp32 oracle may not)
    auto_selectable: ClassVar[bool] = True
    #: opt-in: auto neither prepares (no workspace, no self-test) nor picks it; a request by name
    #: does. For a strategy not yet measured where it would run: it cannot cost every auto bridge
    #: memory and build time
    opt_in: ClassVar[bool] = False
    #: run the collective self-test against the oracle when the bridge is prepared (GPU strategies)
    self_tested: ClassVar[bool] = False
    #: facts about the process that only this strategy's checks need: detect() runs them and stores
    #: their values in `Environment.probes`; read one with `probe.value_in(env)`
    probes: ClassVar[tuple[Probe, ...]] = ()

    # ---- pure, class-level: used by the planner, the report and golden tests ----
    @classmethod
    def not_supported_reasons(cls, spec: EpilogueSpec, env: Environment) -> list[Reason]:
        """Every reason this strategy cannot run (empty list = supported)."""
        raise NotImplementedError

    @classmethod
    def steps(cls, spec: EpilogueSpec, env: Environment) -> list[Step]:
        """The launches, in order, that one call makes."""
        raise NotImplementedError

    @classmethod
    def roundings(cls, spec: EpilogueSpec, env: Environment) -> int:
        """How many roundings to the activation dtype lie between the inputs and norm_out."""
        raise NotImplementedError

    @classmethod
    def error_bound(cls, spec: EpilogueSpec, env: Environment) -> float:
        """Norm-wise relative error bound of residual_out and norm_out against the fp32 oracle.

        The oracle's outputs are rounded too, so its one rounding counts alongside
        the strategy's."""
        return rounding_error_bound(spec.dtype, cls.roundings(spec, env) + 1)

    @classmethod
    def is_auto_selectable(cls, spec: EpilogueSpec, env: Environment) -> bool:
        """Whether auto may pick it when available (the oracle, interpreter-only and opt-in paths
        may not)."""
        return cls.auto_selectable and not cls.opt_in

    @classmethod
    def max_tokens_per_call(cls, spec: EpilogueSpec, env: Environment) -> Optional[int]:
        """The largest T one call may carry, or None for no limit (workspace-backed
        paths have one)."""
        return None

    @classmethod
    def variants(cls, spec: EpilogueSpec, env: Environment) -> tuple[str, ...]:
        """Launch variants: ways to launch the same steps that differ only in speed (one-shot /
        two-shot, PDL on / off). Tuning measures each; the plan stores one per token bucket; `run`
        receives it."""
        return (DEFAULT_VARIANT,)

    @classmethod
    def variant_tokens(cls, spec: EpilogueSpec, env: Environment) -> Mapping[str, TokenRange]:
        """Per variant, the token counts it can launch with (a variant not listed: any T). The
        planner gives a bucket only a variant whose range holds the bucket's every T, and `run`
        refuses a T outside it: no run() overrides the planned variant."""
        return {}

    @classmethod
    def default_variant(cls, spec: EpilogueSpec, env: Environment, tokens: Optional[int]) -> str:
        """The variant for a bucket whose largest T is `tokens` (None: above max_tokens) when
        nothing was measured; the planner takes it when its variant_tokens hold the bucket, else the
        first declared variant whose range does. A pure function, like every class-level method."""
        return cls.variants(spec, env)[0]

    # ---- per instance: built by the bridge, collectively ----
    def __init__(
        self,
        spec: EpilogueSpec,
        env: Environment,
        group=None,
        device: Optional[torch.device] = None,
    ) -> None:
        self.spec, self.env, self.group = spec, env, group
        self.device = device or torch.device("cpu")

    def this_rank_resource_reasons(self) -> list[Reason]:
        """Per-rank checks that must pass before the collective prepare() (e.g. can we allocate)."""
        return []

    def prepare(self) -> None:
        """One-time collective setup (workspaces). Called on every rank, or on none."""

    def accepts(self, inputs: EpilogueInputs) -> bool:
        """Shape-only per-call check (never syncs); False reroutes the call under auto."""
        return True

    @property
    def workspace_bytes(self) -> int:
        return 0

    def run(
        self,
        inputs: EpilogueInputs,
        variant: str = DEFAULT_VARIANT,
        out: Optional[EpilogueOutputs] = None,
    ) -> EpilogueOutputs:
        """One call on validated inputs with 0 < T <= max_tokens_per_call. `variant` is one of
        `variants()`, as the plan chose it for this T (within its variant_tokens); run() never
        launches another variant than the one it is given. `out`: the caller's preallocated outputs
        (validated: the call's shapes, sharing no memory with an input), or None; given, run()
        writes every output into it and returns it (a kernel family through its RowOutputs, a
        torch path by copying, `epilogue_tensors.deliver`), allocating none of them; a run()
        without the parameter (written before it) gets its outputs copied into `out`. Collective
        when the world size is > 1: the call's one collective (an all-reduce, or the launch of a
        kernel that exchanges with peers) goes inside `with self.collective():`, everything that
        can fail locally before it."""
        raise NotImplementedError

    #: the strategy's run() wraps its one collective in `self.collective()`; a strategy that does
    #: not is treated as "inside" whenever its run raises (the bridge cannot tell where it failed)
    marks_collective: ClassVar[bool] = False
    call_stage: CallStage = CallStage.BEFORE_COLLECTIVE

    def collective(self) -> "_CollectiveMark":
        """Mark the call's one collective (`with self.collective(): ...`): a failure before it lets
        this rank still take part with a NaN payload; a failure inside it breaks the bridge; after
        it, the group is in step. A plain object, not a generator: it sits on every call's path."""
        return _CollectiveMark(self)

    def partial_dtype(self) -> Optional[torch.dtype]:
        """The dtype of the [T, H] partial whose torch.distributed all-reduce is this strategy's one
        collective, or None when its collective is inside its own kernels (or it has none). A
        strategy that says so takes part in a call its rank failed by all-reducing NaN rows alone
        (`take_part`), which needs nothing that prepare() built or the failed call allocated."""
        return None

    def take_part(
        self,
        payload: Optional[EpilogueInputs],
        variant: Optional[str] = None,
        nan_partial: Optional[torch.Tensor] = None,
    ) -> None:
        """Join one call's collectives on behalf of a rank whose own call failed before them, so
        the peers, running `variant` on their inputs (None: run's own default, as shadow mode calls
        it), stay in step and get NaN outputs. nan_partial: [T, H] NaN rows in partial_dtype(),
        given when that is not None; all-reduced in place (NaN plus anything stays NaN). Otherwise
        `run` on the NaN `payload` (its own kernels, their outputs)."""
        if nan_partial is None:
            self.run(payload) if variant is None else self.run(payload, variant)
            return
        with self.collective():
            dist.all_reduce(nan_partial, group=self.group)

    def close(self) -> None:
        """Free what prepare() built. Idempotent."""


class _CollectiveMark:
    __slots__ = ("strategy",)

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    def __enter__(self) -> None:
        self.strategy.call_stage = CallStage.IN_COLLECTIVE

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.strategy.call_stage = CallStage.AFTER_COLLECTIVE
