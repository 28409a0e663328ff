"""What the strategies that start with our Triton finalize+shared-add kernel share: its capability
checks, its step, and its launch. Each such strategy lives in its own file and adds what follows."""

from __future__ import annotations

from typing import Optional

import torch

from fusion_bridge.environment import Environment
from fusion_bridge.epilogue_tensors import EpilogueInputs
from fusion_bridge.reasons import Reason
from fusion_bridge.spec import EpilogueSpec, Stage
from fusion_bridge.strategies.base import Step, required_stages

MAX_HIDDEN = (
    32768  # our row kernels (add+RMSNorm, quant) hold one token row per program in registers
)


def needs_device(env: Environment, who: str) -> Optional[Reason]:
    if env.device_type == "cuda" or env.triton_interpret:
        return None
    return Reason(
        "needs_cuda_or_interpreter",
        f"{who} runs Triton kernels: it requires a CUDA device, or TRITON_INTERPRET=1 on "
        f"{env.device_type} (tests only), but the device is {env.device_type!r} without it",
        "run on a GPU; for CPU tests set TRITON_INTERPRET=1 before importing fusion_bridge",
    )


def hidden_fits(spec: EpilogueSpec, who: str) -> Optional[Reason]:
    if spec.hidden_size > MAX_HIDDEN:
        return Reason(
            "hidden_too_large",
            f"{who}'s row kernels hold one row per program: hidden_size <= "
            f"{MAX_HIDDEN} required, got {spec.hidden_size}",
            "use 'separate'",
        )
    return None


def finalize_step(spec: EpilogueSpec, env: Environment) -> Step:
    stages = required_stages(spec, env.world_size)
    return Step(
        "local.finalize_add", tuple(s for s in stages if s in (Stage.FINALIZE, Stage.SHARED_ADD))
    )


def finalize_partial(ops, spec: EpilogueSpec, inputs: EpilogueInputs) -> torch.Tensor:
    """This rank's partial [T, H] in the activation dtype: routed_scaling * sum_k w * row + shared,
    accumulated in fp32 and rounded once."""
    return ops.finalize_add(
        inputs.gemm2_out,
        inputs.expanded_idx_to_permuted_idx,
        inputs.expert_weights,
        inputs.shared_output,
        spec.routed_scaling_factor,
    )
