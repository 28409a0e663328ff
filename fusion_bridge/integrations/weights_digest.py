"""A content hash of a model's weights, so the ranks of a group can check they hold the same model.

Every rank of the Hugging Face patch holds the whole model and computes its share of the experts;
if two ranks' weights differ, each computes another model's experts and the sums are plausible but
wrong. A per-parameter sum cannot see that: two experts (or two rows of one) swapped give the same
sum, and a NaN weight makes the sums unequal even between identical models. So each parameter is
hashed by content: its dtype, its shape and its bytes in order (BLAKE2b), with every NaN written as
one canonical NaN first, so identical models agree whatever NaN payloads they carry and any
permutation of values changes the digest.

The bytes are read in chunks of CHUNK_ELEMENTS (copied to the host one chunk at a time), so hashing
never holds a second copy of a large parameter.
"""

from __future__ import annotations

import hashlib

import torch

#: elements read (and copied to the host) per step
CHUNK_ELEMENTS = 1 << 22


def tensor_digest(t: torch.Tensor) -> str:
    """The hex BLAKE2b digest of `t`'s dtype, shape and values in row-major order, every NaN as one
    canonical NaN (floating dtypes)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    flat = t.detach().reshape(-1)
    canonical_nan = t.is_floating_point() or t.is_complex()
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        chunk = flat[start : start + CHUNK_ELEMENTS]
        if canonical_nan:
            chunk = torch.where(torch.isnan(chunk), torch.full_like(chunk, float("nan")), chunk)
        h.update(chunk.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def parameter_digests(model: torch.nn.Module) -> dict[str, str]:
    """{parameter name: tensor_digest} for every parameter of `model`, in its named order."""
    return {name: tensor_digest(p) for name, p in model.named_parameters()}
