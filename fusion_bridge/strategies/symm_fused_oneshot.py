"""`symm_fused_oneshot`: our own single launch over PyTorch symmetric memory (no NVLink multicast):
finalize + shared add + all-reduce + residual add + RMSNorm (+ FP8 / NVFP4) for small T.

Each rank finalizes its partial (fp32 accumulate, routed scaling, shared add), rounds it ONCE to the
activation dtype and pushes it into every rank's buffer, where the data itself says it has arrived
(slots hold a -0.0 sentinel until written; three slots rotate, each cleared one call behind); every
rank sums the W rounded partials in rank order in fp32, adds the residual and normalizes, so all
outputs are bitwise identical on every rank. Error against the fp32 oracle: the partial's
rounding + the output's rounding + the oracle's (3 roundings in quadrature).

Calls with more tokens than the workspace holds (`max_tokens_per_call`) take the planner's overflow
route. A peer that does not arrive within the timeout makes the kernel write NaN and an error word,
and every later call on every rank raises: the bridge must be rebuilt.
"""

from __future__ import annotations

from typing import Optional

import torch

from fusion_bridge import env_vars
from fusion_bridge.epilogue_tensors import EpilogueInputs, EpilogueOutputs, quant_buffers
from fusion_bridge.kernels.symm.protocol import ONESHOT, SymmLayer, describe_error
from fusion_bridge.reasons import collect
from fusion_bridge.strategies import symm_workspace as sw
from fusion_bridge.strategies.base import DEFAULT_VARIANT, Step, Strategy, required_stages

# kernels/symm_oneshot.SHAPE_VARIANTS (named here: the class-level declarations import no kernel)
SHAPE_VARIANTS = ("rows", "pub512", "pub1024")


class SymmFusedOneshotStrategy(Strategy):
    marks_collective = True
    name = "symm_fused_oneshot"
    summary = (
        "one Triton launch over symmetric memory: finalize+shared, push to peers, rank-ordered "
        "fp32 "
        "reduce, residual+RMSNorm (+fp8/nvfp4)"
    )
    self_tested = True
    probes = (sw.SYMM_MEM_PROBE, sw.MULTICAST_PROBE)
    workspace_layout = ONESHOT  # the kernel's buffer layout (kernels/symm/protocol.py)
    # seconds a rank waits for its peers before the call fails; None: $FUSION_BRIDGE_SYMM_TIMEOUT_S
    # read at prepare() (tests set less on the class or the instance before prepare())
    timeout_s: Optional[float] = None

    @classmethod
    def not_supported_reasons(cls, spec, env):
        return sw.reasons(spec, env, cls.name, layout=cls.workspace_layout)

    @classmethod
    def steps(cls, spec, env):
        return [Step("triton.symm_oneshot_epilogue", required_stages(spec, env.world_size))]

    @classmethod
    def variants(cls, spec, env):
        """The exchange kernel's launch shapes (kernels/symm_oneshot.variant_shape), measured by
        `tune` per bucket; "default" (the per-T rule) until a measured table says otherwise."""
        if cls.workspace_layout is not ONESHOT:  # a subclass with another kernel has its own shapes
            return (DEFAULT_VARIANT,)
        return (DEFAULT_VARIANT,) + SHAPE_VARIANTS

    @classmethod
    def roundings(cls, spec, env):
        return 2  # the partial (activation dtype, read back by every rank) and each output

    @classmethod
    def max_tokens_per_call(cls, spec, env):
        return sw.capacity(spec, env.world_size, cls.workspace_layout)

    def this_rank_resource_reasons(self):
        return collect(
            sw.memory_reason(
                self.spec, self.env.world_size, self.device, self.name, self.workspace_layout
            )
        )

    def _kernel_module(self):
        from fusion_bridge.kernels.symm import oneshot as symm_oneshot

        return symm_oneshot

    def prepare(self) -> None:
        self._kernel = self._kernel_module()  # bound once: no import on the call path
        self._unused = torch.empty(
            0, dtype=torch.uint8, device=self.device
        )  # q / sf the kernel never writes
        # the sharing key at acquire time, for the release
        self._ws_timeout_s = (
            self.timeout_s or env_vars.read("FUSION_BRIDGE_SYMM_TIMEOUT_S") or sw.DEFAULT_TIMEOUT_S
        )
        self._ws = sw.acquire(
            self.group,
            self.spec,
            self.env.world_size,
            self.device,
            self._ws_timeout_s,
            self.workspace_layout,
        )
        # what every launch of this layer shares: pointers, sizes, eps, scales, world, rank
        self._layer = SymmLayer.bind(self._ws, self.spec)
        # tokens one call may carry (a shared ring workspace may have been sized for another spec)
        self._cap = self.max_tokens_per_call(self.spec, self.env)

    @property
    def workspace_bytes(self) -> int:
        ws = getattr(self, "_ws", None)
        return ws.nbytes if ws is not None else 0

    def accepts(self, inputs: EpilogueInputs) -> bool:
        ws = getattr(self, "_ws", None)
        return ws is not None and inputs.expanded_idx_to_permuted_idx.shape[0] <= self._cap

    def check_error(self) -> None:
        """Raise if an earlier launch timed out or was aborted (reads pinned memory; no sync)."""
        word = self._ws.error_word()
        if word:
            raise RuntimeError(describe_error(word, self._ws.rank, self.name))

    def run(self, inputs: EpilogueInputs, variant: str = DEFAULT_VARIANT) -> EpilogueOutputs:
        """variant: "default" (the per-T launch shape) or one of SHAPE_VARIANTS."""
        self.check_error()
        tokens, hidden = inputs.residual.shape
        if tokens > self._cap:
            raise ValueError(
                f"{self.name}: T={tokens} exceeds the workspace's {self._cap} tokens (the planner "
                "routes such calls elsewhere)"
            )
        spec = self.spec
        residual_out, norm_out = (
            torch.empty_like(inputs.residual),
            torch.empty_like(inputs.residual),
        )
        q, sf = quant_buffers(
            tokens, hidden, spec.quant.kind, spec.quant.sf_layout, inputs.residual.device
        )
        q = q if q is not None else self._unused
        sf = sf if sf is not None else self._unused
        shape = None
        if variant != DEFAULT_VARIANT:
            layer = self._layer
            shape = self._kernel.variant_shape(
                variant, tokens, hidden, layer.num_sms, layer.world, layer.quant.code
            )
        with self.collective():
            self._kernel.launch(
                self._layer,
                shape=shape,
                residual_out=residual_out,
                norm_out=norm_out,
                q=q.view(torch.uint8) if q.dtype != torch.uint8 else q,
                sf=sf,
                gemm2_out=inputs.gemm2_out,
                perm=inputs.expanded_idx_to_permuted_idx,
                weights=inputs.expert_weights,
                shared=inputs.shared_output,
                residual=inputs.residual,
                gamma=inputs.gamma,
            )
        return EpilogueOutputs.for_quant(spec.quant.kind, residual_out, norm_out, q, sf)

    def close(self) -> None:
        ws, self._ws = getattr(self, "_ws", None), None
        sw.release(
            ws,
            self.group,
            self.spec,
            self.env.world_size,
            getattr(self, "_ws_timeout_s", self.timeout_s or sw.DEFAULT_TIMEOUT_S),
            self.workspace_layout,
        )
