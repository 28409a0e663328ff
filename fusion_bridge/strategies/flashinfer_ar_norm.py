"""FlashInfer all-reduce + residual add + RMSNorm (+ FP8 / FP4) -- the sub-path `local_fused` prefers
after our finalize+add kernel. Not a strategy of its own: it fills local_fused's all-reduce+norm slot.

trtllm_allreduce_fusion patterns: kARResidualRMSNorm; kARResidualRMSNormOutFP8Quant (its scale is a
divisor, as ours); kARResidualRMSNormOutFP4Quant only on SM >= 100 (its FP4 conversion is compiled
only there; on SM90 we run kARResidualRMSNorm and then our FP4 kernel). H % 8 == 0 suffices here
(measured correct at H=2880). Two-shot asserts T > world size, so T <= world size always goes one-shot.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..environment import Environment
from ..io import EpilogueOutputs
from ..reasons import Reason, collect, require_hidden_multiple
from ..spec import EpilogueSpec, QuantKind, Stage
from . import flashinfer_common as fic
from .base import Step, kernel_quant_args

NAME = "flashinfer_ar_norm"
_ONESHOT_MAX_MB = {2: 512, 4: 64, 8: 42, 16: 42}  # FlashInfer's B200 heuristic; tuning may override


def uses_fused_fp4(spec: EpilogueSpec, env: Environment) -> bool:
    return spec.quant.kind is QuantKind.NVFP4 and env.sm is not None and env.sm >= 100


def reasons(spec: EpilogueSpec, env: Environment) -> list[Reason]:
    return collect(fic.common_reasons(spec, env, NAME),
                   require_hidden_multiple(spec, NAME, 8, "hidden_not_multiple_of_8", " (16-byte vectors)"))


def steps(spec: EpilogueSpec, env: Environment) -> list[Step]:
    q = spec.quant.kind
    norm_quant = (Stage.ALL_REDUCE, Stage.RESIDUAL_NORM)
    if q is QuantKind.FP8 or uses_fused_fp4(spec, env):
        suffix = "_fp8" if q is QuantKind.FP8 else "_fp4"
        return [Step(f"flashinfer.ar_residual_rmsnorm{suffix}", norm_quant + (Stage.QUANT,))]
    out = [Step("flashinfer.ar_residual_rmsnorm", norm_quant)]
    if q is QuantKind.NVFP4:
        out.append(Step("local.quant_nvfp4", (Stage.QUANT,)))
    return out


class FlashInferArNorm:
    """Holds the workspace reference and the prepared scale tensor; run() is capture-safe."""

    def __init__(self, spec: EpilogueSpec, env: Environment, group, device: torch.device) -> None:
        import flashinfer.comm as fi_comm

        from ..kernels import ops
        self._ops = ops.fast  # our FP4 kernel where FlashInfer's cannot run
        self.spec, self.env, self.group, self.device = spec, env, group, device
        self._fi = fi_comm
        self.workspace = fic.acquire_workspace(group, spec, env.world_size)
        self.rank = torch.distributed.get_rank(group)
        self.max_tokens = fic.max_tokens_for(spec, env.world_size)
        self.force_oneshot: Optional[bool] = None  # tuning may pin the choice
        q = spec.quant
        pattern = fi_comm.AllReduceFusionPattern
        self.fused_fp4 = uses_fused_fp4(spec, env)
        if q.kind is QuantKind.FP8:
            self.pattern, scale = pattern.kARResidualRMSNormOutFP8Quant, q.scale
        elif self.fused_fp4:
            self.pattern, scale = pattern.kARResidualRMSNormOutFP4Quant, q.global_scale
        else:
            self.pattern, scale = pattern.kARResidualRMSNorm, None
        # a tensor made once: a float would become a host-to-device copy per call (not capturable)
        self.scale = None if scale is None else torch.tensor([scale], dtype=torch.float32, device=device)
        self.layout = None
        if self.fused_fp4:
            QuantizationSFLayout = fi_comm.QuantizationSFLayout
            self.layout = (QuantizationSFLayout.SWIZZLED_128x4 if q.sf_layout.value == "swizzled_128x4"
                           else QuantizationSFLayout.LINEAR)

    def use_oneshot(self, tokens: int) -> bool:
        if tokens <= self.env.world_size:
            return True  # two-shot asserts token_num > world_size
        if self.force_oneshot is not None:
            return self.force_oneshot
        mb = tokens * self.spec.hidden_size * 2 * self.env.world_size * 2 / 2**20
        return mb <= _ONESHOT_MAX_MB.get(self.env.world_size, 42)

    def run(self, partial: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor) -> EpilogueOutputs:
        """partial [T, H] (our finalize+add output, this rank's share) -> all outputs."""
        tokens, hidden = partial.shape
        spec = self.spec
        residual_out, norm_out = torch.empty_like(residual), torch.empty_like(residual)
        quant_out = scale_out = None
        if spec.quant.kind is QuantKind.FP8:
            quant_out = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device=partial.device)
        elif self.fused_fp4:
            from ..quant_ref import sf_shape
            quant_out = torch.empty(tokens, hidden // 2, dtype=torch.uint8, device=partial.device)
            scale_out = torch.empty(sf_shape(tokens, hidden, spec.quant.sf_layout), dtype=torch.uint8,
                                    device=partial.device)
        self._fi.trtllm_allreduce_fusion(
            allreduce_in=partial, world_size=self.env.world_size, world_rank=self.rank, token_num=tokens,
            hidden_dim=hidden, workspace_ptrs=self.workspace.workspace_tensor, launch_with_pdl=False,
            trigger_completion_at_end=True, fp32_acc=True, pattern_code=self.pattern,
            use_oneshot=self.use_oneshot(tokens), allreduce_out=None, residual_in=residual,
            residual_out=residual_out, norm_out=norm_out, quant_out=quant_out, scale_out=scale_out,
            rms_gamma=gamma, rms_eps=spec.eps, scale_factor=self.scale, layout_code=self.layout,
            weight_bias=spec.weight_bias)
        if spec.quant.kind is QuantKind.NVFP4 and not self.fused_fp4:
            quant_out, scale_out = self._ops.quantize(norm_out, *kernel_quant_args(spec))
        return EpilogueOutputs(residual_out, norm_out, quant_out, scale_out)

    def close(self) -> None:
        if self.workspace is not None:
            self.workspace = None
            fic.release_workspace(self.group, self.spec, self.env.world_size)

    @property
    def workspace_bytes(self) -> int:
        return fic.workspace_bytes(self.workspace) if self.workspace is not None else 0
