"""`local_fused_flashinfer`: our Triton finalize+shared-add kernel, then FlashInfer's
trtllm_allreduce_fusion (all-reduce + residual add + RMSNorm, + FP8 in the same kernel).

FlashInfer patterns used: kARResidualRMSNorm; kARResidualRMSNormOutFP8Quant (its scale is a divisor,
as ours); kARResidualRMSNormOutFP4Quant only on SM >= 100, where its FP4 conversion is compiled (on
SM90 we run kARResidualRMSNorm and then our NVFP4 kernel). H % 8 == 0 suffices here (measured
correct at H=2880, where FlashInfer's MoE-finalize fusion is not).

Launch variants: "oneshot" (every rank reads every peer's whole partial; best at small T; at most
what the Lamport buffers hold) and "twoshot" (reduce-scatter + all-gather; FlashInfer asserts T >
world size, so it declares T >= world size + 1). The planner picks among the variants whose declared
token range holds the bucket, and run() launches exactly the variant it is given. Unmeasured buckets
use FlashInfer's own size heuristic. T above the workspace is not ours: the planner routes it to a
strategy without a token limit.
"""

from __future__ import annotations

from typing import Optional

import torch

from fusion_bridge.epilogue_tensors import (
    EpilogueInputs,
    EpilogueOutputs,
    deliver,
    quant_buffers,
)
from fusion_bridge.reasons import (
    collect,
    refuse_dynamic_fp8,
    require_hidden_multiple,
    require_triton,
)
from fusion_bridge.spec import QuantKind, SFLayout, Stage
from fusion_bridge.strategies import flashinfer_calls, flashinfer_common as fic
from fusion_bridge.strategies.base import Step, Strategy, kernel_quant_args, required_stages
from fusion_bridge.strategies.local_common import finalize_partial, finalize_step, hidden_fits

ONESHOT, TWOSHOT = "oneshot", "twoshot"
_USE_ONESHOT = {ONESHOT: True, TWOSHOT: False}
_ONESHOT_MAX_MB = {
    2: 512,
    4: 64,
    8: 42,
    16: 42,
}  # FlashInfer's heuristic (B200); tuning measures both


def _fused_fp4(spec, env) -> bool:
    return spec.quant.kind is QuantKind.NVFP4 and env.sm is not None and env.sm >= 100


class LocalFusedFlashInferStrategy(Strategy):
    marks_collective = True
    name = "local_fused_flashinfer"
    summary = (
        "our Triton finalize+shared-add kernel, then FlashInfer all-reduce+residual+RMSNorm(+FP8)"
    )
    self_tested = True

    @classmethod
    def not_supported_reasons(cls, spec, env):
        return collect(
            require_triton(env, cls.name),
            fic.common_reasons(spec, env, cls.name),
            require_hidden_multiple(
                spec, cls.name, 8, "hidden_not_multiple_of_8", " (16-byte vectors)"
            ),
            hidden_fits(spec, cls.name) if spec.quant.kind is QuantKind.NVFP4 else None,
            refuse_dynamic_fp8(
                spec,
                cls.name,
                "FlashInfer's all-reduce + RMSNorm writes no such format, and our quant step "
                "after it is not built: it can only be checked on two GPUs",
            ),
        )

    @classmethod
    def steps(cls, spec, env):
        q = spec.quant.kind
        ar_norm = tuple(
            s
            for s in required_stages(spec, env.world_size)
            if s in (Stage.ALL_REDUCE, Stage.RESIDUAL_NORM)
        )
        steps = [finalize_step(spec, env)]
        if q is QuantKind.FP8 or _fused_fp4(spec, env):
            return steps + [
                Step(
                    f"flashinfer.ar_residual_rmsnorm_{'fp8' if q is QuantKind.FP8 else 'fp4'}",
                    ar_norm + (Stage.QUANT,),
                )
            ]
        steps.append(Step("flashinfer.ar_residual_rmsnorm", ar_norm))
        if q is QuantKind.NVFP4:
            steps.append(Step("local.quant_nvfp4", (Stage.QUANT,)))
        return steps

    @classmethod
    def roundings(cls, spec, env):
        return 4  # finalize_add output, all-reduce output, residual add, norm output

    @classmethod
    def max_tokens_per_call(cls, spec, env):
        return fic.max_tokens_for(spec, env.world_size)

    @classmethod
    def variants(cls, spec, env):
        return (ONESHOT, TWOSHOT)

    @classmethod
    def variant_tokens(cls, spec, env):
        elem = torch.finfo(spec.dtype).bits // 8
        return {
            ONESHOT: (1, fic.lamport_max_tokens(spec.hidden_size, elem, env.world_size)),
            TWOSHOT: (env.world_size + 1, None),  # FlashInfer asserts T > world size
        }

    @classmethod
    def default_variant(cls, spec, env, tokens: Optional[int]) -> str:
        if tokens is not None and tokens <= env.world_size:
            return ONESHOT
        mb = (tokens or spec.max_tokens) * spec.hidden_size * 2 * env.world_size * 2 / 2**20
        return ONESHOT if mb <= _ONESHOT_MAX_MB.get(env.world_size, 42) else TWOSHOT

    def this_rank_resource_reasons(self):
        return collect(fic.memory_reason(self.spec, self.env.world_size, self.device, self.name))

    def prepare(self) -> None:
        """Collective: acquires the FlashInfer workspace shared with flashinfer_fused."""
        import flashinfer.comm as fi_comm

        from fusion_bridge.kernels import ops

        spec, env = self.spec, self.env
        self._ops, self._fi = ops.direct_when_eager, fi_comm
        self._quant = kernel_quant_args(spec)
        self._workspace = fic.acquire_workspace(self.group, spec, env.world_size)
        self._rank = torch.distributed.get_rank(self.group)
        pattern, q = fi_comm.AllReduceFusionPattern, spec.quant
        self._fused_fp4 = _fused_fp4(spec, env)
        scale, self._layout = None, None
        if q.kind is QuantKind.FP8:
            self._pattern, scale = pattern.kARResidualRMSNormOutFP8Quant, q.scale
        elif self._fused_fp4:
            self._pattern, scale = pattern.kARResidualRMSNormOutFP4Quant, q.global_scale
            layouts = fi_comm.QuantizationSFLayout
            self._layout = (
                layouts.SWIZZLED_128x4 if q.sf_layout is SFLayout.SWIZZLED_128x4 else layouts.LINEAR
            )
        else:
            self._pattern = pattern.kARResidualRMSNorm
        # a tensor made once: a Python float would become a host-to-device copy per call
        # (not capturable)
        self._scale = (
            None
            if scale is None
            else torch.tensor([scale], dtype=torch.float32, device=self.device)
        )
        # FlashInfer's compiled entry point with the per-bridge arguments bound (its public wrapper
        # when the internals differ from the pinned version): the wrapper adds host time on every
        # call (docs/performance.md#figures-behind-the-codes-choices)
        self._ar = flashinfer_calls.AllReduceFusionCall(
            fi_comm,
            self._workspace,
            world_size=env.world_size,
            rank=self._rank,
            hidden=spec.hidden_size,
            dtype=spec.dtype,
            pattern=self._pattern,
            scale_factor=self._scale,
            layout=self._layout,
            eps=spec.eps,
            weight_bias=spec.weight_bias,
        )

    @property
    def workspace_bytes(self) -> int:
        ws = getattr(self, "_workspace", None)
        return fic.workspace_bytes(ws) if ws is not None else 0

    def run(
        self,
        inputs: EpilogueInputs,
        variant: str = ONESHOT,
        out: Optional[EpilogueOutputs] = None,
    ) -> EpilogueOutputs:
        if variant not in _USE_ONESHOT:
            raise ValueError(
                f"{self.name}: variant must be one of {ONESHOT, TWOSHOT}, got {variant!r}"
            )
        spec, tokens = self.spec, inputs.tokens
        partial = finalize_partial(self._ops, spec, inputs)
        residual_out, norm_out = (
            (torch.empty_like(inputs.residual), torch.empty_like(inputs.residual))
            if out is None
            else (out.residual_out, out.norm_out)
        )
        quant_out = scale_out = None
        if spec.quant.kind is QuantKind.FP8 or self._fused_fp4:
            quant_out, scale_out = (
                quant_buffers(
                    tokens, spec.hidden_size, spec.quant.kind, spec.quant.sf_layout, partial.device
                )
                if out is None
                else (out.quant, out.scale)
            )
            if (
                scale_out is not None
            ):  # swizzled padding must read 0; not verified that FlashInfer writes it
                scale_out.zero_()
        with self.collective():
            self._ar(
                partial,
                tokens,
                _USE_ONESHOT[variant],  # the call refuses a T outside the variant's range
                inputs.residual,
                residual_out,
                norm_out,
                quant_out,
                scale_out,
                inputs.gamma,
            )
        if spec.quant.kind is QuantKind.NVFP4 and not self._fused_fp4:
            quant_out, scale_out = self._ops.quantize(norm_out, *self._quant)
        return deliver(out, EpilogueOutputs(residual_out, norm_out, quant_out, scale_out))

    def close(self) -> None:
        workspace, self._workspace = getattr(self, "_workspace", None), None
        if workspace is not None:
            fic.release_workspace(self.group, self.spec, self.env.world_size, workspace)
