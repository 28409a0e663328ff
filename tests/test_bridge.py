"""FusionBridge's public behaviour on CPU: lifecycle, the override variable, the report, reroutes."""

import json

import pytest
import torch

from fusion_bridge import EpilogueSpec, FusionBridge, NoStrategyAvailable
from fusion_bridge.synthetic import make_inputs

SPEC = EpilogueSpec(hidden_size=64, top_k=2, max_tokens=8)


def call(bridge, inp):
    return bridge.finalize_epilogue(inp.gemm2_out, inp.expanded_idx_to_permuted_idx, inp.expert_weights,
                                    inp.shared_output, inp.residual, inp.gamma)


def test_close_is_idempotent_and_a_closed_bridge_refuses_calls():
    bridge = FusionBridge(SPEC)
    with bridge:
        call(bridge, make_inputs(SPEC, 2))
    bridge.close()
    with pytest.raises(RuntimeError, match="closed"):
        call(bridge, make_inputs(SPEC, 2))


def test_environment_variable_overrides_the_strategy(monkeypatch):
    monkeypatch.setenv("FUSION_BRIDGE_STRATEGY", "reference")
    with FusionBridge(SPEC) as bridge:
        assert bridge.plan.requested == "reference" and bridge.strategy_for(3) == "reference"
    monkeypatch.setenv("FUSION_BRIDGE_STRATEGY", "flashinfer_fused")
    with pytest.raises(NoStrategyAvailable, match="needs_cuda"):
        FusionBridge(SPEC)


def test_tokens_above_max_tokens_are_rerouted_and_counted():
    with FusionBridge(SPEC) as bridge:
        out = call(bridge, make_inputs(SPEC, 11))
        assert out.norm_out.shape == (11, 64) and bridge.reroutes == 1
        report = bridge.explain(11)
        assert report.to_dict()["reroutes"] == 1 and "rerouted 1 calls" in str(report)


def test_report_json_and_text_name_every_strategy_and_the_plan():
    with FusionBridge(SPEC) as bridge:
        report = bridge.explain(5)
    doc = json.loads(report.to_json())
    assert doc["selected"] == "separate" and doc["tokens"] == 5
    assert [b["max_tokens"] for b in doc["plan"]["buckets"]] == [1, 2, 4, 8]
    text = str(report)
    for name in ("local_fused", "flashinfer_fused", "separate", "reference"):
        assert name in text
    assert "SELECTED" in text and "[needs_cuda]" in text


def test_outputs_are_fresh_tensors_in_the_activation_dtype():
    spec = EpilogueSpec(hidden_size=64, top_k=2, dtype=torch.float16)
    with FusionBridge(spec) as bridge:
        inp = make_inputs(spec, 3)
        out = call(bridge, inp)
    assert out.residual_out.dtype == out.norm_out.dtype == torch.float16
    assert out.named().keys() == {"residual_out", "norm_out"}


def test_measured_sub_paths_reach_local_fused_and_the_report():
    measured = {"local_fused/nccl_local_norm": {1: 5.0, 2: 5.0}, "separate": {1: 50.0, 2: 50.0}}
    with FusionBridge(SPEC, measured_us=measured) as bridge:
        assert bridge.plan.source == "measured" and bridge.strategy_for(1) == "separate"  # CPU: never local
        local = bridge._instances["local_fused"]
        assert local.subpath_by_bucket[:2] == ["nccl_local_norm", "nccl_local_norm"]
        assert "sub-path, measured per bucket: T<=1: nccl_local_norm" in str(bridge.explain())
