"""`local_fused`: our fused finalize + shared-add kernel, then the best available all-reduce + residual
add + RMSNorm (+ quant) sub-path.

The all-reduce + norm slot, static preference (first that can run wins; tuning may pin one):
  1. "flashinfer_ar_norm": FlashInfer trtllm_allreduce_fusion (flashinfer_ar_norm.py), for
     T <= its workspace size. Measured on 2x H200 at T=1: AR+norm 5.6 us vs NCCL AR alone 10.7 us.
  2. "nccl_local_norm": torch.distributed all_reduce (NCCL; gloo on CPU), then our add+RMSNorm(+quant)
     kernel. Takes any T, so T above the FlashInfer workspace goes here instead of failing.
With world size 1 there is no all-reduce: finalize_add, then our add+RMSNorm(+quant) kernel.

On CPU it runs under TRITON_INTERPRET=1 only (tests, `parity`); auto never picks it there.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from ..agreement import agree_flags, collective_device
from ..io import EpilogueInputs, EpilogueOutputs
from ..reasons import Reason, collect, require_sm_at_least, require_triton
from ..spec import QuantKind, Stage
from . import flashinfer_ar_norm, flashinfer_common
from .base import Step, Strategy, kernel_quant_args, required_stages

MAX_HIDDEN = 32768  # one token row per program, held in registers
SUBPATH_FLASHINFER, SUBPATH_NCCL, SUBPATH_NONE = "flashinfer_ar_norm", "nccl_local_norm", "none"


def _needs_device(env) -> Optional[Reason]:
    if env.device_type == "cuda" or env.triton_interpret:
        return None
    return Reason("needs_cuda_or_interpreter",
                  f"local_fused runs Triton kernels: it requires a CUDA device, or TRITON_INTERPRET=1 on "
                  f"{env.device_type} (tests only), but the device is {env.device_type!r} without it",
                  "run on a GPU; for CPU tests set TRITON_INTERPRET=1 before importing fusion_bridge")


def _hidden_fits(spec) -> Optional[Reason]:
    if spec.hidden_size > MAX_HIDDEN:
        return Reason("hidden_too_large", f"local_fused's add+RMSNorm kernel holds one row per program: "
                      f"hidden_size <= {MAX_HIDDEN} required, got {spec.hidden_size}", "use 'separate'")
    return None


class LocalFusedStrategy(Strategy):
    name = "local_fused"
    summary = "our Triton finalize+shared-add kernel, then the best all-reduce + add+RMSNorm(+quant) sub-path"
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
    def static_subpath(cls, spec, env) -> str:
        if env.world_size == 1:
            return SUBPATH_NONE
        return SUBPATH_FLASHINFER if not flashinfer_ar_norm.reasons(spec, env) else SUBPATH_NCCL

    @classmethod
    def steps(cls, spec, env, subpath: Optional[str] = None):
        subpath = subpath or cls.static_subpath(spec, env)
        stages = required_stages(spec, env.world_size)
        steps = [Step("local.finalize_add", tuple(s for s in stages if s in (Stage.FINALIZE, Stage.SHARED_ADD)))]
        if subpath == SUBPATH_FLASHINFER:
            return steps + flashinfer_ar_norm.steps(spec, env)
        if Stage.ALL_REDUCE in stages:
            backend = "nccl" if env.device_type == "cuda" else "gloo"
            steps.append(Step(f"torch_distributed.all_reduce_{backend}", (Stage.ALL_REDUCE,)))
        norm = "local.add_rmsnorm" + ("" if spec.quant.kind is QuantKind.NONE else f"_{spec.quant.kind.value}")
        steps.append(Step(norm, tuple(s for s in stages if s in (Stage.RESIDUAL_NORM, Stage.QUANT))))
        return steps

    @classmethod
    def roundings(cls, spec, env):
        if cls.static_subpath(spec, env) == SUBPATH_FLASHINFER:
            return 4  # finalize_add output, all-reduce output, residual add, norm output
        return 1 + (env.world_size - 1) + 1  # finalize_add output, ring all-reduce hops, norm output

    def __init__(self, spec, env, group=None, device=None) -> None:
        super().__init__(spec, env, group, device)
        self.subpath = SUBPATH_NONE if env.world_size == 1 else SUBPATH_NCCL
        self._fi_ar_norm: Optional[flashinfer_ar_norm.FlashInferArNorm] = None
        self.nccl_reroutes = 0  # calls above the FlashInfer workspace that took the NCCL sub-path
        self.forced_subpath: Optional[str] = None  # tuning measures each sub-path in turn
        self.subpath_by_bucket: Optional[list[str]] = None  # tuned choice per token bucket
        self._quant = kernel_quant_args(spec)

    def prepare(self) -> None:
        """Collective. Picks the sub-path on every rank alike, creating the FlashInfer workspace if used."""
        from ..kernels import ops  # registers the custom ops; Triton compiles lazily
        self._ops = ops.fast
        if self.env.world_size == 1:
            return
        wanted = self.static_subpath(self.spec, self.env) == SUBPATH_FLASHINFER
        can = wanted and flashinfer_common.memory_reason(self.spec, self.env.world_size, self.device,
                                                         self.name) is None
        # every rank must agree before the collective workspace creation
        if agree_flags([int(can)], self.group, collective_device(self.group, self.device))[0]:
            self._fi_ar_norm = flashinfer_ar_norm.FlashInferArNorm(self.spec, self.env, self.group, self.device)
            self.subpath = SUBPATH_FLASHINFER

    def instance_steps(self) -> list[Step]:
        return self.steps(self.spec, self.env, self.subpath)

    @property
    def workspace_bytes(self) -> int:
        return self._fi_ar_norm.workspace_bytes if self._fi_ar_norm else 0

    def run(self, inputs: EpilogueInputs) -> EpilogueOutputs:
        spec = self.spec
        partial = self._ops.finalize_add(
            inputs.gemm2_out, inputs.expanded_idx_to_permuted_idx, inputs.expert_weights,
            inputs.shared_output, spec.routed_scaling_factor)
        fi = self._fi_ar_norm
        if fi is not None:
            if inputs.tokens > fi.max_tokens:
                self.nccl_reroutes += 1
            elif self._flashinfer_wanted(inputs.tokens):
                return fi.run(partial, inputs.residual, inputs.gamma)
        if self.env.world_size > 1:
            dist.all_reduce(partial, group=self.group)
        quant, scale, swizzled = self._quant
        residual_out, norm_out, q, sf = self._ops.add_rmsnorm_quant(
            inputs.residual, partial, inputs.gamma, spec.eps, spec.weight_bias, quant, scale, swizzled)
        kind = spec.quant.kind
        return EpilogueOutputs(residual_out, norm_out, None if kind is QuantKind.NONE else q,
                               sf if kind is QuantKind.NVFP4 else None)

    def _flashinfer_wanted(self, tokens: int) -> bool:
        if self.forced_subpath is not None:
            return self.forced_subpath == SUBPATH_FLASHINFER
        table = self.subpath_by_bucket
        i = (tokens - 1).bit_length()
        # unmeasured buckets ("" or beyond the table) keep the static preference: FlashInfer
        return table is None or i >= len(table) or table[i] != SUBPATH_NCCL

    def subpaths(self) -> list[str]:
        """The sub-paths this prepared instance can run (what tuning measures)."""
        if self.env.world_size == 1:
            return []
        return [SUBPATH_FLASHINFER, SUBPATH_NCCL] if self._fi_ar_norm is not None else [SUBPATH_NCCL]

    def close(self) -> None:
        if self._fi_ar_norm is not None:
            self._fi_ar_norm.close()
            self._fi_ar_norm = None
