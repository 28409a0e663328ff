"""What vLLM's and SGLang's deferred-finalize handoffs share on their way into the bridge, and the
same call for a direct caller, with every convention stated by name.

A deferred-finalize handoff carries the routed experts' permuted, unweighted rows (`gemm2_out`),
the routing weights, a map between (token, slot) and rows, and a shared-expert output. Four
conventions decide what the epilogue means, and each has a silently wrong reading:

- **the index map's direction.** The bridge reads `expanded_idx_to_permuted_idx`: for token t and
  slot k, the row of `gemm2_out` that holds it (-1: skipped, e.g. an expert on another rank). The
  reverse map (row -> t*K + k) has the same dtype and, viewed as [T, K], the same shape. So a map
  enters here only as an `ExpandedToPermuted`, whose constructors say what they read
  (`from_2d`: a [T, K] map; `from_flat`: FlashInfer's 1-D buffer, viewed as [-1, K][:T]).
- **the routed scale.** Engines fold `routed_scaling_factor` into the routing weights or leave it
  to the finalize; the handoff says which (`scale_to_apply`), and the bridge's spec must apply
  exactly that factor: equal, or the call is refused (never a factor applied twice or not at all).
- **the shared output.** A per-rank partial (each rank's slice of a tensor-parallel shared expert)
  is summed over the ranks with the routed partials; a replicated one (every rank holds the whole
  shared expert's output) must be added once. The handoff says which (`shared_replicated`) and the
  bridge's spec must say the same (`shared_output_replicated`: then the bridge adds it once, rank
  0's partial carrying it and the others zeros); a spec that differs is refused.
- **the norm's weight.** engine_norms.py: a module, its stored weight, or its applied multiplier.

The rows: the bridge reads `gemm2_out` as a contiguous [P, H]. A buffer that holds rows packed at H
in another shape (1-D, or [..., H]) is viewed as [-1, H], which is exact. A [P, H_pad] buffer with
H_pad != H is refused, because it is either padded rows or packed rows in a padded allocation, and
only its producer knows which; the message gives both fixes.

Nothing here reads a tensor's values or synchronizes: the checks read metadata, the views are
views (a replicated shared output is the bridge's to add once: call/shared_once.py), so the call
can be captured in a CUDA graph like the bridge's own.

Refusals here come before the bridge's call, so they depend only on what is alike on every rank of
the group by the engines' contracts (the spec, the handoff's classes, flags and scaling factor, the
buffers' sizes for the replicated T and K): every rank refuses together and no collective is left
waiting. What may differ per rank (a tensor's device, dtype or rows, an index value) is left to the
bridge's own checks, whose failure protocol keeps the group in step when one rank fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from fusion_bridge import EpilogueOutputs, FusionBridge
from fusion_bridge.integrations.engine_norms import HandoffError, norm_gamma


def _fail(who: str, name: str, expected: str, actual: object, fix: str = "") -> None:
    raise HandoffError(
        f"{who}: {name} must be {expected}, got {actual}" + (f"; {fix}" if fix else "")
    )


@dataclass(frozen=True)
class ExpandedToPermuted:
    """The index map in the bridge's direction: `map[t, k]` is the row of gemm2_out that holds
    token t's slot k, or -1 (skipped). [T, K] int32, contiguous. Build it with `from_2d` or
    `from_flat`, which say what they read; a map in the other direction (permuted row -> t*K + k)
    has no constructor here."""

    map: torch.Tensor

    @staticmethod
    def from_2d(index_map: torch.Tensor, tokens: Optional[int] = None) -> "ExpandedToPermuted":
        """A [T', K] expanded->permuted map (vLLM's `expanded_idx_to_permuted_idx`); with `tokens`
        its first `tokens` rows (T' >= tokens: a buffer sized for more tokens)."""
        _tensor("ExpandedToPermuted.from_2d", "index_map", index_map, 2)
        return ExpandedToPermuted(_first_rows("ExpandedToPermuted.from_2d", index_map, tokens))

    @staticmethod
    def from_flat(index_buffer: torch.Tensor, tokens: int, top_k: int) -> "ExpandedToPermuted":
        """FlashInfer's 1-D deferred index buffer: entry t*K + k is the row of (t, k). Viewed as
        [-1, K][:tokens], as SGLang's `MoeDeferredFinalize.from_flashinfer` views it; a buffer
        shorter than tokens*K, or not a multiple of K, is refused."""
        who = "ExpandedToPermuted.from_flat"
        _tensor(who, "index_buffer", index_buffer, 1)
        n = index_buffer.shape[0]
        if n < tokens * top_k or n % top_k:
            _fail(
                who,
                "index_buffer's length",
                f"a multiple of top_k ({top_k}) and at least tokens * top_k ({tokens * top_k})",
                n,
                "pass the buffer the kernel wrote for these tokens (it must hold every token's "
                "top_k entries)",
            )
        return ExpandedToPermuted(index_buffer.view(-1, top_k)[:tokens])


def _tensor(who: str, name: str, t: object, dim: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != dim:
        shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        _fail(who, name, f"a {dim}-D tensor", shape)


def _first_rows(who: str, t: torch.Tensor, tokens: Optional[int], name: str = "index_map"):
    """t[:tokens] (a contiguous tensor's first rows are contiguous), refused when shorter."""
    if tokens is None:
        return t
    if t.shape[0] < tokens:
        _fail(
            who,
            f"{name}'s rows",
            f"at least the handoff's token count {tokens}",
            t.shape[0],
        )
    return t[:tokens]


def token_rows(who: str, name: str, t: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """A routing tensor (weights) as [tokens, K]: a 2-D [T' >= tokens, K] buffer's first rows, a
    1-D buffer viewed as [-1, K][:tokens] (refused when shorter than tokens*K)."""
    if isinstance(t, torch.Tensor) and t.dim() == 1:
        if t.shape[0] < tokens * top_k or t.shape[0] % top_k:
            _fail(
                who,
                f"{name}'s length",
                f"a multiple of top_k ({top_k}) and at least tokens * top_k ({tokens * top_k})",
                t.shape[0],
            )
        return t.view(-1, top_k)[:tokens]
    _tensor(who, name, t, 2)
    return _first_rows(who, t, tokens, name)


def rows_at_hidden(who: str, gemm2_out: torch.Tensor, hidden: int) -> torch.Tensor:
    """gemm2_out as the bridge reads it, [P, H] packed at H: itself when 2-D at H; a contiguous
    buffer of another shape whose last dimension is H (or 1-D of a multiple of H) viewed as
    [-1, H]; a 2-D [P, H_pad] buffer refused with both fixes (module docstring)."""
    if not isinstance(gemm2_out, torch.Tensor) or gemm2_out.dim() == 0:
        _fail(who, "gemm2_out", f"a tensor of rows packed at hidden_size ({hidden})", gemm2_out)
    shape = list(gemm2_out.shape)
    if gemm2_out.dim() == 2 and shape[1] == hidden:
        return gemm2_out
    packed = gemm2_out.dim() == 1 and shape[0] % hidden == 0
    packed = packed or (gemm2_out.dim() > 2 and shape[-1] == hidden)
    if packed and gemm2_out.is_contiguous():
        return gemm2_out.view(-1, hidden)
    _fail(
        who,
        "gemm2_out",
        f"rows packed at hidden_size ({hidden}): [P, {hidden}]",
        f"shape {shape}",
        f"if its rows are padded to {shape[-1]} columns, pass gemm2_out[:, :{hidden}]"
        ".contiguous() (a copy); if they are packed at hidden_size in a larger allocation, pass "
        f"gemm2_out.view(-1, {hidden}) (the bridge cannot tell which)",
    )


def check_scale(who: str, bridge: FusionBridge, scale_to_apply: float, source: str) -> None:
    """Refuse a spec whose routed_scaling_factor is not the factor the handoff still needs."""
    spec_factor = bridge.spec.routed_scaling_factor
    if float(scale_to_apply) != spec_factor:
        folded = float(scale_to_apply) == 1.0
        why = (
            "the routing weights already carry the model's factor, so the spec's would apply "
            "it a second time"
            if folded
            else "the weights do not carry it, so the spec must apply it"
        )
        _fail(
            who,
            "the bridge's spec.routed_scaling_factor",
            f"{float(scale_to_apply)!r}, the factor still to apply ({source}; {why})",
            spec_factor,
            f"build the bridge's EpilogueSpec with routed_scaling_factor={float(scale_to_apply)!r}",
        )


def check_shared(who: str, bridge: FusionBridge, shared_replicated: bool) -> None:
    """Refuse a spec that reads the handoff's shared output the other way: a replicated one
    summed over the ranks (W times), or a per-rank partial added once."""
    spec_replicated = bridge.spec.shared_output_replicated
    if shared_replicated != spec_replicated:
        what = "replicated on every rank" if shared_replicated else "each rank's partial"
        _fail(
            who,
            "the bridge's spec.shared_output_replicated",
            f"{shared_replicated} (the handoff's shared output is {what})",
            spec_replicated,
            f"build the bridge's EpilogueSpec with shared_output_replicated={shared_replicated}",
        )


def finalize_handoff(
    bridge: FusionBridge,
    gemm2_out: torch.Tensor,
    index_map: ExpandedToPermuted,
    expert_weights: torch.Tensor,
    shared_output: Optional[torch.Tensor],
    residual: torch.Tensor,
    *,
    scale_to_apply: float,
    shared_replicated: bool,
    norm: Optional[torch.nn.Module] = None,
    norm_weight: Optional[torch.Tensor] = None,
    applied_gamma: Optional[torch.Tensor] = None,
    out: Optional[EpilogueOutputs] = None,
    who: str = "finalize_handoff",
    scale_source: str = "scale_to_apply",
) -> EpilogueOutputs:
    """One epilogue call with every convention named (module docstring); collective over the
    bridge's group.

    gemm2_out: rows packed at H ([P, H], or any contiguous buffer of such rows), act dtype.
    index_map: ExpandedToPermuted ([T, K] int32). expert_weights [T, K] fp32/bf16/fp16.
    shared_output [T, H] act dtype or None. residual [T, H] act dtype.
    scale_to_apply: the routed scaling factor the weights do not carry yet (1.0 when folded in);
    must equal the spec's. shared_replicated: the shared output is the whole shared expert's
    output on every rank (added once) rather than this rank's partial; must equal the spec's
    shared_output_replicated. The norm: exactly one of
    norm / norm_weight / applied_gamma (engine_norms.py). who / scale_source: the names errors
    give the caller and the scale's origin. out: preallocated outputs for the bridge's call
    (FusionBridge.finalize_epilogue says what they must be; never the residual). Returns the
    bridge's EpilogueOutputs (residual_out, norm_out [T, H] act dtype, quant/scale when the spec
    quantizes; `out` itself when given; unpacks as `norm_out, residual_out`)."""
    if not isinstance(index_map, ExpandedToPermuted):
        _fail(
            who,
            "index_map",
            "an ExpandedToPermuted (ExpandedToPermuted.from_2d(map) for a [T, K] map from "
            "(token, slot) to gemm2_out's row, .from_flat(buffer, T, K) for a 1-D one), so that "
            "its direction is stated",
            type(index_map).__name__,
        )
    if not isinstance(shared_replicated, bool):
        _fail(who, "shared_replicated", "a bool", type(shared_replicated).__name__)
    check_scale(who, bridge, scale_to_apply, scale_source)
    gamma = norm_gamma(
        bridge.spec, norm=norm, norm_weight=norm_weight, applied_gamma=applied_gamma, who=who
    )
    if shared_output is not None:
        check_shared(who, bridge, shared_replicated)
    return bridge.finalize_epilogue(
        rows_at_hidden(who, gemm2_out, bridge.spec.hidden_size),
        index_map.map,
        expert_weights,
        shared_output,
        residual,
        gamma,
        out=out,
    )
