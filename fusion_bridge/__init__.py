"""fusion-bridge: one call for the tensor-parallel MoE layer epilogue.

    bridge = FusionBridge(EpilogueSpec(hidden_size=7168, top_k=8), group=tp_group)
    out = bridge.finalize_epilogue(gemm2_out, expanded_idx_to_permuted_idx, expert_weights,
                                   shared_output, residual, gamma)
    out.residual_out, out.norm_out   # (+ out.quant, out.scale when the spec quantizes)
    print(bridge.explain())          # which strategy runs per token count, and why the others don't

What a model author uses comes from here (`tensor_digest`: the content digest the ranks compare
to check they hold the same inputs or weights; `check_in`: every rank arrives before a collective
setup, within a bound, through the process group's store); what a strategy author uses comes from
`fusion_bridge.strategies`.

The names below are imported on first use (PEP 562), so `import fusion_bridge` and
`python -m fusion_bridge --help` do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.2.0"
__all__ = [
    "FusionBridge",
    "EpilogueSpec",
    "QuantSpec",
    "EpilogueOutputs",
    "EpilogueInputError",
    "ConcurrentCallError",
    "NoStrategyAvailable",
    "tensor_digest",
    "check_in",
    "__version__",
]

_LAZY = {
    "FusionBridge": ".bridge",
    "EpilogueOutputs": ".epilogue_tensors",
    "NoStrategyAvailable": ".plan.planner",
    "EpilogueSpec": ".spec",
    "QuantSpec": ".spec",
    "EpilogueInputError": ".epilogue_tensors",
    "ConcurrentCallError": ".call.one_caller",
    "tensor_digest": ".call.checksum",
    "check_in": ".ranks.check_in",
}

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports on first use
    from fusion_bridge.bridge import FusionBridge
    from fusion_bridge.epilogue_tensors import EpilogueOutputs
    from fusion_bridge.plan.planner import NoStrategyAvailable
    from fusion_bridge.spec import EpilogueSpec, QuantSpec
    from fusion_bridge.epilogue_tensors import EpilogueInputError
    from fusion_bridge.call.one_caller import ConcurrentCallError
    from fusion_bridge.call.checksum import tensor_digest
    from fusion_bridge.ranks.check_in import check_in


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fusion_bridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
