"""What a rank that failed before its collective takes part with: the group's T and a NaN payload.

The group's T (`group_tokens`) is the first dimension that more than half of the [T, ...] inputs the
spec expects give (a rank takes part only when no readable one says another T: `unanimous_tokens`):
the index map, the expert weights, residual and, when the spec has one, the shared output (all
replicated in T on every rank of the TP group), so three of four, or two of three. One malformed
tensor never changes it, and every input is validated against it (validation.py). When no T holds
such a majority (a tie, or two inputs of four wrong), this rank cannot tell which T its peers run,
and it does not guess: a payload of the wrong size would crash or corrupt the peers' collective
(gloo aborts a process that receives more bytes than it expects).
`token_votes` lists what each input says, for the error.

The NaN payload (`nan_payload`) is valid inputs of that T whose every row sums to NaN, so the peers
get NaN outputs (loud, never plausible). Its tensors are views of buffers shared by every bridge of
the process, one per (device, dtype, H) of [largest max_tokens, H] elements (117 MB at H=7168,
T=8192, bf16) plus [max_tokens, K] index/weight maps, reserved (`reserve`) when a multi-rank bridge
is built, so a failing call (perhaps failing for lack of memory) does not allocate them. A route
whose one collective is a torch.distributed all-reduce of the [T, H] partial takes part by
all-reducing rows of that buffer in place (NaN plus anything stays NaN), allocating nothing; a
route whose collective is inside its own kernels runs them on the payload (`Strategy.take_part`).
A partial in another dtype than the activations' (the fp32 `reference`) has its own buffer,
reserved only when such a strategy is a route or the shadow.

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

#: the [T, ...] inputs in the order the error lists them, by their argument names
T_INPUTS = ("expanded_idx_to_permuted_idx", "expert_weights", "shared_output", "residual")


def _first_dim(t: object) -> Optional[int]:
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return int(t.size(0)) if t.dim() == 2 else None
    except Exception:  # noqa: BLE001 - a tensor subclass whose metadata cannot be read
        return None


def token_votes(inputs: EpilogueInputs) -> dict[str, Optional[int]]:
    """{argument name: its first dimension} for each [T, ...] input (None: not a 2-D tensor).
    Never raises, whatever objects or exotic tensor layouts the caller passed."""
    return {name: _first_dim(getattr(inputs, name)) for name in T_INPUTS}


def group_tokens(inputs: EpilogueInputs, has_shared_output: bool) -> Optional[int]:
    """The call's T: the first dimension more than half of the [T, ...] inputs the spec expects
    give (four with a shared output, else three; one that is missing or not a 2-D tensor counts
    against every T). None when no T holds that majority: none is readable, or they tie or
    scatter. Never raises; one malformed tensor never changes T."""
    votes = token_votes(inputs)
    if not has_shared_output and votes["shared_output"] is not None:
        expected = 4  # a shared output the spec does not expect still holds a T
    else:
        expected = 4 if has_shared_output else 3
    dims = [d for d in votes.values() if d is not None]
    for d in dims:
        if 2 * dims.count(d) > expected:
            return d
    return None


def unanimous_tokens(inputs: EpilogueInputs, has_shared_output: bool) -> Optional[int]:
    """The T a failing rank may take part with: group_tokens' majority, and only when no readable
    [T, ...] input says another T. A rank whose inputs disagree with each other cannot tell which
    of them its peers share: three wrong of four look like one wrong of four from here, and a
    payload of the wrong size makes the peers' collective pair with this rank's next call (0 rows:
    wrong values) or gloo abort the peer (more bytes than it expects). None: do not take part."""
    tokens = group_tokens(inputs, has_shared_output)
    if tokens is None:
        return None
    dims = {d for d in token_votes(inputs).values() if d is not None}
    return tokens if dims == {tokens} else None


def votes_text(inputs: EpilogueInputs) -> str:
    """What each [T, ...] input says T is, for an error: 'expert_weights 5, residual 0, ...'."""
    return ", ".join(
        f"{name} {'not a 2-D tensor' if d is None else f'{d} rows'}"
        for name, d in token_votes(inputs).items()
        if d is not None or getattr(inputs, name) is not None
    )


def reserve(
    device: torch.device,
    dtype: torch.dtype,
    hidden: int,
    top_k: int,
    rows: int,
    partial_dtypes: tuple[torch.dtype, ...] = (),
) -> None:
    """Make sure the shared NaN payload holds at least `rows` tokens for this (device, dtype, H, K),
    and NaN rows in each of `partial_dtypes` (the all-reduced partials of the routes that take part
    by all-reducing NaN rows). Called when a multi-rank bridge is built, so a failing call never
    allocates its payload."""
    with _lock:
        for rows_dtype in (dtype, *partial_dtypes):
            key = (device, rows_dtype, hidden)
            held = _nan_rows.get(key)
            if held is None or held.shape[0] < rows:
                _nan_rows[key] = torch.full(
                    (rows, hidden), float("nan"), dtype=rows_dtype, device=device
                )
        key = (device, dtype, hidden)
        if key not in _gammas:
            _gammas[key] = torch.ones(hidden, dtype=dtype, device=device)
        maps = _index_maps.get((device, top_k))
        if maps is None or maps[0].shape[0] < rows:
            _index_maps[(device, top_k)] = (
                torch.zeros(rows, top_k, dtype=torch.int32, device=device),
                torch.ones(rows, top_k, dtype=torch.float32, device=device),
            )


def nan_rows(device: torch.device, dtype: torch.dtype, hidden: int, tokens: int) -> torch.Tensor:
    """[T, H] of NaN in `dtype`: a view of the reserved buffer (a T above the reservation, the
    overflow route, allocates). All-reducing it in place keeps it NaN."""
    with _lock:
        held = _nan_rows.get((device, dtype, hidden))
    if held is None or held.shape[0] < tokens:
        reserve(device, dtype, hidden, 1, tokens)
        with _lock:
            held = _nan_rows[(device, dtype, hidden)]
    return held[:tokens]


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
