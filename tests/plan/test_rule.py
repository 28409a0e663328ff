"""The planner's rule for measured plans (a bucket keeps the static-order choice unless a measured
alternative is faster by more than the measured spread), the spread `tune` records, and what
`explain` shows per bucket: every candidate's time and its distance to the chosen route."""

import json

import pytest

from fusion_bridge import EpilogueSpec
from fusion_bridge.environment import Environment
from fusion_bridge.plan.planner import DEFAULT_MARGIN, Margin, select, static_statuses
from fusion_bridge.plan.report import Report
from fusion_bridge.tuning.tables import (
    as_measurements,
    default_table_path,
    make_table,
    margin_of,
    read_table,
    save_table,
    spread_summary,
)

H200_TP2 = Environment(
    device_type="cuda",
    sm=90,
    gpu_name="NVIDIA H200",
    world_size=2,
    triton_version="3.6.0",
    flashinfer_version="0.7.2.post1",
)
SPEC = EpilogueSpec(hidden_size=7168, top_k=8, max_tokens=16)
BOUNDS = (1, 2, 4, 8, 16)
STATIC = "local_fused_flashinfer"  # first in the static order at H200 TP2
OTHER = "symm_fused_oneshot"


def measured(other_us):
    """The static-order choice at 10 us in every bucket, the other strategy at other_us[i]."""
    return {
        STATIC: {"oneshot": dict.fromkeys(BOUNDS, 10.0)},
        OTHER: {"default": dict(zip(BOUNDS, other_us))},
    }


def plan_of(other_us, margin=None):
    return select(
        static_statuses(SPEC, H200_TP2), SPEC, measured_us=measured(other_us), margin=margin
    )


def test_a_route_within_the_margin_keeps_the_static_order_choice():
    # 2% faster: within the default margin (3.1%, the measured run-to-run spread)
    plan = plan_of([9.8] * 5)
    assert set(plan.choice) == {STATIC} and plan.margin == Margin()
    assert plan.why[0].startswith("static order kept: symm_fused_oneshot is only 2.0% faster")
    assert plan.measured_us[0] == 10.0  # the chosen route's own time
    # 6% faster: beyond it
    plan = plan_of([9.4] * 5)
    assert set(plan.choice) == {OTHER}
    assert plan.why[0].startswith("measured 6.0% faster than the static-order choice")
    # the margin comes from the measurements when they carry one
    assert set(plan_of([9.4] * 5, Margin(0.08, "test")).choice) == {STATIC}
    assert DEFAULT_MARGIN == pytest.approx(0.031)


def test_neighbouring_buckets_do_not_flip_on_noise():
    noise = [9.9, 10.1, 9.85, 10.05, 9.9]  # +-1.5% around the static choice's 10 us
    assert set(plan_of(noise).choice) == {STATIC}
    # without the rule (no margin) the plan would alternate on these differences
    assert plan_of(noise, Margin(0.0, "none")).choice == (OTHER, STATIC, OTHER, STATIC, OTHER)


def test_the_shipped_h200_table_under_the_rule():
    spec = EpilogueSpec(hidden_size=7168, top_k=8)
    table = read_table(default_table_path(spec, H200_TP2))
    plan = select(static_statuses(spec, H200_TP2), spec, measured_us=as_measurements(table))
    route = dict(zip(plan.bounds, zip(plan.choice, plan.variants)))
    # T=65..128: the one-shot kernel was 0.3% faster, T=4097..8192: local_fused_nccl 1.2%: noise
    assert route[128] == route[8192] == ("local_fused_flashinfer", "oneshot")
    assert route[16] == ("symm_fused_oneshot", "default")  # 10.5% faster: taken
    for i, name in enumerate(plan.choice):
        if name != STATIC:  # every departure from the static order wins by more than the margin
            static_us = next(us for s, v, us in plan.candidates[i] if (s, v) == (STATIC, "oneshot"))
            assert plan.measured_us[i] < static_us * (1 - plan.margin.fraction)


def test_explain_shows_every_candidate_and_its_distance_to_the_chosen_route():
    spec = EpilogueSpec(hidden_size=7168, top_k=8)
    table = read_table(default_table_path(spec, H200_TP2))
    statuses = static_statuses(spec, H200_TP2)
    plan = select(statuses, spec, measured_us=as_measurements(table))
    report = Report(H200_TP2, spec, statuses, plan, tokens=16)
    doc = json.loads(report.to_json())
    bucket = next(b for b in doc["plan"]["buckets"] if b["max_tokens"] == 16)
    rows = {(c["strategy"], c["variant"]): c for c in bucket["candidates"]}
    assert rows[("symm_fused_oneshot", "default")]["vs_chosen_pct"] == 0.0
    fi = rows[("flashinfer_fused", "default")]
    assert fi["measured_us"] == pytest.approx(12.54, abs=0.01)
    assert fi["vs_chosen_pct"] == pytest.approx(100 * (12.541 / 8.2237 - 1), abs=0.1)
    assert len(rows) == 6  # every measured (strategy, variant) that can take T=9..16
    assert doc["plan"]["margin"]["fraction"] == DEFAULT_MARGIN
    text = str(report)
    assert "flashinfer_fused 12.5 (+52.5%)" in text  # in the bucket's "others" line
    fi_lines = text.split("\nflashinfer_fused ", 1)[1].split("\nflashinfer_fused_fp4", 1)[0]
    assert "not chosen: slower than the chosen route in every measured bucket" in fi_lines
    # the answer comes first: the plan in token ranges, the per-bucket detail after the strategies
    assert text.index("plan (measured)") < text.index("strategies:") < text.index("others:")


def test_tune_records_the_spread_and_the_plan_uses_it(tmp_path):
    # two passes per case: |a - b| / mean; the table keeps the 90th percentile
    differences = [0.001 * i for i in range(1, 21)]  # 0.1% .. 2.0%
    spread = spread_summary(differences)
    assert spread["fraction"] == 0.018 and spread["cases"] == 20
    assert spread_summary([]) is None
    table = make_table(SPEC, H200_TP2, measured([9.7] * 5), spread=spread)
    save_table(table, tmp_path / "t.json")
    loaded = read_table(tmp_path / "t.json")
    margin = margin_of(loaded)
    assert margin.fraction == 0.018 and "two passes" in margin.source
    # 3% faster: beyond this table's 1.8% spread, though within the default 3.1%
    statuses = static_statuses(SPEC, H200_TP2)
    with_spread = select(statuses, SPEC, measured_us=as_measurements(loaded), margin=margin)
    assert set(with_spread.choice) == {OTHER}
    assert set(select(statuses, SPEC, measured_us=as_measurements(loaded)).choice) == {STATIC}
    assert margin_of({"spread": {"fraction": "x"}}) is None and margin_of(None) is None
