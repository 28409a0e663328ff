"""How a patched MoE block hands its work to the bridge inside transformers' own decoder layer.

Every supported decoder layer ends, in its own forward:

    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)          # (gpt-oss: `hidden_states, _ = ...`)
    hidden_states = residual + hidden_states         # (granitemoe: residual + hidden_states * m)

The patch leaves that forward (and the token mixer before it: attention, linear attention, caches,
whatever this transformers release passes) untouched and replaces only the block's `forward`. The
patched block routes with the block's own router and computes this rank's expert rows and shared
partial, then returns a `Handoff`: an empty tensor subclass standing for the block's output. The
layer's `residual + hidden_states` reaches `Handoff.__torch_function__` before any kernel runs;
there the bridge finalizes, all-reduces, adds exactly that residual and computes the next RMSNorm,
and the add returns the bridge's residual_out. So the residual is the layer's own, nothing is
computed twice, and any other use of the block's output (a layer structure the patch does not
know) raises instead of computing something else.

The next norm (the next layer's input_layernorm, or the final norm) returns the bridge's norm_out
when it is called on exactly that residual_out, unedited (its version counter unchanged), instead
of computing the norm again.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from fusion_bridge.integrations.hf_families import UnsupportedModelError

# on a norm: (residual_out, norm_out, residual_out's version or None) of the MoE layer that just
# ran, or None
HANDOFF_ATTR = "_fusion_bridge_handoff"
_ADDS = {torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.add, torch.add}
_MULS = {torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.mul, torch.mul}
_SHOWN = {torch.Tensor.__repr__, torch.Tensor.__format__}


class Handoff(torch.Tensor):
    """What a patched MoE block returns in place of its output: no data (an empty tensor); adding
    it to the residual runs the bridge (`finish(residual)`) and returns the bridge's
    residual_out. Used once."""

    finish: Callable[[torch.Tensor], torch.Tensor]
    where: str
    multiplier: float  # the layer must multiply the handoff by this before adding it (1.0: no)

    @staticmethod
    def make(
        where: str, finish: Callable[[torch.Tensor], torch.Tensor], multiplier: float = 1.0
    ) -> "Handoff":
        handoff = torch.Tensor._make_subclass(Handoff, _EMPTY)
        handoff.finish, handoff.where, handoff.multiplier = finish, where, multiplier
        return handoff

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        handoffs = [a for a in args if isinstance(a, Handoff)]
        if func in _SHOWN and handoffs:
            return f"<fusion_bridge handoff of {handoffs[0].where}: add it to the residual>"
        if func in _MULS and len(args) == 2 and not kwargs and len(handoffs) == 1:
            # `h * m` of a family whose layer adds residual + h * m: the bridge already folded m
            # into both partials; exactly that m, once
            handoff = handoffs[0]
            factor = args[1] if args[0] is handoff else args[0]
            finish = handoff.__dict__.pop("finish", None)
            if handoff.multiplier != 1.0 and factor == handoff.multiplier and finish is not None:
                return Handoff.make(handoff.where, finish)
        if func in _ADDS and len(args) == 2 and not kwargs and len(handoffs) == 2:
            # granitemoeshared's `moe + shared_mlp(x)`: the layer's shared share joins the
            # block's handoff (each exactly once), which still waits for its residual add
            shares = [a for a in args if isinstance(a, SharedShare)]
            moe = [a for a in args if not isinstance(a, SharedShare)]
            if len(shares) == 1 and len(moe) == 1:
                finish = moe[0].__dict__.pop("finish", None)
                partial = shares[0].__dict__.pop("partial", None)
                if finish is not None and partial is not None:
                    joined = functools.partial(finish, shared=partial)
                    return Handoff.make(moe[0].where, joined, moe[0].multiplier)
        if (
            func in _ADDS
            and len(args) == 2
            and not kwargs
            and len(handoffs) == 1
            and handoffs[0].multiplier == 1.0
            and not isinstance(handoffs[0], SharedShare)
        ):
            handoff = handoffs[0]
            residual = args[1] if args[0] is handoff else args[0]
            finish = handoff.__dict__.pop("finish", None)
            if isinstance(residual, torch.Tensor) and finish is not None:
                return finish(residual)
        name = getattr(func, "__name__", repr(func))
        where = handoffs[0].where if handoffs else "a patched MoE block"
        raise UnsupportedModelError(
            f"patch_moe_epilogues: the decoder layer of {where} used its MoE block's output in "
            f"{name}(...); the patch supports exactly one `residual + mlp(...)` per call, the "
            "structure every supported family's decoder layer has, and refuses anything else "
            "rather than compute it without the block's output"
        )


_EMPTY = torch.empty(0)


class SharedShare(Handoff):
    """What a decoder layer's patched shared MLP returns (granitemoeshared): no data; this rank's
    shared partial rides along until the layer adds it to its MoE block's handoff."""

    partial: torch.Tensor

    @staticmethod
    def carry(where: str, partial: torch.Tensor) -> "SharedShare":
        share = torch.Tensor._make_subclass(SharedShare, _EMPTY)
        share.where, share.partial, share.multiplier = where, partial, 1.0
        return share


def shared_forward(shared: torch.nn.Module, where: str, layer_patch) -> Callable:
    """The forward of a decoder layer's shared MLP (`shared_on_layer`): this rank's share of it
    on x, carried to the layer's `moe + shared_mlp(x)`."""

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        partial = layer_patch.shared_share(hidden_states.reshape(-1, shape[-1]))
        return SharedShare.carry(f"{where}'s shared MLP", partial)

    return forward


def block_forward(block: torch.nn.Module, where: str, layer_patch, family) -> Callable:
    """The MoE block's forward on the bridge: `layer_patch.start(x [T, H])` routes and computes
    this rank's share and returns finish(residual [..., H]) -> residual_out; the block returns the
    handoff as its family's block returns its output (with the m of the layer's `residual + h * m`,
    already folded into the bridge's scaling: the handoff accepts exactly that product). Refused
    before any work: training mode, extra arguments, and autograd through the bridge (it computes
    no gradient). Whatever fails in the work before the bridge call (router, expert GEMMs, shared
    expert) takes part in the layer's call with a NaN payload, then raises (`layer_patch.fail`)."""

    def forward(hidden_states: torch.Tensor, *args, **kwargs):
        if block.training:
            raise RuntimeError(
                f"patch_moe_epilogues: {where} is in training mode (model.train() was called "
                "after patching); the bridge is an inference epilogue without autograd. Call "
                "patch.unpatch() before training, or model.eval() to keep running patched"
            )
        if args or kwargs:
            raise UnsupportedModelError(
                f"patch_moe_epilogues: {where} must be called with the hidden states alone, as "
                f"its decoder layer calls it; got {len(args)} more positional and keyword "
                f"arguments {sorted(kwargs)}"
            )
        needs_grad = layer_patch.grad_reason(hidden_states)
        if needs_grad is not None:
            raise RuntimeError(
                f"patch_moe_epilogues: {where} was called with autograd recording "
                f"(torch.is_grad_enabled() is True and {needs_grad}); the bridge computes no "
                "gradients, so a backward through the patched model would be wrong (the fused "
                "norm's weight would get none, the parameters before the layer wrong ones). Run "
                "the patched model under torch.no_grad() or torch.inference_mode(), or call "
                "model.requires_grad_(False) first; to backpropagate, patch.unpatch() and run "
                "the model's own code"
            )
        shape = hidden_states.shape
        try:
            finish = layer_patch.start(hidden_states.reshape(-1, shape[-1]))
        except BaseException as error:  # noqa: BLE001 - the peers wait in this layer's call
            layer_patch.fail(shape[:-1].numel(), error)
            raise
        return family.block_output(Handoff.make(where, finish, layer_patch.multiplier))

    return forward


def handoff_forward(norm: torch.nn.Module, on_reuse: Callable[[], None]) -> Callable:
    """The norm's forward, except on the exact tensor an MoE layer just returned, unedited: then
    the bridge already computed this norm (norm_out), and it is returned instead of computed
    twice. A tensor edited in place since (a forward hook's `out.add_(v)`: its version counter
    moved) gets the norm computed again, from what it holds now. (Under torch.inference_mode the
    patch has the bridge write into tensors made outside it, which carry a version counter; an
    inference tensor, which has none, always gets the norm computed again.)"""
    own_forward = norm.forward  # bound before the patch replaces it

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        handoff = norm.__dict__.get(HANDOFF_ATTR)
        norm.__dict__[HANDOFF_ATTR] = None  # used at most once; never held past the next call
        if (
            handoff is not None
            and handoff[0] is hidden_states
            and handoff[2] is not None
            and hidden_states._version == handoff[2]
        ):
            on_reuse()
            return handoff[1]
        return own_forward(hidden_states)

    return forward
