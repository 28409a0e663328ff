"""Checks at the call. Cheap metadata checks always run; value checks (index range, T across ranks)
need a device-to-host read or a collective, so they run on CPU tensors or in debug mode only.

Debug mode: FusionBridge(..., debug=True) or FUSION_BRIDGE_DEBUG=1. It syncs, so never capture a
CUDA graph with it on.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from fusion_bridge.call.payload import group_tokens, token_votes, votes_text
from fusion_bridge.epilogue_tensors import EpilogueInputs
from fusion_bridge.epilogue_tensors import EpilogueInputError  # noqa: F401 (re-exported)
from fusion_bridge.spec import EXPERT_WEIGHT_DTYPES, EpilogueSpec


def _fail(name: str, expected: str, actual: object) -> None:
    raise EpilogueInputError(f"finalize_epilogue: {name} must be {expected}, got {actual}")


def _check_tensor(name: str, t: object, shape: tuple, dtypes: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(name, "a torch.Tensor", type(t).__name__)
    _require_dense(name, t)
    if t.dtype not in dtypes:
        _fail(f"{name}.dtype", " or ".join(str(d) for d in dtypes), t.dtype)
    if tuple(t.shape) != shape:
        _fail(f"{name}.shape", str(list(shape)), list(t.shape))
    if t.device != device:
        _fail(f"{name}.device", str(device), t.device)
    if not t.is_contiguous():
        _fail(name, "contiguous (call .contiguous())", f"strides {t.stride()}")


ZERO_TENSOR = "a zero tensor (torch._efficientzerotensor: no storage for a kernel to read)"


def zero_tensor_error(inputs: EpilogueInputs) -> Optional["EpilogueInputError"]:
    """The error naming the first input that is a zero tensor, or None. The hot path's checks do
    not look for them (they cost a call per input); the failure path asks, so a kernel's "invalid
    python storage" error is reported as what it is."""
    for name, t in zip(inputs._fields, inputs):
        try:
            zero = isinstance(t, torch.Tensor) and t._is_zerotensor()
        except Exception:  # noqa: BLE001 - an exotic tensor: not a zero tensor
            zero = False
        if zero:
            return EpilogueInputError(
                f"finalize_epilogue: {name} must be a tensor with storage (e.g. torch.zeros(...)), "
                f"got {ZERO_TENSOR}"
            )
    return None


def _require_dense(name: str, t: torch.Tensor) -> None:
    """Sparse and nested tensors: their other metadata (shape, strides) may not even be readable.
    Negative and conjugate views: their memory holds other values than they show (a lazy bit),
    and a kernel reading the memory (Triton, FlashInfer) would compute with those."""
    if t.is_nested or t.layout is not torch.strided:
        _fail(name, "a dense (strided) tensor", "a nested tensor" if t.is_nested else t.layout)
    if t._is_zerotensor():
        _fail(name, "a tensor with storage (e.g. torch.zeros(...))", ZERO_TENSOR)
    if t.is_neg() or t.is_conj():
        lazy = "a negative view" if t.is_neg() else "a conjugate view"
        _fail(
            name,
            "a tensor whose memory holds its values (call .resolve_neg() or .resolve_conj())",
            lazy,
        )


def validate_inputs(spec: EpilogueSpec, inputs: EpilogueInputs, device: torch.device) -> None:
    """Metadata checks: types, dtypes, shapes, device, contiguity. No sync, capture-safe.

    The call's T is the first dimension more than half of the [T, ...] inputs give
    (payload.group_tokens), so a rank with one malformed tensor still knows the T its peers
    run; every tensor is checked against it."""
    tokens, hidden = group_tokens(inputs, spec.has_shared_output), spec.hidden_size
    if tokens is None and all(d is None for d in token_votes(inputs).values()):
        _fail(
            "residual",
            "a dense 2-D tensor [T, hidden_size] (T is the first dimension the [T, ...] inputs "
            "agree on, and none of them is a 2-D tensor)",
            type(inputs.residual).__name__,
        )
    if tokens is None:
        majority = "three of four" if spec.has_shared_output else "two of three"
        _fail(
            "the token count T of the [T, ...] inputs",
            f"given by more than half of them (the same first dimension in {majority})",
            votes_text(inputs),
        )
    perm = inputs.expanded_idx_to_permuted_idx
    if not isinstance(perm, torch.Tensor):
        _fail("expanded_idx_to_permuted_idx", "a torch.Tensor", type(perm).__name__)
    _require_dense("expanded_idx_to_permuted_idx", perm)
    if perm.dim() != 2:
        _fail(
            "expanded_idx_to_permuted_idx",
            "2-D [T, top_k]",
            f"{perm.dim()}-D shape {list(perm.shape)}",
        )
    if perm.shape[1] != spec.top_k:
        _fail(
            "expanded_idx_to_permuted_idx.shape[1] (top_k)",
            f"{spec.top_k} (spec.top_k)",
            perm.shape[1],
        )
    _check_tensor(
        "expanded_idx_to_permuted_idx",
        perm,
        (tokens, spec.top_k),
        (torch.int32,),
        device,
    )
    g = inputs.gemm2_out
    if isinstance(g, torch.Tensor):
        _require_dense("gemm2_out", g)
    if not isinstance(g, torch.Tensor) or g.dim() != 2:
        _fail("gemm2_out", "a 2-D tensor [P, hidden_size]", getattr(g, "shape", type(g).__name__))
    _check_tensor("gemm2_out", g, (g.shape[0], hidden), (spec.dtype,), device)
    _check_tensor(
        "expert_weights",
        inputs.expert_weights,
        (tokens, spec.top_k),
        EXPERT_WEIGHT_DTYPES,
        device,
    )
    if spec.has_shared_output:
        if inputs.shared_output is None:
            _fail("shared_output", "a tensor (spec.has_shared_output=True)", None)
        _check_tensor(
            "shared_output",
            inputs.shared_output,
            (tokens, hidden),
            (spec.dtype,),
            device,
        )
    elif inputs.shared_output is not None:
        _fail("shared_output", "None (spec.has_shared_output=False)", "a tensor")
    _check_tensor("residual", inputs.residual, (tokens, hidden), (spec.dtype,), device)
    _check_tensor("gamma", inputs.gamma, (hidden,), (spec.dtype,), device)


def input_check(spec: EpilogueSpec, device: torch.device) -> Callable[[EpilogueInputs], bool]:
    """The same metadata checks as validate_inputs, as one function with the spec's values bound,
    for the hot path (cheaper than reading them from the spec per call; docs/performance.md has the
    measurement). It returns False on any mismatch: then call validate_inputs, which says what is
    wrong."""
    dtype, top_k, hidden, shared = spec.dtype, spec.top_k, spec.hidden_size, spec.has_shared_output
    int32, weight_dtypes, gamma_shape = torch.int32, EXPERT_WEIGHT_DTYPES, (hidden,)
    cuda_index = device.index if device.type == "cuda" else None

    def check(inputs: EpilogueInputs) -> bool:
        g, p, w, s, r, gamma = inputs
        try:
            p_shape = p.shape
            r_shape = (p_shape[0], hidden)
            if not (
                p.dtype is int32
                and len(p_shape) == 2
                and p_shape[1] == top_k
                and g.dtype is dtype
                and r.dtype is dtype
                and gamma.dtype is dtype
                and w.dtype in weight_dtypes
                and w.shape == p_shape
                and r.shape == r_shape
                and gamma.shape == gamma_shape
                and g.dim() == 2
                and g.shape[1] == hidden
                and p.is_contiguous()
                and g.is_contiguous()
                and w.is_contiguous()
                and r.is_contiguous()
                and gamma.is_contiguous()
                and not (g.is_neg() or w.is_neg() or r.is_neg() or gamma.is_neg() or p.is_neg())
            ):
                return False
            if shared:
                if s is None or not (
                    s.dtype is dtype and s.shape == r_shape and s.is_contiguous() and not s.is_neg()
                ):
                    return False
            elif s is not None:
                return False
            if cuda_index is not None:
                return (
                    g.get_device() == cuda_index
                    and p.get_device() == cuda_index
                    and w.get_device() == cuda_index
                    and r.get_device() == cuda_index
                    and gamma.get_device() == cuda_index
                    and (s is None or s.get_device() == cuda_index)
                )
            return (
                g.device == device
                and p.device == device
                and w.device == device
                and r.device == device
                and gamma.device == device
                and (s is None or s.device == device)
            )
        except Exception:  # noqa: BLE001 - not a tensor, a 0-D map, an exotic layout: say what
            return False

    return check


def validate_index_values(inputs: EpilogueInputs) -> None:
    """Every index in [-1, P). Reads values: host sync on GPU."""
    perm, rows = inputs.expanded_idx_to_permuted_idx, inputs.gemm2_out.shape[0]
    if perm.numel() == 0:
        return
    lo, hi = int(perm.min()), int(perm.max())
    if lo < -1 or hi >= rows:
        bad = perm[(perm < -1) | (perm >= rows)]
        _fail(
            "expanded_idx_to_permuted_idx values",
            f"in [-1, {rows}) (gemm2_out has {rows} rows)",
            f"{bad.numel()} out of range, e.g. {int(bad[0])}",
        )


def check_token_limit(tokens: int, limit: Optional[int], strategy: str) -> None:
    if limit is not None and tokens > limit:
        _fail(
            "the token count T",
            f"<= {limit} for strategy {strategy!r} (its workspace size; "
            "raise EpilogueSpec.max_tokens or use strategy='auto', which reroutes)",
            tokens,
        )
