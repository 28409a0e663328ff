"""What a rank that failed before its collective takes part with: the group's T and a NaN payload.

The group's T is the first dimension most of the [T, ...] inputs agree on (`group_tokens`: the
index map, the expert weights, the shared output and `residual`, all replicated in T on every rank
of the TP group; on a tie, residual's). Every input is validated against it (validation.py), so a
rank with one malformed tensor still knows which T its peers are running.

The NaN payload (`nan_payload`) is valid inputs of that T whose every row sums to NaN, so the peers
get NaN outputs (loud, never plausible). Its tensors are views of buffers shared by every bridge of
the process, one per (device, dtype, H) of [largest max_tokens, H] elements (117 MB at H=7168,
T=8192, bf16) plus [max_tokens, K] index/weight maps, reserved (`reserve`) when a multi-rank bridge
is built, so a failing call (perhaps failing for lack of memory) does not allocate them. Taking part
then allocates only what the planned route allocates itself for T tokens (its outputs and, for some
routes, one [T, H] partial), the same memory the failed call had just released.

The protocol that uses them is in failure.py.
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
