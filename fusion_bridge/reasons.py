"""Reasons a strategy cannot run, as data, and the small shared checks that produce them.

Every check returns a Reason or None; a strategy lists its checks and collects *all* reasons.
Codes are stable identifiers that tests and tools match on; messages say what was required and
what was seen; hints say what to do about it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from fusion_bridge.environment import Environment, version_tuple
from fusion_bridge.spec import EpilogueSpec


@dataclass(frozen=True)
class Reason:
    code: str
    message: str
    hint: str = ""

    def to_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "hint": self.hint}


MaybeReason = Optional[Reason]


def collect(*checks: MaybeReason | Iterable[MaybeReason]) -> list[Reason]:
    out: list[Reason] = []
    for c in checks:
        if c is None:
            continue
        if isinstance(c, Reason):
            out.append(c)
        else:
            out.extend(r for r in c if r is not None)
    return out


def require_cuda(env: Environment, who: str) -> MaybeReason:
    if env.device_type != "cuda":
        return Reason(
            "needs_cuda",
            f"{who} requires a CUDA device, but the device is {env.device_type!r}",
            "run on a GPU, or pick strategy 'separate'",
        )
    return None


def require_sm_at_least(
    env: Environment, who: str, min_sm: int, code: str = "sm_too_low", why: str = ""
) -> MaybeReason:
    if env.device_type == "cuda" and (env.sm is None or env.sm < min_sm):
        return Reason(
            code,
            f"{who} requires SM >= {min_sm}{why}, but the GPU is SM {env.sm}",
            f"use a GPU with SM >= {min_sm}, or another strategy",
        )
    return None


def require_triton(env: Environment, who: str) -> MaybeReason:
    if env.triton_version is None:
        cause = env.triton_error or ""
        if env.triton_interpret and cause and "No module named 'triton'" not in cause:
            # triton is installed, but under TRITON_INTERPRET=1 its import loads the interpreter,
            # which failed: say so, not "triton missing"
            return Reason(
                "triton_interpreter_unavailable",
                f"{who} runs its Triton kernels under TRITON_INTERPRET=1 here, but importing "
                f"triton's interpreter failed ({cause})",
                "pip install numpy (the interpreter needs it; fusion-bridge's 'test' extra "
                "brings it)"
                if "numpy" in cause
                else "fix the triton install",
            )
        return Reason(
            "triton_missing",
            f"{who} requires triton, which is not importable" + (f" ({cause})" if cause else ""),
            "pip install triton",
        )
    return None


def require_flashinfer(env: Environment, who: str, min_version: str) -> MaybeReason:
    if env.flashinfer_version is None:
        return Reason(
            "flashinfer_missing",
            f"{who} requires flashinfer-python >= {min_version}, which is not importable"
            + (f" ({env.flashinfer_error})" if env.flashinfer_error else ""),
            "pip install 'fusion-bridge[flashinfer]'",
        )
    if version_tuple(env.flashinfer_version) < version_tuple(min_version):
        return Reason(
            "flashinfer_too_old",
            f"{who} requires flashinfer-python >= {min_version}, found {env.flashinfer_version}",
            "upgrade flashinfer-python",
        )
    return None


def require_world_size_in(env: Environment, who: str, sizes: tuple[int, ...]) -> MaybeReason:
    if env.world_size not in sizes:
        return Reason(
            "world_size_unsupported",
            f"{who} supports world sizes {list(sizes)}, but the group has {env.world_size} ranks",
            "use an NCCL all-reduce strategy ('local_fused_nccl' or 'separate')",
        )
    return None


def require_single_node(env: Environment, who: str) -> MaybeReason:
    if not env.single_node:
        return Reason(
            "multi_node_group",
            f"{who} needs all ranks on one node (IPC peer memory), but the group spans nodes",
            "use an NCCL-based strategy across nodes",
        )
    return None


def require_hidden_multiple(
    spec: EpilogueSpec, who: str, multiple: int, code: str, why: str
) -> MaybeReason:
    if spec.hidden_size % multiple:
        return Reason(
            code,
            f"{who} requires hidden_size % {multiple} == 0{why}, but hidden_size is "
            f"{spec.hidden_size} (remainder {spec.hidden_size % multiple})",
            "another strategy handles this hidden size",
        )
    return None


EXCLUDED = "excluded_by_request"


def excluded_by_request(who: str, source: str) -> Reason:
    """The caller keeps `who` out of auto (`exclude=[...]` or FUSION_BRIDGE_EXCLUDE: `source`)."""
    return Reason(
        EXCLUDED,
        f"{who} excluded by request ({source})",
        "drop it from `exclude` / FUSION_BRIDGE_EXCLUDE to let auto consider it again",
    )


def refuse_dynamic_fp8(spec: EpilogueSpec, who: str, why: str) -> MaybeReason:
    """The dynamic FP8 kinds (fp8_per_token_group, fp8_per_token) where `who` does not write them
    yet: `why` says what is missing (issue 49: until they run on two GPUs)."""
    if spec.quant.dynamic_fp8:
        return Reason(
            "dynamic_fp8_not_available",
            f"{who} does not write quant kind {spec.quant.kind.value!r}: {why}",
            "pick fused_tp1 (world size 1), local_fused_nccl, separate or reference for "
            "fp8_per_token_group / fp8_per_token",
        )
    return None
