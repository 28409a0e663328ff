"""A content hash of a model's weights, so the ranks of a group can check they hold the same model.

Every rank of the Hugging Face patch holds the whole model and computes its share of the experts;
if two ranks' weights differ, each computes another model's experts and the sums are plausible but
wrong. A per-parameter sum cannot see that: two experts (or two rows of one) swapped give the same
sum, and a NaN weight makes the sums unequal even between identical models. So each parameter is
hashed by content: its dtype, its shape and its bytes in order (BLAKE2b), with every NaN written as
one canonical NaN first, so identical models agree whatever NaN payloads they carry and any
permutation of values changes the digest.

The digest is the project's one (fusion_bridge/call/checksum.py): the bytes are read in bounded
pieces, copied to the host one piece at a time, so hashing never holds a second copy of a large
parameter.
"""

from __future__ import annotations

import torch

from fusion_bridge import tensor_digest


def parameter_digests(model: torch.nn.Module) -> dict[str, int]:
    """{parameter name: tensor_digest (every NaN alike)} for every parameter of `model`, in its
    named order."""
    return {name: tensor_digest(p, canonical_nan=True) for name, p in model.named_parameters()}


def buffer_digests(model: torch.nn.Module) -> dict[str, int]:
    """{buffer name: tensor_digest (every NaN alike)} for every buffer of `model` (a routing
    correction bias such as `e_score_correction_bias`, a rotary `inv_freq`), persistent or not."""
    return {name: tensor_digest(b, canonical_nan=True) for name, b in model.named_buffers()}
