"""What the FlashInfer paths share: their capability checks and the IPC workspace.

The workspace (FlashInfer's TRT-LLM all-reduce fusion workspace) is created collectively, once per
(group, max_tokens, H, dtype), and shared by every strategy that needs it; it is freed when the last
user releases it. Never use backend="auto" or MNNVL here: they create NVLink multicast objects,
which can take shared GPUs out of service (docs/upstream.md, section 7).
"""

from __future__ import annotations

import re
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from fusion_bridge.environment import Environment
from fusion_bridge.reasons import (
    Reason,
    collect,
    require_cuda,
    require_flashinfer,
    require_single_node,
    require_sm_at_least,
    require_world_size_in,
)
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.ranks.process_group import group_name
from fusion_bridge.strategies.workspace_pool import (
    WorkspacePool,
    memory_reason as workspace_memory_reason,
)

MIN_FLASHINFER = "0.7.2"
LAMPORT_WORLD_SIZES = (2, 4, 8, 16)
MAX_COMM_SIZE = 2147483647 & ~(
    (1 << 21) - 1
)  # flashinfer trtllm_ar.MAX_COMM_SIZE (checked by a drift test)
BARRIER_FLAG_COUNT = 256
# The last FlashInfer release whose fused FP4 in trtllm_moe_finalize_allreduce_fusion is known
# broken. Measured broken in 0.7.2.post1; the MoE-finalize sources of 0.7.4
# (csrc/trtllm_moe_allreduce_fusion.cu, include/flashinfer/comm/trtllm_moe_allreduce_fusion.cuh) are
# byte-identical to it. A later release is not trusted by version either: it passes this gate and
# must then pass the self-test.
FP4_FUSION_BROKEN_THROUGH = (0, 7, 4)

# trtllm_allreduce_fusion is marked deprecated in favour of a wrapper that allocates per call; the
# direct call is the lean one, so silence its warning once instead of paying for it per call.
warnings.filterwarnings("ignore", message=r".*unified API.*", category=DeprecationWarning)


def common_reasons(spec: EpilogueSpec, env: Environment, who: str) -> list[Reason]:
    """Checks every FlashInfer comm kernel needs."""
    return collect(
        require_flashinfer(env, who, MIN_FLASHINFER),
        require_cuda(env, who),
        require_sm_at_least(
            env,
            who,
            90,
            why=" (below that its kernel body is compiled empty and does nothing, silently)",
        ),
        require_world_size_in(env, who, LAMPORT_WORLD_SIZES),
        require_single_node(env, who),
    )


def release_of(version: str) -> tuple[int, int, int] | None:
    """'0.7.4', '0.7.4rc1', '0.7.4.post1', '0.7.4.dev3', '0.7.4+cu130' -> (0, 7, 4): the release a
    pre-, post-, dev- or local build belongs to. None when the string does not start
    with a version."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def fp4_fusion_reasons(spec: EpilogueSpec, env: Environment, who: str) -> list[Reason]:
    """Why FlashInfer's own fused FP4 (MoE-finalize kernel) cannot be used here.

    - Every release through 0.7.4 (pre-, post- and dev-releases of those included): the binding
      never sets the global FP4 scale (MoeFinalizeAllReduceFusionParams::scale_factor stays
      uninitialised) and the SF layout is fixed to 128x4; on H200, 0.7.2.post1 wrote all-zero FP4
      without an error (measured), and 0.7.4's MoE-finalize sources are byte-identical. A version
      string we cannot read counts as broken.
    - Below SM100 on any version: FlashInfer compiles its FP4 conversion only for SM >= 100.
    A later release that passes both is admitted only if it also passes the self-test.
    """
    reasons = []
    if env.flashinfer_version is not None:
        release = release_of(env.flashinfer_version)
        if release is None or release <= FP4_FUSION_BROKEN_THROUGH:
            through = ".".join(map(str, FP4_FUSION_BROKEN_THROUGH))
            reasons.append(
                Reason(
                    "flashinfer_fused_fp4_broken",
                    f"{who}: fused FP4 is known broken in flashinfer through {through}, found "
                    f"{env.flashinfer_version}: the binding never sets the global FP4 scale and "
                    "the SF layout is "
                    "fixed; on H200 0.7.2.post1 wrote all-zero output without an error (measured), "
                    "and the "
                    f"MoE-finalize sources are unchanged through {through}",
                    "the bridge quantizes with its own FP4 kernel after the fused norm "
                    "(flashinfer_fused); a "
                    f"flashinfer release after {through} is admitted only if it passes the "
                    "self-test",
                )
            )
    if env.device_type == "cuda" and (env.sm is None or env.sm < 100):
        reasons.append(
            Reason(
                "fp4_needs_sm100",
                f"{who}: FlashInfer's FP4 conversion is compiled only for SM >= 100, but the "
                f"GPU is SM {env.sm} (below that it writes zeros)",
                "our FP4 kernel runs on any SM",
            )
        )
    return reasons


def lamport_max_tokens(hidden: int, element_bytes: int, world_size: int) -> int:
    """The most tokens FlashInfer's one-shot Lamport buffers hold: every rank's whole partial
    (T * H * element_bytes * world_size bytes) must fit MAX_COMM_SIZE."""
    return MAX_COMM_SIZE // (hidden * element_bytes * max(world_size, 1))


def max_tokens_for(spec: EpilogueSpec, world_size: int) -> int:
    """Tokens one call may carry: the workspace's size, capped by FlashInfer's Lamport
    buffer limit."""
    elem = torch.finfo(spec.dtype).bits // 8
    return max(0, min(spec.max_tokens, lamport_max_tokens(spec.hidden_size, elem, world_size)))


def workspace_bytes_estimate(spec: EpilogueSpec, world_size: int) -> int:
    """Per rank: the two-shot buffer, the flags, and three Lamport buffers (about 4x W*T*H*2)."""
    comm = world_size * spec.max_tokens * spec.hidden_size * 2
    return comm + world_size * BARRIER_FLAG_COUNT * 4 + 3 * min(comm, MAX_COMM_SIZE)


def memory_reason(
    spec: EpilogueSpec, world_size: int, device: torch.device, who: str
) -> Optional[Reason]:
    """Can this rank hold the workspace? Checked locally before the collective creation."""
    what = f"the workspace for max_tokens={spec.max_tokens}"
    return workspace_memory_reason(who, what, workspace_bytes_estimate(spec, world_size), device)


_WORKSPACES: WorkspacePool = WorkspacePool()


def _key(group, spec: EpilogueSpec, world_size: int) -> tuple:
    return (group_name(group), world_size, spec.max_tokens, spec.hidden_size, spec.dtype)


def acquire_workspace(group, spec: EpilogueSpec, world_size: int):
    """The shared workspace for this (group, max_tokens, H, dtype); collective on first use."""

    def create():
        from flashinfer.comm import TRTLLMAllReduceFusionWorkspace

        return TRTLLMAllReduceFusionWorkspace(
            tp_size=world_size,
            tp_rank=dist.get_rank(group),
            max_token_num=spec.max_tokens,
            hidden_dim=spec.hidden_size,
            dtype=spec.dtype,
            group=group,
        )

    return _WORKSPACES.acquire(_key(group, spec, world_size), create)


def release_workspace(group, spec: EpilogueSpec, world_size: int, workspace) -> None:
    """Drop one user of `workspace`; the last one destroys it (collectively)."""
    _WORKSPACES.release(_key(group, spec, world_size), workspace, lambda ws: ws.destroy())


def workspace_bytes(workspace) -> int:
    m = workspace.metadata
    return int(m["buffer_size"] + m["flag_size"] + m["lamport_buffer_size"])
