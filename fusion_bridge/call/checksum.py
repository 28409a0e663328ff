"""One digest of a tensor's contents, for the checks that ranks hold the same inputs: debug mode's
per-call fingerprint (debug_call.py) and the Hugging Face patch's `check_same_inputs`.

`tensor_digest` is BLAKE2b over the tensor's dtype, shape and bytes in row-major order, truncated to
63 bits so it travels in an int64 and compares as a Python int. A cryptographic hash has no
algebraic structure to cancel: no choice of changes to the bytes makes two digests equal except by
chance (about 2**-63 per pair), where the weighted byte sum it replaces repeated its weights every
65521 bytes and let +9 at one weight cancel -1 at nine times that weight.

The bytes are streamed: the tensor is read in pieces of at most DIGEST_CHUNK bytes, each copied to
the host (a device tensor) and fed to the hash, so the temporaries are bounded whatever the size of
the input. A non-contiguous tensor is read piece by piece along its leading dimensions, never
copied whole. Every piece copied from a device is a host synchronisation: the digest is for debug
mode and the explicit checks, never the default call path.
"""

from __future__ import annotations

import ctypes
import hashlib
from typing import Iterator

import torch

#: the most bytes one piece of a tensor copied to the host for hashing holds
DIGEST_CHUNK = 1 << 20
_BITS = 63  # fits an int64 (the debug agreement's all_gather carries int64)


def tensor_digest(t: torch.Tensor, *, canonical_nan: bool = False) -> int:
    """BLAKE2b of `t`'s dtype, shape and bytes (row-major, whatever its strides), as an int in
    [1, 2**63): equal tensors give equal digests on every rank; different ones differ except by
    chance. Reads `t` in pieces of at most DIGEST_CHUNK bytes (no copy the size of the input).
    canonical_nan (floating dtypes): every NaN hashed as one NaN, so tensors that differ only in
    NaN payload bits agree (the model check's weights); off, a NaN's bits are hashed as they are
    (debug mode's inputs). Raises TypeError for a non-tensor, ValueError for a tensor without
    readable storage (a zero tensor, a meta tensor)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor_digest: expected a torch.Tensor, got {type(t).__name__}")
    t = t.detach()
    if t.is_meta or t._is_zerotensor():
        raise ValueError(
            "tensor_digest: the tensor has no storage to read (a meta or zero tensor); "
            "pass a materialised tensor (e.g. torch.zeros(...))"
        )
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    canonical_nan = canonical_nan and (t.is_floating_point() or t.is_complex())
    for piece in _pieces(t):
        if canonical_nan:
            piece = torch.where(torch.isnan(piece), torch.full_like(piece, float("nan")), piece)
        h.update(_host_bytes(piece))
    return (int.from_bytes(h.digest(), "little") >> (64 - _BITS)) or 1


def _pieces(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """`t`'s elements in row-major order as contiguous tensors of at most DIGEST_CHUNK bytes (or
    one element, when a single element is larger)."""
    if t.dim() == 0:
        yield t.reshape(1)
        return
    if t.is_contiguous():
        flat = t.reshape(-1)
        step = max(1, DIGEST_CHUNK // max(1, t.element_size()))
        for start in range(0, flat.numel(), step):
            yield flat[start : start + step]
        return
    row_bytes = t[0].numel() * t.element_size() if t.shape[0] else 0
    if t.dim() == 1 or row_bytes > DIGEST_CHUNK:
        if t.dim() == 1:  # one strided vector: copy a block of elements at a time
            step = max(1, DIGEST_CHUNK // max(1, t.element_size()))
            for start in range(0, t.shape[0], step):
                yield t[start : start + step].contiguous()
            return
        for row in t:  # rows too large for one piece: each row in pieces
            yield from _pieces(row)
        return
    rows = max(1, DIGEST_CHUNK // max(1, row_bytes))
    for start in range(0, t.shape[0], rows):
        yield t[start : start + rows].contiguous().reshape(-1)


def _host_bytes(piece: torch.Tensor) -> bytes:
    """The bytes of a contiguous 1-D piece: a fresh host copy of just the piece (its own storage,
    so the bytes read are the piece's and no more), whatever device it lives on."""
    host = piece.to("cpu", copy=True)
    size = host.numel() * host.element_size()
    # one copy of the bytes out of the host tensor; bytes(storage) would read them one by one
    return ctypes.string_at(host.data_ptr(), size) if size else b""
