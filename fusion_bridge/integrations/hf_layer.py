"""One MoE decoder layer of a Hugging Face model on the bridge (transformers.py patches them): this
rank's share of the block (router, routed experts, shared expert), the bridge call with the next
norm's weight, the handoff of its norm_out to that norm, and what a failure before the call does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from fusion_bridge import EpilogueOutputs, FusionBridge
from fusion_bridge.integrations.hf_experts import routed_rows, shared_partial
from fusion_bridge.integrations.hf_families import Family
from fusion_bridge.integrations.hf_forward import ForwardAccount
from fusion_bridge.integrations.hf_handoff import HANDOFF_ATTR
from fusion_bridge.integrations.hf_param_watch import ParameterWatch


@dataclass
class PatchedMoELayer:
    """One MoE decoder layer on the bridge. local_experts: the routed experts this rank computes;
    shared_columns: its intermediate columns of the shared expert (None: the family has none);
    next_norm: the name of the RMSNorm the bridge computes in this layer's epilogue;
    shared_sharded: the shared expert is the TP plan's shard (its local weights are used whole);
    experts_sharded: the routed experts are the EP plan's shard (its local weights, global ids)."""

    index: int
    bridge: FusionBridge
    family: Family
    block: torch.nn.Module
    local_experts: range
    shared_columns: Optional[range]
    next_norm: str
    norm_module: torch.nn.Module
    multiplier: float = 1.0  # m of the layer's `residual + h * m` (1.0: a plain residual add)
    shared: Optional[torch.nn.Module] = None  # the shared expert MLP (the block's or the layer's)
    account: Optional[ForwardAccount] = None  # the forward's bridge calls (hf_forward)
    # the shared expert is sharded by transformers' TP plan: shared_columns are its local shard's
    shared_sharded: bool = False
    # the routed experts are the EP plan's local shard: local_experts are the global ids of its
    # experts 0.. (transformers 5.25's expert parallelism), not a block of replicated experts
    experts_sharded: bool = False
    # the parameters the layer reads, as patched: every call checks them first (hf_param_watch)
    watch: Optional[ParameterWatch] = None

    def explain(self, tokens: Optional[int] = None):
        """The bridge's report for this layer (strategy per token bucket, every rejection)."""
        return self.bridge.explain(tokens)

    def expert_share(self, x: torch.Tensor):
        """This rank's share of the block on x [T, H] (the post-attention-norm activations):
        (gemm2_out, index map, expert weights, shared output or None), the bridge's inputs. A
        shared expert of the decoder layer (`shared_on_layer`) is left to `shared_share`, which
        its own patched forward calls. Raises RuntimeError first when a parameter the layer reads
        was replaced or re-sharded since patching (hf_param_watch)."""
        if self.watch is not None:
            self.watch.check()
        weights, ids = self.family.routing(self.block, x)
        held_from = self.local_experts.start if self.experts_sharded else 0
        gemm2_out, index_map = routed_rows(
            x, ids, self.block.experts, self.local_experts, held_from=held_from
        )
        shared = None
        if self.shared is not None and not self.family.shared_on_layer:
            shared = self.shared_share(x)
        return gemm2_out, index_map, weights, shared

    def shared_share(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the shared output on x [T, H], times the residual multiplier."""
        partial = shared_partial(x, self.shared, self.shared_columns, self.family.shared_act)
        shared = self.family.shared_output(self.block, x, partial)
        if self.multiplier != 1.0:  # residual + m * (routed + shared)
            shared = shared * self.multiplier
        return shared

    def epilogue(self, x: torch.Tensor, residual: torch.Tensor) -> EpilogueOutputs:
        """x [T, H]: the post-attention-norm activations; residual [T, H]: the stream before it."""
        gemm2_out, index_map, weights, shared = self.expert_share(x)
        if self.shared is not None and self.family.shared_on_layer:
            shared = self.shared_share(x)
        return self._finalize((gemm2_out, index_map, weights, shared), residual)

    def start(self, x: torch.Tensor) -> Callable[..., torch.Tensor]:
        """The block's work on x [T, H] up to the bridge; returns finish(residual [..., H],
        shared=None) -> residual_out, which runs the bridge (with a layer's shared share where
        given) and leaves its norm_out for the next norm."""
        gemm2_out, index_map, weights, own_shared = self.expert_share(x)

        def finish(residual: torch.Tensor, shared: Optional[torch.Tensor] = None) -> torch.Tensor:
            share = (gemm2_out, index_map, weights, own_shared if shared is None else shared)
            out = self._finalize(share, residual.reshape(-1, residual.shape[-1]))
            residual_out = out.residual_out.view(residual.shape)
            norm_out = out.norm_out.view(residual.shape)
            # with residual_out's version: an in-place edit before the next norm (a forward hook's
            # `out.add_(v)`) makes the norm compute itself again (hf_handoff.handoff_forward)
            version = None if residual_out.is_inference() else residual_out._version
            self.norm_module.__dict__[HANDOFF_ATTR] = (residual_out, norm_out, version)
            return residual_out

        return finish

    def _finalize(self, share, residual: torch.Tensor) -> EpilogueOutputs:
        gemm2_out, index_map, weights, shared = share
        gamma = self.norm_module.weight.detach()
        out = None
        if torch.is_inference_mode_enabled() and not torch.compiler.is_compiling():
            # outputs that are not inference tensors, so they carry a version counter: the next
            # norm sees an in-place edit (hf_handoff.handoff_forward) under inference_mode too
            shape, dtype = tuple(residual.shape), self.bridge.spec.dtype
            with torch.inference_mode(False):
                out = EpilogueOutputs(
                    torch.empty(shape, dtype=dtype, device=residual.device),
                    torch.empty(shape, dtype=dtype, device=residual.device),
                )
        if self.account is not None:  # from here the call counts: the bridge keeps it in step
            self.account.calling(self.index, residual.shape[0])
        out = self.bridge.finalize_epilogue(
            gemm2_out, index_map, weights, shared, residual, gamma, out=out
        )
        if self.account is not None:
            self.account.returned()
        return out

    def fail(self, tokens: int, error: BaseException):
        """This layer's work before its bridge call failed on this rank with `error`: take part in
        the call with a NaN payload of T (FusionBridge.fail_call), then raise `error`."""
        if self.account is not None:
            self.account.calling(self.index, tokens)
        self.bridge.fail_call(tokens, error)

    def grad_reason(self, x: torch.Tensor) -> Optional[str]:
        """Why a call on x would need autograd through the bridge (None: it would not): autograd
        is recording and x, or a parameter of the block, its shared expert or the fused norm,
        requires grad. The bridge computes no gradient, so a backward would be wrong."""
        if not torch.is_grad_enabled():
            return None
        if x.requires_grad:
            return "its input requires grad (a parameter or input before it does)"
        modules = (self.block, self.shared, self.norm_module)
        for module in modules:
            if module is not None and any(p.requires_grad for p in module.parameters()):
                return f"the parameters of {type(module).__name__} require grad"
        return None
