"""`local_fused`: our fused finalize + shared-add kernel, then the best available all-reduce + residual
add + RMSNorm (+ quant) sub-path.

Sub-paths for the all-reduce + norm slot (static preference, first that can run wins; measured tuning
may override per token bucket):
  1. "flashinfer_ar_norm": FlashInfer trtllm_allreduce_fusion (AR + residual + RMSNorm [+FP8/FP4]), if
     registered in ALL_REDUCE_NORM_SUBPATHS and supported;
  2. "nccl_local_norm": torch.distributed all_reduce (NCCL), then our add+RMSNorm(+quant) kernel.
With world size 1 the all-reduce is skipped: finalize_add, then our add+RMSNorm(+quant) kernel.

On CPU it runs under TRITON_INTERPRET=1 only (tests, `parity`); auto never picks it there.
"""

from __future__ import annotations

import torch.distributed as dist

from ..io import EpilogueInputs, EpilogueOutputs
from ..reasons import Reason, collect, require_sm_at_least, require_triton
from ..spec import QuantKind, Stage
from .base import Step, Strategy, required_stages

MAX_HIDDEN = 32768  # one token row per program, held in registers
_QUANT_CODE = {QuantKind.NONE: 0, QuantKind.FP8: 1, QuantKind.NVFP4: 2}


def _needs_device(env) -> Reason | None:
    if env.device_type == "cuda" or env.triton_interpret:
        return None
    return Reason("needs_cuda_or_interpreter",
                  f"local_fused runs Triton kernels: it requires a CUDA device, or TRITON_INTERPRET=1 on "
                  f"{env.device_type} (tests only), but the device is {env.device_type!r} without it",
                  "run on a GPU; for CPU tests set TRITON_INTERPRET=1 before importing fusion_bridge")


def _hidden_fits(spec) -> Reason | None:
    if spec.hidden_size > MAX_HIDDEN:
        return Reason("hidden_too_large", f"local_fused's add+RMSNorm kernel holds one row per program: "
                      f"hidden_size <= {MAX_HIDDEN} required, got {spec.hidden_size}", "use 'separate'")
    return None


def _norm_step_name(spec) -> str:
    return "local.add_rmsnorm" + ("" if spec.quant.kind is QuantKind.NONE else f"_{spec.quant.kind.value}")


class LocalFusedStrategy(Strategy):
    name = "local_fused"
    summary = "our Triton finalize+shared-add kernel, then all-reduce + our add+RMSNorm(+quant) kernel"
    self_tested = True

    @classmethod
    def not_supported_reasons(cls, spec, env):
        return collect(require_triton(env, cls.name), _needs_device(env),
                       require_sm_at_least(env, cls.name, 80, why=" (Triton 3 targets SM80+)"),
                       _hidden_fits(spec))

    @classmethod
    def is_auto_selectable(cls, spec, env):
        return env.device_type == "cuda"

    @classmethod
    def subpath(cls, spec, env) -> str:
        return "none" if env.world_size == 1 else "nccl_local_norm"

    @classmethod
    def steps(cls, spec, env):
        stages = required_stages(spec, env.world_size)
        first = tuple(s for s in stages if s in (Stage.FINALIZE, Stage.SHARED_ADD))
        rest = tuple(s for s in stages if s in (Stage.RESIDUAL_NORM, Stage.QUANT))
        steps = [Step("local.finalize_add", first)]
        if Stage.ALL_REDUCE in stages:
            steps.append(Step("torch_distributed.all_reduce_nccl" if env.device_type == "cuda"
                              else "torch_distributed.all_reduce_gloo", (Stage.ALL_REDUCE,)))
        steps.append(Step(_norm_step_name(spec), rest))
        return steps

    @classmethod
    def roundings(cls, spec, env):
        return 1 + (env.world_size - 1) + 1  # finalize_add output, ring all-reduce hops, norm output

    def prepare(self) -> None:
        from ..kernels import ops  # noqa: F401  (registers the custom ops; Triton compiles lazily)

    def run(self, inputs: EpilogueInputs) -> EpilogueOutputs:
        import torch
        spec = self.spec
        partial = torch.ops.fusion_bridge.finalize_add(
            inputs.gemm2_out, inputs.expanded_idx_to_permuted_idx, inputs.expert_weights,
            inputs.shared_output, spec.routed_scaling_factor)
        if self.env.world_size > 1:
            dist.all_reduce(partial, group=self.group)
        q = spec.quant
        scale = q.scale if q.kind is QuantKind.FP8 else (q.global_scale if q.kind is QuantKind.NVFP4 else 1.0)
        residual_out, norm_out, quant, sf = torch.ops.fusion_bridge.add_rmsnorm_quant(
            inputs.residual, partial, inputs.gamma, spec.eps, spec.weight_bias, _QUANT_CODE[q.kind], scale,
            q.sf_layout.value == "swizzled_128x4")
        if q.kind is QuantKind.NONE:
            return EpilogueOutputs(residual_out, norm_out)
        return EpilogueOutputs(residual_out, norm_out, quant, sf if q.kind is QuantKind.NVFP4 else None)
