"""The token mixer's term of the logits bound in hf_moe_bound.py (`mixer_term`): a mixer's output
at position t reads every position <= t of its sequence, so the input error it passes on is the
largest over those positions (`causal_max`), continued across the calls of one run (a generate's
decode steps after its prefill)."""

from __future__ import annotations

import torch


def causal_max(
    eps: torch.Tensor, shape: tuple[int, int] | None, before: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the largest of `eps` over the positions <= its own of its sequence, and over
    `before` ([B]: the earlier calls' positions of the same sequences). eps: flattened tokens,
    sequence by sequence, `shape` (B, S) of them (None: one sequence). NaN (no bound) spreads to
    every later position. -> (that maximum, flattened as eps; the new running maximum [B])."""
    rows = eps.reshape(shape if shape is not None else (1, -1))
    if before is not None:
        if before.shape[0] != rows.shape[0]:
            raise ValueError(f"{rows.shape[0]} sequences continue a run of {before.shape[0]}")
        rows = torch.cat([before[:, None].to(rows.dtype), rows], dim=1)
    rows = torch.cummax(rows, dim=1).values
    if before is not None:
        rows = rows[:, 1:]
    return rows.reshape(eps.shape), rows[:, -1]


def mixer_term(eps_in, gain, rounds, shape=None, carry=None, layer=None) -> torch.Tensor:
    """A^2 eps^2 + roundings per token at a token mixer's output, eps^2 the causal maximum of its
    input's squared relative error `eps_in` (causal_max): its output at t mixes every position
    <= t of the sequence (attention through its keys and values, a delta rule through its state),
    and its gain (MIXER_GAIN, DeltaGain) holds for one relative error over them all, so the
    largest bounds them (the gains grow with each position's error). `carry[layer]` continues the
    sequences of an earlier call and is updated in place."""
    before = carry.get(layer) if carry is not None else None
    eps, running = causal_max(eps_in, shape, before)
    if carry is not None:
        carry[layer] = running
    # no error in, none out (also where a derived gain is infinite); NaN stays NaN
    return torch.where(eps == 0, torch.zeros_like(eps), gain * eps + rounds)
