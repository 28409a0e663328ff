"""The symmetric-memory workspaces of `symm_fused_oneshot` and `symm_fused_twoshot`: capability
checks, sizing, collective creation and release. A layout value from kernels/symm/protocol.py picks
the kernel's buffer: `ONESHOT` (slots of W x cap rows, so a token cap) or `TWOSHOT` (a few chunk
slots that the chunks of a call take in turn: a fixed size whatever T is, so no token cap beyond
the spec's max_tokens).

PyTorch symmetric memory (`torch.distributed._symmetric_memory`, a private module) maps every rank's
buffer into every peer's address space over NVLink. We use only `empty`, `rendezvous` and the
handle's `buffer_ptrs` (and `multicast_ptr`, only to check it). Our kernels never use NVLink
multicast: they address peers through `buffer_ptrs` alone and contain no multimem instruction.
Whether the process allows multicast (NCCL_NVLS_ENABLE, TORCH_SYMM_MEM_DISABLE_MULTICAST,
NVSHMEM_DISABLE_NVLS) is the application's choice, not a requirement of these strategies; when the
process asked for multicast off, a handle that still exposes a multicast pointer is refused.
"""

from __future__ import annotations

import atexit
import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from fusion_bridge.environment import Environment, Probe, multicast_is_off
from fusion_bridge.reasons import (
    Reason,
    collect,
    refuse_dynamic_fp8,
    require_cuda,
    require_single_node,
    require_sm_at_least,
    require_triton,
)
from fusion_bridge.kernels.symm import protocol
from fusion_bridge.kernels.symm.protocol import ONESHOT, Layout
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.ranks.process_group import group_name
from fusion_bridge.strategies.workspace_pool import (
    WorkspacePool,
    memory_reason as workspace_memory_reason,
)

SYMM_MEM_API = ("empty", "rendezvous")  # module functions we call (pinned by a drift test)
HANDLE_API = ("buffer_ptrs", "multicast_ptr")  # handle attributes we read
WORLD_SIZES = tuple(range(2, 9))  # one NVLink node; the error word keeps a 16-bit rank mask
MAX_HIDDEN = 16384  # the norm holds a whole row (next power of two) in registers
# tokens per call of the one-shot (the small-T path; larger T takes the overflow route). The
# two-shot (the bandwidth path) turns its fixed slots within a call: any T up to max_tokens.
MAX_BUFFER_BYTES = 512 << 20
DEFAULT_TIMEOUT_S = (
    60.0  # a peer that has not arrived by then is treated as gone (bridge must be rebuilt)
)


@functools.lru_cache(maxsize=None)
def probe_symm_mem() -> Optional[str]:
    """None when the symmetric-memory API we use is importable, else what is missing."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except Exception as exc:  # ImportError, or a build without distributed
        return f"torch.distributed._symmetric_memory does not import ({type(exc).__name__}: {exc})"[
            :300
        ]
    missing = [n for n in SYMM_MEM_API if not hasattr(symm_mem, n)]
    handle_cls = getattr(symm_mem, "_SymmetricMemory", None)
    missing += [
        f"_SymmetricMemory.{n}"
        for n in HANDLE_API
        if handle_cls is None or not hasattr(handle_cls, n)
    ]
    return f"torch.distributed._symmetric_memory lacks {missing}" if missing else None


#: the environment facts the symmetric-memory strategies declare (Strategy.probes): whether
#: symmetric memory imports (a capability), and whether this process set the three multicast
#: variables (reported by `info`; no capability depends on it)
SYMM_MEM_PROBE = Probe("symm_mem_error", probe_symm_mem, documented=None)
MULTICAST_PROBE = Probe("multicast_off", multicast_is_off, documented=None)


def capacity(spec: EpilogueSpec, world_size: int, layout: Layout = ONESHOT) -> int:
    """Tokens one call may carry, bounded in bytes (the layouts are in kernels/symm/protocol.py).
    The two-shot: spec.max_tokens when its fixed buffer fits MAX_BUFFER_BYTES, else 0."""
    elem = torch.finfo(spec.dtype).bits // 8
    world = max(world_size, 1)
    if layout.max_cap_tokens is None:  # the buffer does not grow with T
        fits = layout.buffer_bytes(world, 0, spec.hidden_size, elem) <= MAX_BUFFER_BYTES
        return spec.max_tokens if fits else 0
    per_token = layout.buffer_bytes(world, 1, spec.hidden_size, elem) - protocol.HEADER_BYTES
    cap = min(spec.max_tokens, layout.max_cap_tokens, MAX_BUFFER_BYTES // per_token)
    return max(0, cap)


def buffer_bytes(spec: EpilogueSpec, world_size: int, layout: Layout = ONESHOT) -> int:
    return layout.buffer_bytes(
        world_size,
        capacity(spec, world_size, layout),
        spec.hidden_size,
        torch.finfo(spec.dtype).bits // 8,
    )


def reasons(
    spec: EpilogueSpec,
    env: Environment,
    who: str,
    probe: Optional[Callable[[], Optional[str]]] = None,
    layout: Layout = ONESHOT,
) -> list[Reason]:
    """Every static reason the symmetric-memory strategies cannot run: a pure function of (spec,
    env), whose SYMM_MEM_PROBE detect() reads from the process (tests may pass `probe` instead).
    The multicast variables are not among them: our kernels never use multicast."""
    out = collect(
        require_cuda(env, who),
        require_triton(env, who),
        require_sm_at_least(
            env, who, 90, why=" (system-scope acquire/release over NVLink; validated on H200)"
        ),
        require_single_node(env, who),
        refuse_dynamic_fp8(
            spec,
            who,
            "the symmetric-memory kernels' per-token-group and per-token FP8 paths are not "
            "built: they can only be checked on two GPUs",
        ),
    )
    if env.triton_interpret:
        out.append(
            Reason(
                "triton_interpreter",
                f"{who} signals peers with inline PTX, which the Triton "
                "interpreter (TRITON_INTERPRET=1) cannot run",
                "unset TRITON_INTERPRET",
            )
        )
    missing = probe() if probe is not None else SYMM_MEM_PROBE.value_in(env)
    if missing is not None:
        out.append(
            Reason(
                "symm_mem_unavailable",
                f"{who} requires PyTorch symmetric memory: {missing} (torch {env.torch_version})",
                "use a torch build with CUDA symmetric memory (>= 2.6)",
            )
        )
    if env.world_size not in WORLD_SIZES:
        out.append(
            Reason(
                "world_size_unsupported",
                f"{who} supports world sizes {list(WORLD_SIZES)} (one NVLink "
                f"node), but the group has {env.world_size} ranks",
                "use an NCCL-based strategy",
            )
        )
    if spec.hidden_size > MAX_HIDDEN:
        out.append(
            Reason(
                "hidden_too_large",
                f"{who} supports hidden_size <= {MAX_HIDDEN} (a row is held in "
                f"registers), but hidden_size is {spec.hidden_size}",
                "another strategy handles it",
            )
        )
    elif capacity(spec, env.world_size, layout) == 0:
        out.append(
            Reason(
                "workspace_too_small",
                f"{who}: not one token of H={spec.hidden_size} fits the "
                f"{MAX_BUFFER_BYTES >> 20} MiB workspace at world size {env.world_size}",
                "",
            )
        )
    return out


def memory_reason(
    spec: EpilogueSpec, world_size: int, device: torch.device, who: str, layout: Layout = ONESHOT
) -> Optional[Reason]:
    """Can this rank hold the buffer? Checked locally before the collective creation."""
    what = (
        "the symmetric two-shot buffer (any T)"
        if layout.max_cap_tokens is None
        else f"the symmetric buffer for {capacity(spec, world_size, layout)} tokens"
    )
    return workspace_memory_reason(who, what, buffer_bytes(spec, world_size, layout), device)


@dataclass
class SymmWorkspace:
    """One group's symmetric buffer and protocol state. ptrs: int64 [W + 1] device (every rank's
    buffer, then the pinned error word); state: device, the layout's state words (one-shot
    int32 [ONESHOT_STATE_WORDS], the two-shot int64 [TWOSHOT_STATE_WORDS]); err: int32 [4] pinned
    host. cap: tokens one call may carry (the two-shot: its first user's max_tokens; each strategy
    checks its own). A layer binds it with kernels.symm.protocol.SymmLayer.bind."""

    buffer: torch.Tensor
    handle: object
    ptrs: torch.Tensor
    state: torch.Tensor
    err: torch.Tensor
    world: int
    rank: int
    cap: int
    data_off: int  # int16 elements before slot 0 (the header)
    num_sms: int  # the smallest SM count of the group: every rank launches the same grid
    timeout_ns: int
    nbytes: int

    def __post_init__(self) -> None:
        self._err_view = (
            self.err.numpy()
        )  # a numpy view reads far faster than a tensor index (docs/performance.md)

    def error_word(self) -> int:
        """The error the kernel left (0: none). Reads pinned host memory: no device sync."""
        return int(self._err_view[0])


def create(
    group,
    spec: EpilogueSpec,
    world_size: int,
    device: torch.device,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    layout: Layout = ONESHOT,
) -> SymmWorkspace:
    """Collective: every rank of `group` calls it. Raises RuntimeError when this process asked for
    multicast off and the handle still exposes a multicast pointer. The kernels receive only the
    peers' `buffer_ptrs`, whatever the process allows."""
    import torch.distributed._symmetric_memory as symm_mem

    who = f"symm_fused_{layout.name}"
    group = group if group is not None else dist.group.WORLD
    cap = capacity(spec, world_size, layout)
    nbytes = buffer_bytes(spec, world_size, layout)
    buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buffer, group.group_name)
    if multicast_is_off() and int(getattr(handle, "multicast_ptr", 0) or 0) != 0:
        raise RuntimeError(
            f"[multicast_present] {who}: the symmetric-memory handle exposes a multicast "
            "pointer although multicast is disabled; refusing to run"
        )
    head = protocol.HEADER_BYTES
    buffer[:head].zero_()  # the abort word (and the two-shot's release counters and flags)
    protocol.fill_sentinel(buffer[head:].view(torch.int16))  # every data slot "not arrived"
    torch.cuda.synchronize(device)
    dist.barrier(group)  # no rank publishes before every rank's slots hold the sentinel
    torch.cuda.synchronize(device)
    # buffer_ptrs are the bases of each rank's symmetric allocation; a tensor carved out of a pooled
    # allocation sits at an offset (measured: a re-used pool put a new buffer over an old one's
    # flags). The offset is the same on every rank; check it rather than assume it.
    rank = dist.get_rank(group)
    bases = [int(p) for p in handle.buffer_ptrs]
    offset = buffer.data_ptr() - bases[rank]
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    seen: list = [None] * world_size
    dist.all_gather_object(seen, (offset, num_sms), group=group)
    offsets = [o for o, _ in seen]
    if len(set(offsets)) != 1 or not 0 <= offset or offset % 256:
        raise RuntimeError(
            f"[symm_offset_mismatch] {who}: the buffer's offsets in the symmetric "
            f"allocations differ across ranks or are misaligned: {offsets}"
        )
    err = torch.zeros(4, dtype=torch.int32).pin_memory()
    ptrs = torch.tensor(
        [b + offset for b in bases] + [err.data_ptr()], dtype=torch.int64, device=device
    )
    words, state_dtype = layout.state_words, layout.state_dtype
    state = torch.zeros(words, dtype=state_dtype, device=device)
    return SymmWorkspace(
        buffer,
        handle,
        ptrs,
        state,
        err,
        world_size,
        rank,
        cap,
        head // 2,
        min(n for _, n in seen),
        int(timeout_s * 1e9),
        nbytes,
    )


_EXITING = [False]


@atexit.register
def _interpreter_exiting() -> None:
    """Registered after the bridge's own exit hook, so it runs first (atexit is last-in, first-out):
    at exit, ranks leave at different times and a barrier could wait forever; the memory goes with
    the process anyway."""
    _EXITING[0] = True


def close(ws: Optional[SymmWorkspace], group) -> None:
    """Collective release: wait until no rank's kernel can still write into a peer's buffer (not at
    interpreter exit, where no rank waits for another)."""
    if ws is None:
        return
    torch.cuda.synchronize(ws.buffer.device)
    if dist.is_initialized() and not _EXITING[0]:
        dist.barrier(group if group is not None else dist.group.WORLD)


# One workspace per (group, world, H, dtype, capacity, timeout), shared by every bridge (every
# layer) that uses this strategy: a model builds one bridge per layer, and 61 private buffers would
# cost gigabytes.
# Sharing is safe because the protocol's state (slot, rows in use, abort word) lives in the
# workspace and every call of every layer goes through it in the same order on every
# rank, on one stream.
_SHARED: WorkspacePool = WorkspacePool()


def _key(group, spec: EpilogueSpec, world_size: int, timeout_s: float, layout: Layout) -> tuple:
    return (
        layout.name,
        group_name(group),
        world_size,
        spec.hidden_size,
        spec.dtype,
        # the two-shot's buffer ignores max_tokens: layers that differ only there share it
        capacity(spec, world_size, layout) if layout.max_cap_tokens is not None else 0,
        float(timeout_s),
    )


def acquire(
    group,
    spec: EpilogueSpec,
    world_size: int,
    device: torch.device,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    layout: Layout = ONESHOT,
) -> SymmWorkspace:
    """The shared workspace for this key; created (collectively) by its first user."""
    return _SHARED.acquire(
        _key(group, spec, world_size, timeout_s, layout),
        lambda: create(group, spec, world_size, device, timeout_s, layout),
    )


def release(
    ws: Optional[SymmWorkspace],
    group,
    spec: EpilogueSpec,
    world_size: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    layout: Layout = ONESHOT,
) -> None:
    """Drop one user; the last one frees it (collectively: every rank releases in the
    same order)."""
    if ws is not None:
        _SHARED.release(
            _key(group, spec, world_size, timeout_s, layout), ws, lambda w: close(w, group)
        )
