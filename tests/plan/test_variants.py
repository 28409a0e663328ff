"""The planner alone chooses (strategy, variant) per token bucket, among the variants that declare
the bucket's every T (Strategy.variant_tokens); run() launches exactly the variant it is given, and
explain() names it. Pure planner checks on Environment values, plus one CPU bridge."""

import pytest
import torch

from fusion_bridge import EpilogueSpec, FusionBridge
from fusion_bridge.plan.buckets import bucket_ranges
from fusion_bridge.plan.planner import select, static_statuses
from fusion_bridge.plan.status import StrategyStatus
from fusion_bridge.tuning.tables import token_ranges
from fusion_bridge.plan.report import Report
from fusion_bridge.strategies import Environment, register, unregister
from fusion_bridge.oracle.synthetic import make_inputs
from tests.strategy_fixture import RangedVariants

LF = "local_fused_flashinfer"
H200 = Environment(
    device_type="cuda",
    sm=90,
    gpu_name="NVIDIA H200",
    world_size=2,
    triton_version="3.6.0",
    flashinfer_version="0.7.2.post1",
)


def test_bucket_ranges_tile_one_to_max_tokens():
    assert bucket_ranges(12) == ((1, 1), (2, 2), (3, 4), (5, 8), (9, 12))
    assert bucket_ranges(1) == ((1, 1),)


def _assert_every_route_is_declared(plan, statuses):
    by_name = {s.name: s for s in statuses}
    for (low, high), name, variant in zip(
        bucket_ranges(plan.bounds[-1]), plan.choice, plan.variants
    ):
        v_low, v_high = by_name[name].token_range(variant)
        assert v_low <= low and (v_high is None or high <= v_high), (low, high, name, variant)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("max_tokens", [6, 12, 8192])
def test_measured_two_shot_never_gets_a_bucket_below_its_declared_range(world, max_tokens):
    """Two-shot measured fastest at every T, T <= world size included (there FlashInfer cannot run
    it): buckets whose every T exceeds the world size take it; the others take one-shot, and the
    measurements it cannot have made are dropped with a note."""
    spec = EpilogueSpec(hidden_size=7168, top_k=8, max_tokens=max_tokens)
    env = H200.replace(world_size=world)
    statuses = static_statuses(spec, env)
    bounds = [b for _, b in bucket_ranges(max_tokens)]
    measured = {
        LF: {"oneshot": {b: 10.0 for b in bounds}, "twoshot": {b: 1.0 for b in bounds}},
    }
    plan = select(statuses, spec, measured_us=measured)
    for (low, _high), name, variant in zip(bucket_ranges(max_tokens), plan.choice, plan.variants):
        assert name == LF
        assert variant == ("twoshot" if low > world else "oneshot"), (low, variant)
    _assert_every_route_is_declared(plan, statuses)
    assert any(f"{LF}:twoshot at T=" in n for n in plan.notes)
    assert token_ranges(statuses)[(LF, "twoshot")][0] == world + 1


@pytest.mark.parametrize("world", [2, 4, 8, 16])
@pytest.mark.parametrize("hidden", [2880, 7168])
def test_unmeasured_plans_only_use_declared_variants(world, hidden):
    spec = EpilogueSpec(hidden_size=hidden, top_k=8, max_tokens=8192)
    statuses = static_statuses(spec, H200.replace(world_size=world))
    _assert_every_route_is_declared(select(statuses, spec), statuses)
    _assert_every_route_is_declared(select(statuses, spec, LF), statuses)


def test_a_default_variant_outside_its_range_is_replaced_by_a_declared_one():
    spec = EpilogueSpec(hidden_size=64, top_k=2, max_tokens=16)
    status = StrategyStatus.of(RangedVariants, spec, Environment(), [])
    assert status.token_range("b") == (3, None)
    # buckets T=1, T=2 cannot take 'b'; from T in 3..4 on, the strategy's preference stands
    assert status.default_variants == ("a", "a", "b", "b", "b")
    assert status.overflow_variant == "b"


def test_variant_tokens_must_name_declared_variants():
    class Typo(RangedVariants):
        name = "typo"

        @classmethod
        def variant_tokens(cls, spec, env):
            return {"c": (3, None)}

    with pytest.raises(ValueError, match="undeclared variants"):
        StrategyStatus.of(Typo, EpilogueSpec(hidden_size=64, top_k=2), Environment(), [])


def test_explain_names_the_variant_that_runs():
    spec = EpilogueSpec(hidden_size=7168, top_k=8, max_tokens=64)
    statuses = static_statuses(spec, H200)
    measured = {LF: {"oneshot": {1: 5.0, 2: 5.0, 64: 30.0}, "twoshot": {1: 1.0, 64: 20.0}}}
    plan = select(statuses, spec, measured_us=measured)
    text = str(Report(H200, spec, statuses, plan, tokens=1))
    assert f"1 <= T <=      2: {LF}:oneshot  5.0 us" in text  # neighbours with one route merged
    assert f"3 <= T <=     32: {LF}:oneshot\n" in text  # unmeasured: the static order's variant
    assert f"33 <= T <=     64: {LF}:twoshot  20.0 us" in text
    assert f"selected for T=1: {LF}:oneshot" in text
    doc = Report(H200, spec, statuses, plan, tokens=64).to_dict()
    assert (doc["selected"], doc["selected_variant"]) == (LF, "twoshot")


@pytest.fixture
def ranged():
    register("ranged_variants", "tests.strategy_fixture:RangedVariants")
    RangedVariants.ran.clear()
    yield
    unregister("ranged_variants")


def test_the_bridge_runs_exactly_the_planned_variant(ranged):
    spec = EpilogueSpec(hidden_size=64, top_k=2, max_tokens=8, dtype=torch.float16)
    # 'b' measured fastest everywhere, also at T=1 and 2 where it declares it cannot run
    measured = {"ranged_variants": {"a": {b: 9.0 for b in (1, 2, 4, 8)}, "b": {1: 1.0, 2: 1.0}}}
    measured["ranged_variants"]["b"].update({4: 1.0, 8: 1.0})
    with FusionBridge(spec, strategy="ranged_variants", measured_us=measured) as bridge:
        assert [bridge.route_for(t)[1] for t in (1, 2, 3, 8)] == ["a", "a", "b", "b"]
        for tokens in (1, 2, 3, 8):
            bridge(*make_inputs(spec, tokens))
        assert RangedVariants.ran == ["a", "a", "b", "b"]
        with pytest.raises(ValueError, match="ranged_variants:b takes T >= 3, got T=2"):
            bridge.run_strategy("ranged_variants", make_inputs(spec, 2), "b")
        assert "ranged_variants:a" in str(bridge.explain(1))
