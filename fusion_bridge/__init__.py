"""fusion-bridge: one call for the tensor-parallel MoE layer epilogue.

    bridge = FusionBridge(EpilogueSpec(hidden_size=7168, top_k=8), group=tp_group)
    out = bridge.finalize_epilogue(gemm2_out, expanded_idx_to_permuted_idx, expert_weights,
                                   shared_output, residual, gamma)
    out.residual_out, out.norm_out   # (+ out.quant, out.scale when the spec quantizes)
    print(bridge.explain())          # which strategy runs per token count, and why the others don't
"""

from .bridge import FusionBridge
from .environment import Environment, detect
from .io import EpilogueInputs, EpilogueOutputs
from .planner import NoStrategyAvailable
from .reasons import Reason
from .registry import REGISTRY, register
from .spec import EpilogueSpec, QuantKind, QuantSpec, SFLayout
from .validation import EpilogueInputError

__version__ = "0.1.0"
__all__ = [
    "FusionBridge", "EpilogueSpec", "QuantSpec", "QuantKind", "SFLayout", "EpilogueInputs",
    "EpilogueOutputs", "Environment", "detect", "Reason", "NoStrategyAvailable", "EpilogueInputError",
    "REGISTRY", "register", "__version__",
]
