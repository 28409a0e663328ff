"""fusion-bridge: one call for the tensor-parallel MoE layer epilogue.

    bridge = FusionBridge(EpilogueSpec(hidden_size=7168, top_k=8), group=tp_group)
    out = bridge.finalize_epilogue(gemm2_out, expanded_idx_to_permuted_idx, expert_weights,
                                   shared_output, residual, gamma)
    out.residual_out, out.norm_out   # (+ out.quant, out.scale when the spec quantizes)
    print(bridge.explain())          # which strategy runs per token count, and why the others don't

What a model author uses comes from here; what a strategy author uses comes from
`fusion_bridge.strategies`.
"""

from .bridge import FusionBridge
from .io import EpilogueOutputs
from .planner import NoStrategyAvailable
from .spec import EpilogueSpec, QuantSpec
from .validation import EpilogueInputError

__version__ = "0.2.0"
__all__ = ["FusionBridge", "EpilogueSpec", "QuantSpec", "EpilogueOutputs", "EpilogueInputError",
           "NoStrategyAvailable", "__version__"]
