"""The dynamic FP8 kinds in the planner: the strategies that do not write them yet (the
symmetric-memory kernels, FlashInfer's fused routes) report them as not available with the reason
`dynamic_fp8_not_available`; the others are chosen as for the other kinds (TP1: fused_tp1; TP2:
local_fused_nccl, our add+RMSNorm kernel after NCCL). Pure functions of values; no hardware."""

import pytest

from fusion_bridge import EpilogueSpec, QuantSpec
from fusion_bridge.plan.planner import select, static_statuses
from fusion_bridge.strategies import Environment

H200 = Environment(
    device_type="cuda",
    sm=90,
    gpu_name="NVIDIA H200",
    world_size=2,
    triton_version="3.6.0",
    flashinfer_version="0.7.2.post1",
)
NOT_BUILT = (
    "symm_fused_oneshot",
    "symm_fused_twoshot",
    "flashinfer_fused",
    "local_fused_flashinfer",
)
QUANTS = [QuantSpec.fp8_per_token_group(128, "column_major_tma"), QuantSpec.fp8_per_token()]


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.kind.value)
def test_routes_without_the_format_say_why(quant):
    spec = EpilogueSpec(hidden_size=7168, top_k=8, quant=quant)
    statuses = {s.name: s for s in static_statuses(spec, H200)}
    for name in NOT_BUILT:
        reasons = {r.code: r for r in statuses[name].reasons}
        assert "dynamic_fp8_not_available" in reasons, (name, list(reasons))
        text = reasons["dynamic_fp8_not_available"].message
        assert name in text and quant.kind.value in text and "two GPUs" in text, text
    assert not statuses["local_fused_nccl"].reasons
    assert select(statuses.values(), spec).choice[0] == "local_fused_nccl"
    tp1 = H200.replace(world_size=1)
    statuses = static_statuses(spec, tp1)
    assert {s.name for s in statuses if not s.reasons} >= {"fused_tp1", "local_fused_nccl"}
    assert select(statuses, spec).choice[0] == "fused_tp1"


def test_the_other_kinds_keep_those_routes():
    spec = EpilogueSpec(hidden_size=7168, top_k=8, quant=QuantSpec.fp8(0.5))
    statuses = {s.name: s for s in static_statuses(spec, H200)}
    for name in NOT_BUILT:
        assert "dynamic_fp8_not_available" not in {r.code for r in statuses[name].reasons}
