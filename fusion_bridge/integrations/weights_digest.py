"""A content hash of a model's weights, so the ranks of a group can check they hold the same model.

Every rank of the Hugging Face patch computes its share of the experts; if two ranks' weights
differ, each computes another model's experts and the sums are plausible but wrong. A
per-parameter sum cannot see that: two experts (or two rows of one) swapped give the same sum, and
a NaN weight makes the sums unequal even between identical models. So each parameter is hashed by
content: its dtype, its shape and its bytes in order (BLAKE2b), with every NaN written as one
canonical NaN first, so identical models agree whatever NaN payloads they carry and any
permutation of values changes the digest.

A model loaded sharded by transformers (`from_pretrained(..., tp_plan="auto")`) holds some
parameters as DTensors. A replicated one (every placement `Replicate()`) is hashed by its local
tensor, which is the whole tensor on every rank. A sharded one holds a different shard on every
rank by design, so its content cannot be compared across ranks: `shard_layouts` records its
placements, its global shape and whether its local shape is the one those placements give this
rank, and the ranks compare that instead.

The digest is the project's one (fusion_bridge/call/checksum.py): the bytes are read in bounded
pieces, copied to the host one piece at a time, so hashing never holds a second copy of a large
parameter.
"""

from __future__ import annotations

from typing import Optional

import torch

from fusion_bridge import tensor_digest

try:
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # a torch without DTensor: no model can hold one
    DTensor, Replicate = None, None

# what shard_layouts says of a shard whose local shape is the one its placements give this rank
AS_EXPECTED = "local shape as expected"


def is_dtensor(t) -> bool:
    """Whether t is a torch DTensor (a parameter transformers' tensor parallelism distributed)."""
    return DTensor is not None and isinstance(t, DTensor)


def is_sharded(t) -> bool:
    """Whether t is a DTensor with a placement other than Replicate() (different on every rank)."""
    return is_dtensor(t) and not all(isinstance(p, Replicate) for p in t.placements)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local tensor (no copy), any other tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def _digests(named) -> dict[str, int]:
    return {
        name: tensor_digest(local(t), canonical_nan=True) for name, t in named if not is_sharded(t)
    }


def parameter_digests(model: torch.nn.Module) -> dict[str, int]:
    """{parameter name: tensor_digest (every NaN alike)} for every parameter of `model` the ranks
    must hold equal, in its named order: every plain parameter and replicated DTensor (sharded
    ones: shard_layouts)."""
    return _digests(model.named_parameters())


def buffer_digests(model: torch.nn.Module) -> dict[str, int]:
    """{buffer name: tensor_digest (every NaN alike)} for every buffer of `model` (a routing
    correction bias such as `e_score_correction_bias`, a rotary `inv_freq`), persistent or not;
    a sharded DTensor buffer is left to shard_layouts."""
    return _digests(model.named_buffers())


def expected_local_shape(t) -> Optional[tuple[int, ...]]:
    """The local shape the DTensor t's placements give this rank on its mesh (torch's own rule),
    or None where this torch cannot say."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        return None
    shape, _ = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(shape)


def shard_layouts(model: torch.nn.Module) -> dict[str, str]:
    """{name: 'placements ...; global shape ...; <AS_EXPECTED or what differs>'} for every sharded
    DTensor parameter and buffer of `model`: equal on every rank of a correctly sharded model
    (the local shapes themselves may differ by rank, e.g. a shorter last shard), and unequal, or
    not AS_EXPECTED, where a rank holds a shard its placements do not give it."""
    out = {}
    for kind, named in (("", model.named_parameters()), ("buffer ", model.named_buffers())):
        for name, t in named:
            if not is_sharded(t):
                continue
            have, want = tuple(t.to_local().shape), expected_local_shape(t)
            fits = (
                AS_EXPECTED
                if want is None or have == want
                else f"local shape {have}, expected {want}"
            )
            placements = ", ".join(repr(p) for p in t.placements)
            out[f"{kind}{name}"] = (
                f"placements ({placements}); global shape {tuple(t.shape)}; {fits}"
            )
    return out
