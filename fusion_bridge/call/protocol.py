"""What a call does when something fails on one rank, so the group's collectives stay in step.

Every rank of a TP group runs each call's collectives in the same order. A rank that fails and
simply raises leaves its peers waiting in the call's collective, and its *next* call would pair with
the peers' pending one: plausible but wrong values everywhere. So a failure anywhere before this
rank's collective (validation, reading an exotic tensor's metadata, allocation, a kernel launch)
makes the rank take part in the call anyway, with a NaN payload of the group's T through the route
its peers run, and only then raise. The peers get NaN outputs (loud, never plausible), and the
next call is in step on every rank.

The group's T is the first dimension most of the [T, ...] inputs agree on (`group_tokens`: the
index map, the expert weights, the shared output and `residual`, all replicated in T on every rank
of the TP group; on a tie, residual's). Every input is validated against it, so a rank with one
malformed tensor still knows which T its peers are running.

Where a rank cannot take part, it marks its bridge broken (every later call raises) with a message
that says what recovers; that happens when T itself is unreadable (none of those is a 2-D tensor),
or when the failure came while this rank was inside the collective (it cannot tell whether the peers
finished it).

Memory: the NaN payload's inputs come from buffers shared by every bridge of the process, one per
(device, dtype, H) of [largest max_tokens, H] elements (117 MB at H=7168, T=8192, bf16) plus
[max_tokens, K] index/weight maps, reserved when a multi-rank bridge is built. Taking part then
allocates only what the planned route allocates itself for T tokens (its outputs and, for some
routes, one [T, H] partial), the same memory the failed call had just released.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from fusion_bridge.epilogue_tensors import EpilogueInputs

_lock = threading.Lock()
_nan_rows: dict[tuple, torch.Tensor] = {}  # (device, dtype, H) -> [rows, H] of NaN
_index_maps: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (device, K) -> (perm, weights)
_gammas: dict[tuple, torch.Tensor] = {}  # (device, dtype, H) -> [H] of ones


def _first_dim(t: object) -> Optional[int]:
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return int(t.size(0)) if t.dim() == 2 else None
    except Exception:  # noqa: BLE001 - a tensor subclass whose metadata cannot be read
        return None


def group_tokens(inputs: EpilogueInputs) -> Optional[int]:
    """The call's T: the first dimension most of the [T, ...] inputs (index map, expert weights,
    shared output, residual; each counted when it is a 2-D tensor) agree on; on a tie, residual's,
    then the index map's. None when none of them is readable. Never raises, whatever objects or
    exotic tensor layouts the caller passed. One malformed tensor never changes T."""
    named = (
        ("residual", inputs.residual),
        ("index map", inputs.expanded_idx_to_permuted_idx),
        ("weights", inputs.expert_weights),
        ("shared", inputs.shared_output),
    )
    dims = [d for d in (_first_dim(t) for _, t in named) if d is not None]
    if not dims:
        return None
    best = max(dims.count(d) for d in dims)
    return next(d for d in dims if dims.count(d) == best)  # dims keep the tie order above


def reserve(device: torch.device, dtype: torch.dtype, hidden: int, top_k: int, rows: int) -> None:
    """Make sure the shared NaN payload holds at least `rows` tokens for this (device, dtype, H, K).
    Called when a multi-rank bridge is built, so a failing call never allocates its payload."""
    with _lock:
        key = (device, dtype, hidden)
        held = _nan_rows.get(key)
        if held is None or held.shape[0] < rows:
            _nan_rows[key] = torch.full((rows, hidden), float("nan"), dtype=dtype, device=device)
        if key not in _gammas:
            _gammas[key] = torch.ones(hidden, dtype=dtype, device=device)
        maps = _index_maps.get((device, top_k))
        if maps is None or maps[0].shape[0] < rows:
            _index_maps[(device, top_k)] = (
                torch.zeros(rows, top_k, dtype=torch.int32, device=device),
                torch.ones(rows, top_k, dtype=torch.float32, device=device),
            )


def reserved_bytes() -> int:
    """Bytes held by the shared payload buffers of this process (for reports and tests)."""
    with _lock:
        tensors = list(_nan_rows.values()) + list(_gammas.values())
        tensors += [t for pair in _index_maps.values() for t in pair]
    return sum(t.numel() * t.element_size() for t in tensors)


def nan_payload(
    device: torch.device,
    dtype: torch.dtype,
    hidden: int,
    top_k: int,
    tokens: int,
    has_shared_output: bool,
) -> EpilogueInputs:
    """Valid inputs for `tokens` tokens whose partial sums (and residual) are NaN on every row:
    every slot of the index map points at row 0 of a NaN gemm2_out. Views of the shared buffers;
    a T above the reservation (the overflow route) allocates."""
    reserve(device, dtype, hidden, top_k, tokens)
    key = (device, dtype, hidden)
    with _lock:
        nan, gamma = _nan_rows[key], _gammas[key]
        perm, weights = _index_maps[(device, top_k)]
    rows = nan[:tokens]
    return EpilogueInputs(
        nan[:1],
        perm[:tokens],
        weights[:tokens],
        rows if has_shared_output else None,
        rows,
        gamma,
    )


def broken_message(call: int, error: BaseException, where: str) -> str:
    """Why a bridge refuses every later call, and what recovers."""
    return (
        f"finalize_epilogue: this FusionBridge is unusable: call {call} failed on this rank "
        f"({type(error).__name__}: {str(error)[:500]}) {where}, so this rank could not keep the "
        "group's collectives in step. If the other ranks called with valid inputs, they wait in "
        "that call until the route's own timeout: the process group's timeout for NCCL/gloo and "
        "FlashInfer routes (after which the process group itself is unusable), "
        "FUSION_BRIDGE_SYMM_TIMEOUT_S for our symmetric-memory kernels. To recover, on every "
        "rank: torch.distributed.destroy_process_group(), init_process_group() again, and rebuild "
        "every FusionBridge."
    )


def add_note(error: BaseException, note: str) -> None:
    """Attach `note` to the exception's report where Python supports notes (3.11+)."""
    if hasattr(error, "add_note"):
        error.add_note(note)


def replicated_fingerprint(inputs: EpilogueInputs) -> int:
    """A checksum of the inputs every rank of the TP group holds identical (residual, index map,
    expert weights), for debug mode: ranks whose fingerprints differ are not on the same step.
    Reads every byte (a sync and a pass over [T, H]): debug mode only."""
    total = 0
    for i, t in enumerate(
        (inputs.residual, inputs.expanded_idx_to_permuted_idx, inputs.expert_weights)
    ):
        raw = t.contiguous().view(torch.uint8).reshape(-1).to(torch.int64)
        weights = torch.arange(raw.numel(), device=raw.device, dtype=torch.int64) % 65521 + 1
        total = (total * 1000003 + int((raw * weights).sum()) + i) % (1 << 61)
    return total
