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


from fusion_bridge import env_vars
from fusion_bridge.epilogue_tensors import EpilogueInputs, EpilogueOutputs
from fusion_bridge.kernels.symm.protocol import ONESHOT, SymmLayer, describe_error
from fusion_bridge.reasons import collect
from fusion_bridge.strategies import symm_workspace as sw
from fusion_bridge.strategies.base import DEFAULT_VARIANT, Step, Strategy, required_stages
from fusion_bridge.strategies.kernel_call import FamilyCall

# kernels/symm/oneshot_configs.CONFIG_VARIANTS (named here: the class-level declarations import no
# kernel)
CONFIG_VARIANTS = ("rows", "pub512", "pub1024")


class SymmFusedOneshotStrategy(FamilyCall, Strategy):
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
        """The exchange kernel's launch configs (kernels/symm/oneshot_configs.variant_config),
        measured by `tune` per bucket; "default" (the per-T rule) until a measured table says
        otherwise."""
        # a subclass with another kernel has its own configs
        if cls.workspace_layout is not ONESHOT:
            return (DEFAULT_VARIANT,)
        return (DEFAULT_VARIANT,) + CONFIG_VARIANTS

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

    def _launcher_class(self):
        """The kernel family's launcher (`kernels.layer.FamilyLauncher`), imported at prepare()."""
        from fusion_bridge.kernels.symm.oneshot import OneshotLauncher

        return OneshotLauncher

    def prepare(self) -> None:
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
        self.bind_launcher(self._launcher_class()(self._layer))
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

    def run(
        self,
        inputs: EpilogueInputs,
        variant: str = DEFAULT_VARIANT,
        out: Optional[EpilogueOutputs] = None,
    ) -> EpilogueOutputs:
        """variant: "default" (the launch config per T) or one of CONFIG_VARIANTS."""
        self.check_error()
        tokens = inputs.residual.shape[0]
        if tokens > self._cap:
            raise ValueError(
                f"{self.name}: T={tokens} exceeds the workspace's {self._cap} tokens (the planner "
                "routes such calls elsewhere)"
            )
        config = None
        if variant != DEFAULT_VARIANT:
            config = self._launcher.variant_config(variant, tokens)
        out, src, dst = self.call_records(inputs, out)
        with self.collective():
            self._launcher(src, dst, config)
        return out

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
