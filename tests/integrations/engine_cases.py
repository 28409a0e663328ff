"""Inputs of the engine-handoff tests, built as the engines build them, and their float64 oracle.

One MoE layer over `world` tensor-parallel ranks: E experts, rank r holds the experts e with
e % world == r (an expert map, vLLM-style: -1 for the others), so each rank's index map has -1
where another rank holds the slot's expert. Rows of gemm2_out that no local slot reads hold NaN,
so reading one shows. Buffers may hold more tokens than the call (`t_buf` >= T), as FlashInfer's
and SGLang's do. Replicated things (routing, residual, norm weight) come from one generator, each
rank's partials (rows, shared output) from a generator of its own, so any rank can rebuild every
rank's inputs for the oracle (tests/oracle64.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tests.oracle64 import epilogue64, normwise_rel_err

H, K, E = 64, 4, 8
EPS = 1e-6
FACTOR = 2.5  # the model's routed_scaling_factor
BF16 = torch.bfloat16


@dataclass
class Pieces:
    """One rank's MoE output before the finalize. weights: [t_buf, K] fp32, without the factor."""

    topk_ids: torch.Tensor
    weights: torch.Tensor
    expert_map: torch.Tensor
    perm: torch.Tensor  # [t_buf, K] int32, expanded -> permuted, -1 where not local
    gemm2: torch.Tensor  # [P, H] bf16, NaN in rows no local slot reads
    shared: torch.Tensor  # [T, H] bf16: this rank's partial (or the replicated whole)
    residual: torch.Tensor
    norm_weight: torch.Tensor  # [H] bf16, stored weight (zero-centred when gemma)


def pieces(
    tokens: int,
    t_buf: int,
    world: int,
    rank: int,
    *,
    route_major: bool = False,
    replicated_shared: bool = False,
    gemma: bool = False,
    seed: int = 0,
) -> Pieces:
    same = torch.Generator().manual_seed(seed)
    mine = torch.Generator().manual_seed(1000 + 17 * seed + rank)
    topk_ids = torch.stack([torch.randperm(E, generator=same)[:K] for _ in range(t_buf)])
    weights = torch.rand(t_buf, K, generator=same) + 0.1
    expert_map = torch.full((E,), -1, dtype=torch.int32)
    local = torch.arange(E)[torch.arange(E) % world == rank]
    expert_map[local] = torch.arange(local.numel(), dtype=torch.int32)
    rows = t_buf * K if route_major else t_buf * K + 3
    order = torch.arange(rows) if route_major else torch.randperm(rows, generator=same)
    perm = order[: t_buf * K].view(t_buf, K).to(torch.int32)
    perm = perm.masked_fill(expert_map[topk_ids] < 0, -1)
    gemm2 = torch.full((rows, H), float("nan"), dtype=BF16)
    used = perm[perm >= 0].long()
    gemm2[used] = torch.randn(used.numel(), H, generator=mine).to(BF16)
    shared_gen = same if replicated_shared else mine
    shared = (0.5 * torch.randn(tokens, H, generator=shared_gen)).to(BF16)
    residual = torch.randn(tokens, H, generator=same).to(BF16)
    if gemma:
        norm_weight = (0.1 * torch.randn(H, generator=same)).to(BF16)
    else:
        norm_weight = (1 + 0.1 * torch.randn(H, generator=same)).to(BF16)
    return Pieces(topk_ids, weights, expert_map, perm, gemm2, shared, residual, norm_weight)


def handoff_weights(p: Pieces, folded: bool, dtype: torch.dtype) -> torch.Tensor:
    """The routing weights as the engine hands them over: with the model's factor folded in, or
    not; in `dtype` (bf16: the activation dtype, fp32: the router's)."""
    return (p.weights * FACTOR if folded else p.weights).to(dtype)


def oracle(
    tokens: int,
    t_buf: int,
    world: int,
    *,
    folded: bool,
    w_dtype: torch.dtype,
    weight_bias: float = 0.0,
    replicated_shared: bool = False,
    shared: bool = True,
    ranks: Optional[int] = None,
    **kw,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual_out, norm_out) float64 of the layer: the routed partial of each of the first
    `ranks` (default: all `world`) ranks with the model's factor applied once, the shared output
    once per rank (a partial) or once in all (replicated), the residual, the norm with
    (weight + weight_bias)."""
    rank_inputs = []
    for r in range(world if ranks is None else ranks):
        p = pieces(tokens, t_buf, world, r, replicated_shared=replicated_shared, **kw)
        s = p.shared if shared and (r == 0 or not replicated_shared) else None
        w = handoff_weights(p, folded, w_dtype)[:tokens]
        rank_inputs.append((p.gemm2, p.perm[:tokens], w, s))
    return epilogue64(
        rank_inputs,
        p.residual,
        p.norm_weight,
        eps=EPS,
        weight_bias=weight_bias,
        routed_scaling=1.0 if folded else FACTOR,
    )


def errors(out, exact: tuple) -> tuple[float, float]:
    """Norm-wise relative errors of (residual_out, norm_out) against the oracle."""
    return normwise_rel_err(out.residual_out, exact[0]), normwise_rel_err(out.norm_out, exact[1])


# the separate strategy's bound (README): sqrt(4+1) * 2^-8, with room for the bf16 weights
BOUND = 1.5e-2


def check(out, exact: tuple, what: str = "") -> tuple[float, float]:
    got = errors(out, exact)
    assert max(got) < BOUND, (what, got)
    return got


def none_if(flag: bool, value: object) -> Optional[object]:
    return None if flag else value
