"""FusionBridge's public behaviour on CPU: lifecycle, the override variable, the report,
reroutes."""

import json

import pytest
import torch

from fusion_bridge import EpilogueSpec, FusionBridge, NoStrategyAvailable
from fusion_bridge.oracle.synthetic import make_inputs

SPEC = EpilogueSpec(hidden_size=64, top_k=2, max_tokens=8)


def call(bridge, inp):
    return bridge.finalize_epilogue(
        inp.gemm2_out,
        inp.expanded_idx_to_permuted_idx,
        inp.expert_weights,
        inp.shared_output,
        inp.residual,
        inp.gamma,
    )


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
    for name in (
        "local_fused_flashinfer",
        "local_fused_nccl",
        "flashinfer_fused",
        "separate",
        "reference",
    ):
        assert name in text
    assert "SELECTED" in text and "[needs_cuda]" in text


def test_outputs_are_fresh_tensors_in_the_activation_dtype():
    spec = EpilogueSpec(hidden_size=64, top_k=2, dtype=torch.float16)
    with FusionBridge(spec) as bridge:
        inp = make_inputs(spec, 3)
        out = call(bridge, inp)
    assert out.residual_out.dtype == out.norm_out.dtype == torch.float16
    assert out.named().keys() == {"residual_out", "norm_out"}


def test_measured_routes_reach_the_call_and_the_report():
    # separate measured slower than the oracle-free alternative does not matter on CPU: only
    # separate is
    # auto-selectable there, so the measured time of a variant it does not declare is ignored with a
    # note
    measured = {
        "separate": {"default": {1: 50.0, 2: 40.0}, "fast": {1: 1.0}},
        "local_fused": {"x": {1: 1.0}},
    }
    with FusionBridge(SPEC, measured_us=measured) as bridge:
        assert bridge.plan.source == "measured" and bridge.route_for(1) == ("separate", "default")
        assert bridge.plan.measured_us[:2] == (50.0, 40.0)
        text = str(bridge.explain())
    assert (
        "50.0 us" in text
        and "unknown variant separate:fast" in text
        and "unknown strategy 'local_fused'" in text
    )


def test_shadow_is_one_string_and_a_shadow_that_cannot_run_is_rejected_at_build():
    with FusionBridge(SPEC, shadow="reference:2") as bridge:
        for tokens in (1, 2, 3):
            call(bridge, make_inputs(SPEC, tokens, seed=tokens))
        doc = bridge.explain().to_dict()["shadow"]
    assert (
        doc["strategy"] == "reference"
        and doc["every"] == 2
        and doc["calls"] == 3
        and doc["sampled"] == 2
    )
    assert doc["outputs"]["norm_out"]["max_rel_err"] < 1e-2
    with pytest.raises(
        ValueError, match="shadow strategy 'flashinfer_fused' cannot run here.*needs_cuda"
    ):
        FusionBridge(SPEC, shadow="flashinfer_fused:1")
    with pytest.raises(ValueError, match="int period"):
        FusionBridge(SPEC, shadow="reference:often")


def test_eager_calls_take_the_eager_plan_where_host_cost_changes_the_winner():
    from fusion_bridge.registry import register, unregister
    from tests.strategy_fixture import TwoVariants

    register("two_variants", "tests.strategy_fixture:TwoVariants")
    try:
        graph = {"two_variants": {"a": {1: 5.0, 2: 5.0}, "b": {1: 9.0, 2: 9.0}}}
        eager = {"two_variants": {"a": {1: 40.0, 2: 10.0}, "b": {1: 12.0, 2: 12.0}}}
        with FusionBridge(
            SPEC, strategy="two_variants", measured_us=graph, eager_us=eager
        ) as bridge:
            assert bridge.route_for(1) == ("two_variants", "a") and bridge.route_for(
                1, eager=True
            ) == ("two_variants", "b")
            assert bridge.route_for(2, eager=True) == ("two_variants", "a")
            TwoVariants.ran.clear()
            call(bridge, make_inputs(SPEC, 1))  # CPU: never capturing, so the eager plan
            call(bridge, make_inputs(SPEC, 2))
            assert TwoVariants.ran == ["b", "a"]
            doc = bridge.explain().to_dict()["plan"]
            assert [b["variant"] for b in doc["eager_buckets"][:2]] == ["b", "a"]
            assert (
                "eager calls (measured wall time on this host) take another route: T<=1: "
                "two_variants:b" in str(bridge.explain())
            )
        with FusionBridge(
            SPEC, strategy="two_variants", measured_us=graph
        ) as bridge:  # no eager times
            TwoVariants.ran.clear()
            call(bridge, make_inputs(SPEC, 1))
            assert TwoVariants.ran == ["a"] and not bridge.plan.mode_dependent
    finally:
        unregister("two_variants")


@pytest.mark.parametrize("quant", ["none", "fp8", "nvfp4"])
def test_torch_compile_fullgraph_sees_one_opaque_op_with_the_eager_values(quant):
    """finalize_epilogue is one custom op under torch.compile (fake implementation for tracing, no
    graph
    break on the data-dependent index check); the compiled function returns the eager values."""
    from fusion_bridge import QuantSpec

    q = {"none": QuantSpec.none(), "fp8": QuantSpec.fp8(0.05), "nvfp4": QuantSpec.nvfp4(300.0)}[
        quant
    ]
    spec = EpilogueSpec(hidden_size=64, top_k=2, quant=q)
    with FusionBridge(spec) as bridge:

        def epilogue(*args):
            out = bridge.finalize_epilogue(*args)
            return out.norm_out * 2, out.residual_out, out.quant, out.scale

        inp = tuple(make_inputs(spec, 5))
        eager = epilogue(*inp)
        torch._dynamo.reset()
        compiled = torch.compile(epilogue, fullgraph=True, backend="aot_eager")(*inp)
    for e, c in zip(eager, compiled):
        assert (e is None) == (c is None)
        if e is not None:
            assert e.shape == c.shape and e.dtype == c.dtype
            assert torch.equal(e.view(torch.uint8), c.view(torch.uint8))


def test_an_opt_in_strategy_is_neither_prepared_nor_picked_by_auto_but_runs_when_requested():
    """Auto must not spend memory or build time on an opt-in strategy (e.g. symm_fused_twoshot
    before it is
    measured), even with a table that says it is fastest; a request by name prepares and runs it."""
    from fusion_bridge.registry import register, unregister
    from tests.strategy_fixture import OptInSeparate

    register("opt_in_separate", "tests.strategy_fixture:OptInSeparate")
    try:
        OptInSeparate.prepared = 0
        fastest = {"opt_in_separate": {"default": {1: 1.0}}, "separate": {"default": {1: 50.0}}}
        with FusionBridge(SPEC, measured_us=fastest) as bridge:
            assert OptInSeparate.prepared == 0
            assert bridge.route_for(1)[0] != "opt_in_separate"
            status = {s.name: s for s in bridge.statuses}["opt_in_separate"]
            assert status.available and not status.auto_selectable and status.opt_in
            assert "opt_in_separate        available (opt-in: request it by name)" in str(
                bridge.explain()
            )
        with FusionBridge(SPEC, strategy="opt_in_separate") as bridge:
            assert OptInSeparate.prepared == 1 and bridge.route_for(1)[0] == "opt_in_separate"
            out = call(bridge, make_inputs(SPEC, 1))
            assert torch.isfinite(out.norm_out).all()
    finally:
        unregister("opt_in_separate")


@pytest.mark.parametrize("world_size_var", ["2", "8"])
def test_a_multi_process_launch_without_a_process_group_is_refused_naming_the_fix(
    monkeypatch, world_size_var
):
    # under torchrun with init_process_group forgotten, each rank would otherwise build a silent
    # one-rank bridge and skip the all-reduce
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", world_size_var)
    with pytest.raises(RuntimeError, match=f"WORLD_SIZE={world_size_var}") as info:
        FusionBridge(SPEC)
    assert "init_process_group" in str(info.value) and "group=" in str(info.value)


@pytest.mark.parametrize("world_size_var", [None, "1", ""])
def test_a_single_process_needs_no_process_group(monkeypatch, world_size_var):
    if world_size_var is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size_var)
    with FusionBridge(SPEC) as bridge:
        assert bridge.env.world_size == 1
        assert call(bridge, make_inputs(SPEC, 3)).norm_out.shape == (3, 64)


def test_exclude_keeps_a_strategy_out_of_auto_and_the_report_says_so(monkeypatch):
    monkeypatch.delenv("FUSION_BRIDGE_EXCLUDE", raising=False)
    with FusionBridge(SPEC, exclude=["flashinfer_fused"]) as bridge:
        status = {s.name: s for s in bridge.statuses}["flashinfer_fused"]
        assert "excluded_by_request" in [r.code for r in status.reasons]
        assert "flashinfer_fused" not in bridge.prepared
        doc = bridge.explain().to_dict()
        fi = {s["name"]: s for s in doc["strategies"]}["flashinfer_fused"]
        assert fi["available"] is False
        assert any("excluded by request (exclude)" in r["message"] for r in fi["reasons"])
    # the variable, comma-separated, adds to the argument; 'separate' is then out of auto too
    monkeypatch.setenv("FUSION_BRIDGE_EXCLUDE", "local_fused_nccl, separate")
    with pytest.raises(NoStrategyAvailable, match="excluded_by_request"):
        FusionBridge(SPEC)  # on CPU nothing else may run
    monkeypatch.setenv("FUSION_BRIDGE_EXCLUDE", "local_fused_nccl")
    with FusionBridge(SPEC, exclude=["flashinfer_fused"]) as bridge:
        text = str(bridge.explain())
        # (the test session runs our kernels under the interpreter: local_fused_nccl could run)
        assert "local_fused_nccl       excluded by request, self-test" in text
        assert "local_fused_nccl excluded by request (FUSION_BRIDGE_EXCLUDE)" in text
        assert "flashinfer_fused excluded by request (exclude)" in text
        assert bridge.strategy_for(4) == "separate"


@pytest.mark.parametrize(
    "exclude, env, match",
    [
        (["bogus"], None, r"exclude names unknown strategies \['bogus'\]"),
        ([], "bogus", r"FUSION_BRIDGE_EXCLUDE names unknown strategies \['bogus'\]"),
        (["reference"], None, "cannot exclude 'reference'"),
        ("separate", None, "exclude must be a list of strategy names"),
    ],
)
def test_a_bad_exclusion_is_an_error_naming_its_source(monkeypatch, exclude, env, match):
    monkeypatch.delenv("FUSION_BRIDGE_EXCLUDE", raising=False)
    if env is not None:
        monkeypatch.setenv("FUSION_BRIDGE_EXCLUDE", env)
    with pytest.raises(ValueError, match=match):
        FusionBridge(SPEC, exclude=exclude)
    monkeypatch.delenv("FUSION_BRIDGE_EXCLUDE", raising=False)
    with pytest.raises(ValueError, match="excludes 'separate', which is requested by name"):
        FusionBridge(SPEC, strategy="separate", exclude=["separate"])


def test_explain_counts_calls_per_route_eager_and_captured(monkeypatch):
    with FusionBridge(SPEC) as bridge:
        assert bridge.route_calls() == [] and "calls so far: none" in str(bridge.explain())
        for tokens in (1, 3, 3, 11):  # 11 > max_tokens=8: the overflow route, also counted
            call(bridge, make_inputs(SPEC, tokens))
        call(bridge, make_inputs(SPEC, 0))  # T == 0 runs nothing: not counted
        calls = bridge.route_calls()
        assert calls == [{"strategy": "separate", "variant": "default", "eager": 4, "captured": 0}]
        assert bridge.route_for(3) == ("separate", "default")
        doc = bridge.explain().to_dict()
        assert doc["calls"] == calls
        assert (
            "calls so far: separate 4 eager, 0 in CUDA-graph captures (graph replays never"
            in str(bridge.explain())
        )
