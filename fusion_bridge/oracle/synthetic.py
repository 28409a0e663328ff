"""Synthetic epilogue inputs: what the self-test, tuning, `parity` and the benchmarks run on."""

from __future__ import annotations

import torch

from fusion_bridge.epilogue_tensors import EpilogueInputs
from fusion_bridge.spec import EpilogueSpec


def make_inputs(
    spec: EpilogueSpec,
    tokens: int,
    *,
    rank: int = 0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    weight_dtype: torch.dtype = torch.float32,
    skip_fraction: float = 0.1,
    padding_rows: int = 3,
) -> EpilogueInputs:
    """Fresh random inputs for one rank.

    The routing (index map, weights), residual and gamma are the same on every rank, as in tensor
    parallelism; gemm2_out and shared_output are per-rank partial sums, drawn from a per-rank seed.
    A `skip_fraction` of the index map is -1, and every gemm2_out row that no valid index points at
    (padding, skipped slots) holds NaN, so a kernel that reads one shows it.
    """
    dev = torch.device(device)
    common = torch.Generator(device=dev).manual_seed(seed)
    # the per-rank seed wraps at 2**64 (what a generator takes), so any seed a caller may pass works
    per_rank = torch.Generator(device=dev).manual_seed(
        (seed * 7919 + 1000003 * (rank + 1)) % (1 << 64)
    )
    hidden, k = spec.hidden_size, spec.top_k
    slots = tokens * k
    rows = slots + padding_rows
    perm = (
        torch.randperm(max(slots, 1), generator=common, device=dev)[:slots]
        .reshape(tokens, k)
        .to(torch.int32)
    )
    if skip_fraction > 0 and slots:
        perm[torch.rand(tokens, k, generator=common, device=dev) < skip_fraction] = -1
    weights = torch.rand(tokens, k, generator=common, device=dev).to(weight_dtype)
    residual = torch.randn(tokens, hidden, generator=common, device=dev).to(spec.dtype)
    gamma = (1.0 + 0.1 * torch.randn(hidden, generator=common, device=dev)).to(spec.dtype)
    gemm2_out = torch.randn(rows, hidden, generator=per_rank, device=dev)
    referenced = torch.zeros(rows, dtype=torch.bool, device=dev)
    referenced[perm[perm >= 0].long()] = True
    gemm2_out[~referenced] = float("nan")
    shared = (
        torch.randn(tokens, hidden, generator=per_rank, device=dev).to(spec.dtype)
        if spec.has_shared_output
        else None
    )
    return EpilogueInputs(gemm2_out.to(spec.dtype), perm, weights, shared, residual, gamma)
