"""FlashInfer's two fused comm kernels called through their compiled module functions, with what is
fixed per bridge bound once, instead of through the Python wrappers.

Per call, `flashinfer.comm.trtllm_allreduce_fusion` goes through a `typing_extensions.deprecated`
wrapper (a warning filtered per call), re-derives the one-shot choice and the Lamport size from the
call, converts `scale_factor` to fp32, looks the module up, and passes 23 arguments by keyword twice
before the compiled function sees them. `AllReduceFusionCall` / `MoeFinalizeCall` bind the
workspace pointers, world size and rank, hidden size, pattern, scale tensor, SF layout, eps, weight
bias and flags once, keep every check of the wrapper that depends on the call, and call the compiled
function positionally:

- trtllm_allreduce_fusion: two-shot requires token_num > world_size (the wrapper asserts it; raised
  here as ValueError); and, as a memory-safety guard the bridge's routing already implies,
  token_num <= the workspace's max_token_num. Two of the wrapper's choices are not taken here,
  because the planner alone chooses the variant: `use_oneshot` must be True or False (the wrapper's
  None asks FlashInfer's size heuristic), and one-shot above the Lamport buffers raises ValueError
  (the wrapper switches to two-shot with a warning). These checks run before either path.
- trtllm_moe_finalize_allreduce_fusion: residual_in bytes * world_size > MAX_COMM_SIZE raises
  ValueError, as the wrapper does (backend "trtllm" only).

The FlashInfer internals this relies on, and the checks that decide between the direct call and
the public wrapper, are in flashinfer_internals.py.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from fusion_bridge.log import get_logger
from fusion_bridge.strategies.flashinfer_common import MAX_COMM_SIZE, lamport_max_tokens
from fusion_bridge.strategies.flashinfer_internals import (  # noqa: F401 - re-exported: tests and tools read them here
    ALLREDUCE_FUSION_ARGS,
    MOE_FINALIZE_ARGS,
    VERIFIED_WRAPPERS,
    compiled_call_order,
    compiled_function,
    wrapper_fingerprint,
)

_log = get_logger("strategies.flashinfer_calls")


def _report(who: str, reason: Optional[str]) -> None:
    if reason is not None:
        _log.info("%s: calling flashinfer's public wrapper (%s)", who, reason)


class AllReduceFusionCall:
    """trtllm_allreduce_fusion for one bridge: `call(allreduce_in, token_num, use_oneshot,
    residual_in, residual_out, norm_out, quant_out, scale_out, rms_gamma)`. allreduce_out is None
    (the patterns we use write norm_out); `scale_factor` must be an fp32 tensor made
    once (or None)."""

    name = "trtllm_allreduce_fusion"

    def __init__(
        self,
        fi_comm,
        workspace,
        *,
        world_size: int,
        rank: int,
        hidden: int,
        dtype: torch.dtype,
        pattern: int,
        scale_factor: Optional[torch.Tensor],
        layout: Optional[int],
        eps: float,
        weight_bias: float,
        launch_with_pdl: bool = False,
        trigger_completion_at_end: bool = True,
        fp32_acc: bool = True,
        direct: bool = True,
    ):
        self._fi = fi_comm
        self.workspace_ptrs = workspace.workspace_tensor
        meta = getattr(workspace, "metadata", None) or {}
        if meta and meta.get("tp_size", world_size) != world_size:
            raise ValueError(
                f"{self.name}: workspace tp_size {meta['tp_size']} != world_size {world_size}"
            )
        self.max_tokens = (
            meta["max_token_num"] * meta["hidden_dim"] // hidden
            if "max_token_num" in meta and "hidden_dim" in meta
            else None
        )
        if "use_fp32_lamport" in meta and meta["use_fp32_lamport"] != (dtype == torch.float32):
            raise ValueError(
                f"{self.name}: workspace use_fp32_lamport={meta['use_fp32_lamport']} does not "
                "match "
                f"dtype {dtype}"
            )
        if scale_factor is not None and not isinstance(scale_factor, torch.Tensor):
            raise TypeError(
                f"{self.name}: scale_factor must be a tensor made once (a float would be copied to "
                f"the device per call), got {type(scale_factor).__name__}"
            )
        if scale_factor is not None and scale_factor.dtype != torch.float32:
            scale_factor = scale_factor.to(
                torch.float32
            )  # once, where the wrapper converts per call
        self.world_size, self.rank, self.hidden, self.dtype = world_size, rank, hidden, dtype
        self.pattern, self.scale_factor, self.layout = pattern, scale_factor, layout
        self.eps, self.weight_bias = float(eps), float(weight_bias)
        self.pdl, self.trigger, self.fp32_acc = launch_with_pdl, trigger_completion_at_end, fp32_acc
        element_bytes = 4 if dtype == torch.float32 else 2
        self.oneshot_max_tokens = lamport_max_tokens(hidden, element_bytes, world_size)
        fn, reason = (
            compiled_function(self.name, ALLREDUCE_FUSION_ARGS)
            if direct
            else (None, "direct=False")
        )
        self.direct, self.reason = fn, reason
        _report(self.name, reason)

    def __call__(
        self,
        allreduce_in: torch.Tensor,
        token_num: int,
        use_oneshot: bool,
        residual_in: torch.Tensor,
        residual_out: torch.Tensor,
        norm_out: torch.Tensor,
        quant_out: Optional[torch.Tensor],
        scale_out: Optional[torch.Tensor],
        rms_gamma: torch.Tensor,
    ) -> None:
        world_size = self.world_size
        if self.max_tokens is not None and token_num > self.max_tokens:
            raise ValueError(
                f"{self.name}: token_num {token_num} exceeds the workspace's {self.max_tokens} "
                "tokens (an illegal memory access in FlashInfer)"
            )
        if use_oneshot is True:
            if token_num > self.oneshot_max_tokens:
                raise ValueError(
                    f"{self.name}: one-shot holds at most {self.oneshot_max_tokens} tokens (the "
                    f"Lamport buffers), got token_num={token_num}; the planner chooses two-shot "
                    "there (FlashInfer's wrapper would switch silently)"
                )
        elif use_oneshot is False:
            if token_num <= world_size:
                raise ValueError(
                    f"{self.name}: two-shot needs token_num > world_size, got token_num="
                    f"{token_num} and world_size={world_size} (FlashInfer asserts it)"
                )
        else:
            raise TypeError(
                f"{self.name}: use_oneshot must be True or False (the planner chooses the "
                f"variant), got {use_oneshot!r}"
            )
        fn = self.direct
        if fn is None:
            return self._public(
                allreduce_in,
                token_num,
                use_oneshot,
                residual_in,
                residual_out,
                norm_out,
                quant_out,
                scale_out,
                rms_gamma,
            )
        fn(
            allreduce_in,
            world_size,
            self.rank,
            token_num,
            self.hidden,
            self.workspace_ptrs,
            self.pdl,
            use_oneshot,
            self.trigger,
            self.fp32_acc,
            self.pattern,
            None,
            residual_in,
            residual_out,
            norm_out,
            quant_out,
            scale_out,
            rms_gamma,
            self.eps,
            self.scale_factor,
            self.layout,
            None,
            self.weight_bias,
        )

    def _public(
        self,
        allreduce_in,
        token_num,
        use_oneshot,
        residual_in,
        residual_out,
        norm_out,
        quant_out,
        scale_out,
        rms_gamma,
    ) -> None:
        self._fi.trtllm_allreduce_fusion(
            allreduce_in=allreduce_in,
            world_size=self.world_size,
            world_rank=self.rank,
            token_num=token_num,
            hidden_dim=self.hidden,
            workspace_ptrs=self.workspace_ptrs,
            launch_with_pdl=self.pdl,
            trigger_completion_at_end=self.trigger,
            fp32_acc=self.fp32_acc,
            pattern_code=self.pattern,
            use_oneshot=use_oneshot,
            allreduce_out=None,
            residual_in=residual_in,
            residual_out=residual_out,
            norm_out=norm_out,
            quant_out=quant_out,
            scale_out=scale_out,
            rms_gamma=rms_gamma,
            rms_eps=self.eps,
            scale_factor=self.scale_factor,
            layout_code=self.layout,
            weight_bias=self.weight_bias,
        )


class MoeFinalizeCall:
    """trtllm_moe_finalize_allreduce_fusion (backend "trtllm") for one bridge: `call(allreduce_in,
    residual_in, norm_weight, expanded_idx_to_permuted_idx, norm_out, residual_out, quant_out,
    scale_out, shared_expert_output, expert_scale_factor)`. expert_scale_factor must already be in
    the activation dtype (FlashInfer reads it so, unchecked)."""

    name = "trtllm_moe_finalize_allreduce_fusion"

    def __init__(
        self,
        fi_comm,
        workspace,
        *,
        world_size: int,
        rank: int,
        eps: float,
        routed_scaling_factor: Optional[float],
        weight_bias: float,
        launch_with_pdl: bool = False,
        direct: bool = True,
    ):
        self._fi = fi_comm
        self.workspace_ptrs = workspace.workspace_tensor
        self.world_size, self.rank, self.eps = world_size, rank, float(eps)
        self.routed_scaling_factor = (
            None if routed_scaling_factor is None else float(routed_scaling_factor)
        )
        self.weight_bias, self.pdl = float(weight_bias), launch_with_pdl
        self.max_comm_size = MAX_COMM_SIZE
        fn, reason = (
            compiled_function(self.name, MOE_FINALIZE_ARGS) if direct else (None, "direct=False")
        )
        self.direct, self.reason = fn, reason
        _report(self.name, reason)

    def __call__(
        self,
        allreduce_in: torch.Tensor,
        residual_in: torch.Tensor,
        norm_weight: torch.Tensor,
        expanded_idx_to_permuted_idx: torch.Tensor,
        norm_out: Optional[torch.Tensor],
        residual_out: Optional[torch.Tensor],
        quant_out: Optional[torch.Tensor],
        scale_out: Optional[torch.Tensor],
        shared_expert_output: Optional[torch.Tensor],
        expert_scale_factor: Optional[torch.Tensor],
    ) -> None:
        fn = self.direct
        if fn is None:
            return self._public(
                allreduce_in,
                residual_in,
                norm_weight,
                expanded_idx_to_permuted_idx,
                norm_out,
                residual_out,
                quant_out,
                scale_out,
                shared_expert_output,
                expert_scale_factor,
            )
        required = residual_in.numel() * residual_in.element_size() * self.world_size
        if required > self.max_comm_size:
            raise ValueError(
                f"required_lamport_comm_size {required} is greater than MAX_COMM_SIZE "
                f"{self.max_comm_size}. Cannot use oneshot in this case."
            )
        fn(
            allreduce_in,
            residual_in,
            norm_weight,
            expanded_idx_to_permuted_idx,
            norm_out,
            residual_out,
            quant_out,
            scale_out,
            self.pdl,
            self.workspace_ptrs,
            self.rank,
            self.world_size,
            self.eps,
            shared_expert_output,
            expert_scale_factor,
            self.routed_scaling_factor,
            self.weight_bias,
        )

    def _public(
        self,
        allreduce_in,
        residual_in,
        norm_weight,
        expanded_idx_to_permuted_idx,
        norm_out,
        residual_out,
        quant_out,
        scale_out,
        shared_expert_output,
        expert_scale_factor,
    ) -> None:
        self._fi.trtllm_moe_finalize_allreduce_fusion(
            allreduce_in=allreduce_in,
            residual_in=residual_in,
            norm_weight=norm_weight,
            expanded_idx_to_permuted_idx=expanded_idx_to_permuted_idx,
            norm_out=norm_out,
            residual_out=residual_out,
            quant_out=quant_out,
            scale_out=scale_out,
            workspace_ptrs=self.workspace_ptrs,
            launch_with_pdl=self.pdl,
            world_rank=self.rank,
            world_size=self.world_size,
            eps=self.eps,
            shared_expert_output=shared_expert_output,
            expert_scale_factor=expert_scale_factor,
            routed_scaling_factor=self.routed_scaling_factor,
            weight_bias=self.weight_bias,
        )


def describe(call: Any) -> str:
    """One line for reports: which path a bound call takes and why."""
    return f"{call.name}: " + (
        "compiled function, pre-bound"
        if call.direct is not None
        else f"public wrapper ({call.reason})"
    )
