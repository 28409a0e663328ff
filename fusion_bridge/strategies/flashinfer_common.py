"""What the FlashInfer paths share: their capability checks and the IPC workspace.

The workspace (FlashInfer's TRT-LLM all-reduce fusion workspace) is created collectively, once per
(group, max_tokens, H, dtype), and shared by every strategy that needs it; it is freed when the last
user releases it. Never use backend="auto" or MNNVL here: they create NVLink multicast objects, which
can take shared GPUs out of service (DESIGN.md section 4).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..environment import Environment, version_tuple
from ..reasons import Reason, collect, require_cuda, require_flashinfer, require_single_node, \
    require_sm_at_least, require_world_size_in
from ..spec import EpilogueSpec

MIN_FLASHINFER = "0.7.2"
LAMPORT_WORLD_SIZES = (2, 4, 8, 16)
MAX_COMM_SIZE = 2147483647 & ~((1 << 21) - 1)  # flashinfer trtllm_ar.MAX_COMM_SIZE (checked by a drift test)
BARRIER_FLAG_COUNT = 256

# trtllm_allreduce_fusion is marked deprecated in favour of a wrapper that allocates per call; the
# direct call is the lean one, so silence its warning once instead of paying for it per call.
warnings.filterwarnings("ignore", message=r".*unified API.*", category=DeprecationWarning)


def common_reasons(spec: EpilogueSpec, env: Environment, who: str) -> list[Reason]:
    """Checks every FlashInfer comm kernel needs."""
    return collect(
        require_flashinfer(env, who, MIN_FLASHINFER),
        require_cuda(env, who),
        require_sm_at_least(env, who, 90, why=" (below that its kernel body is compiled empty and does "
                                              "nothing, silently)"),
        require_world_size_in(env, who, LAMPORT_WORLD_SIZES),
        require_single_node(env, who),
    )


def fp4_fusion_reasons(spec: EpilogueSpec, env: Environment, who: str) -> list[Reason]:
    """FlashInfer's own FP4 conversion: compiled only for SM>=100; and in <= 0.7.2.post1 the MoE-finalize
    binding never sets the global scale (writes all-zero FP4 on H200 without an error, measured)."""
    reasons = []
    if env.flashinfer_version is not None and version_tuple(env.flashinfer_version) <= version_tuple("0.7.2.post1"):
        reasons.append(Reason(
            "flashinfer_fused_fp4_broken",
            f"{who}: flashinfer {env.flashinfer_version}'s fused FP4 is unusable on every SM: the binding "
            "never sets the global FP4 scale and the SF layout is fixed; on H200 it writes all-zero output "
            "without an error (measured)",
            "the bridge quantizes with its own FP4 kernel after the fused norm instead; a newer flashinfer "
            "is admitted through the self-test"))
    if env.device_type == "cuda" and (env.sm is None or env.sm < 100):
        reasons.append(Reason(
            "fp4_needs_sm100", f"{who}: FlashInfer's FP4 conversion is compiled only for SM >= 100, but the "
            f"GPU is SM {env.sm} (below that it writes zeros)", "our FP4 kernel runs on any SM"))
    return reasons


def max_tokens_for(spec: EpilogueSpec, world_size: int) -> int:
    """Tokens one call may carry: the workspace's size, capped by FlashInfer's Lamport buffer limit."""
    per_token = spec.hidden_size * 2 * max(world_size, 1)
    return max(0, min(spec.max_tokens, MAX_COMM_SIZE // per_token))


def workspace_bytes_estimate(spec: EpilogueSpec, world_size: int) -> int:
    """Per rank: the two-shot buffer, the flags, and three Lamport buffers (about 4x W*T*H*2)."""
    comm = world_size * spec.max_tokens * spec.hidden_size * 2
    return comm + world_size * BARRIER_FLAG_COUNT * 4 + 3 * min(comm, MAX_COMM_SIZE)


def memory_reason(spec: EpilogueSpec, world_size: int, device: torch.device, who: str) -> Optional[Reason]:
    """Can this rank hold the workspace? Checked locally before the collective creation."""
    need = workspace_bytes_estimate(spec, world_size)
    free, _ = torch.cuda.mem_get_info(device)
    headroom = 256 << 20
    if need + headroom > free:
        return Reason("workspace_no_memory", f"{who}: the workspace for max_tokens={spec.max_tokens} needs "
                      f"{need / 2**20:.0f} MiB (+256 MiB headroom) per rank, {free / 2**20:.0f} MiB are free",
                      "lower EpilogueSpec.max_tokens or free GPU memory")
    return None


@dataclass
class _Entry:
    workspace: object
    users: int


_WORKSPACES: dict[tuple, _Entry] = {}


def _key(group, spec: EpilogueSpec, world_size: int) -> tuple:
    name = group.group_name if group is not None else dist.group.WORLD.group_name
    return (name, world_size, spec.max_tokens, spec.hidden_size, spec.dtype)


def acquire_workspace(group, spec: EpilogueSpec, world_size: int):
    """The shared workspace for this (group, max_tokens, H, dtype); collective on first use."""
    key = _key(group, spec, world_size)
    entry = _WORKSPACES.get(key)
    if entry is None:
        from flashinfer.comm import TRTLLMAllReduceFusionWorkspace
        ws = TRTLLMAllReduceFusionWorkspace(
            tp_size=world_size, tp_rank=dist.get_rank(group), max_token_num=spec.max_tokens,
            hidden_dim=spec.hidden_size, dtype=spec.dtype, group=group)
        entry = _WORKSPACES[key] = _Entry(ws, 0)
    entry.users += 1
    return entry.workspace


def release_workspace(group, spec: EpilogueSpec, world_size: int) -> None:
    key = _key(group, spec, world_size)
    entry = _WORKSPACES.get(key)
    if entry is None:
        return
    entry.users -= 1
    if entry.users <= 0:
        del _WORKSPACES[key]
        entry.workspace.destroy()


def workspace_bytes(workspace) -> int:
    m = workspace.metadata
    return int(m["buffer_size"] + m["flag_size"] + m["lamport_buffer_size"])
