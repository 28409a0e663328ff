"""A replicated shared output added once (`EpilogueSpec.shared_output_replicated=True`).

Every rank holds the whole shared expert's output; the all-reduce sums the ranks' partials, so the
group's rank 0 adds it and every other rank adds exact zeros in its place (x + 0 == x in every
dtype): the same strategies, kernels and collectives on every rank, no per-rank branch in what
runs, nothing read from the device. The zeros are a reserved [rows, H] buffer per (device, dtype,
H) shared by the process's bridges (rows: the largest max_tokens asked for so far), so a call
within max_tokens allocates nothing and can be captured in a CUDA graph; a call above it (the
overflow route, eager in practice) takes a zeroed [T, H] of its own.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from fusion_bridge.epilogue_tensors import EpilogueInputs
from fusion_bridge.spec import EpilogueSpec

#: (device, dtype, hidden) -> the largest zero buffer reserved so far
_ZEROS: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}

SharedOnce = Callable[[EpilogueInputs, int], EpilogueInputs]


def _zeros(device: torch.device, dtype: torch.dtype, hidden: int, rows: int) -> torch.Tensor:
    key = (device, dtype, hidden)
    held = _ZEROS.get(key)
    if held is None or held.shape[0] < rows:
        held = _ZEROS[key] = torch.zeros(rows, hidden, dtype=dtype, device=device)
    return held


def shared_once(
    spec: EpilogueSpec, group, world_size: int, device: torch.device
) -> Optional[SharedOnce]:
    """What this rank's calls do to their inputs so a replicated shared output is added once:
    None where nothing changes (the spec's shared output is a per-rank partial, one rank, or the
    group's rank 0); elsewhere a function (inputs, T) -> the inputs with shared_output a [T, H] of
    exact zeros (a view of the reserved buffer for T <= max_tokens). Built once per bridge (reads
    this rank's place in `group`: no collective)."""
    if not spec.shared_output_replicated or world_size == 1 or dist.get_rank(group) == 0:
        return None
    zeros = _zeros(device, spec.dtype, spec.hidden_size, spec.max_tokens)[: spec.max_tokens]

    def replace(inputs: EpilogueInputs, tokens: int) -> EpilogueInputs:
        if tokens <= zeros.shape[0]:
            return inputs._replace(shared_output=zeros[:tokens])
        return inputs._replace(shared_output=torch.zeros_like(inputs.residual))

    return replace
