"""Golden selection table: (environment, spec) -> selected strategy and every strategy's reason
codes.
Pure functions of values; no hardware."""

import pytest
import torch

from fusion_bridge import EpilogueSpec, NoStrategyAvailable, QuantSpec
from fusion_bridge.strategies import Environment
from fusion_bridge.plan.buckets import bucket_bounds, bucket_index
from fusion_bridge.plan.planner import select, static_statuses

CPU = Environment(device_type="cpu", triton_version="3.6.0", flashinfer_version="0.7.2.post1")
H200 = Environment(
    device_type="cuda",
    sm=90,
    gpu_name="NVIDIA H200",
    world_size=2,
    triton_version="3.6.0",
    flashinfer_version="0.7.2.post1",
)
B200 = H200.replace(sm=100, gpu_name="NVIDIA B200")
A100 = H200.replace(sm=80, gpu_name="NVIDIA A100")
DSV3 = EpilogueSpec(hidden_size=7168, top_k=8)
GPT_OSS = EpilogueSpec(hidden_size=2880, top_k=4)
NVFP4 = EpilogueSpec(hidden_size=7168, top_k=8, quant=QuantSpec.nvfp4(336.0))

FI_AR = "flashinfer.ar_residual_rmsnorm"

LF, LN = "local_fused_flashinfer", "local_fused_nccl"

GOLDEN = [
    # (id, env, spec, selected, {strategy: reason codes}, {strategy: steps that must appear})
    (
        "cpu",
        CPU,
        DSV3,
        "separate",
        {
            LN: ["needs_cuda_or_interpreter"],
            LF: ["needs_cuda", "world_size_unsupported"],
            "flashinfer_fused": ["needs_cuda", "world_size_unsupported"],
            "separate": [],
            "reference": [],
        },
        {},
    ),
    ("cpu-interpreter", CPU.replace(triton_interpret=True), DSV3, "separate", {LN: []}, {}),
    (
        "h200-tp2",
        H200,
        DSV3,
        LF,
        {LF: [], LN: [], "flashinfer_fused": []},
        {
            LF: ["local.finalize_add", FI_AR],
            LN: ["local.finalize_add", "torch_distributed.all_reduce_nccl"],
        },
    ),
    (
        "h200-tp2-symm",
        H200,
        DSV3,
        LF,
        {"symm_fused_oneshot": []},
        {"symm_fused_oneshot": ["triton.symm_oneshot_epilogue"]},
    ),
    (
        "h200-tp2-multicast-allowed-by-the-process",  # not ours to require: still available
        H200.replace(probes={"multicast_off": False}),
        DSV3,
        LF,
        {"symm_fused_oneshot": []},
        {"symm_fused_oneshot": ["triton.symm_oneshot_epilogue"]},
    ),
    (
        "h200-tp2-no-symmetric-memory",
        H200.replace(probes={"symm_mem_error": "torch.distributed._symmetric_memory lacks x"}),
        DSV3,
        LF,
        {"symm_fused_oneshot": ["symm_mem_unavailable"]},
        {},
    ),
    ("h200-tp3-no-table", H200.replace(world_size=3), DSV3, LN, {"symm_fused_oneshot": []}, {}),
    (
        "h200-tp2-gpt-oss",
        H200,
        GPT_OSS,
        LF,
        {"flashinfer_fused": ["hidden_not_multiple_of_256"], LF: []},
        {LF: [FI_AR]},
    ),
    (
        "h200-tp1",
        H200.replace(world_size=1),
        DSV3,
        "fused_tp1",  # one launch at world size 1 (measured faster from T=16 on, benchmarks/)
        {"flashinfer_fused": ["world_size_unsupported"], LF: ["world_size_unsupported"]},
        {
            LN: ["local.finalize_add", "local.add_rmsnorm"],
            "fused_tp1": ["triton.fused_tp1_epilogue"],
        },
    ),
    (
        "h200-tp3",
        H200.replace(world_size=3),
        DSV3,
        LN,
        {"flashinfer_fused": ["world_size_unsupported"], LF: ["world_size_unsupported"]},
        {LN: ["torch_distributed.all_reduce_nccl", "local.add_rmsnorm"]},
    ),
    (
        "a100-tp2",
        A100,
        DSV3,
        LN,
        {"flashinfer_fused": ["sm_too_low"], LF: ["sm_too_low"]},
        {LN: ["torch_distributed.all_reduce_nccl"]},
    ),
    (
        "no-flashinfer",
        H200.replace(flashinfer_version=None, flashinfer_error="ImportError: x"),
        DSV3,
        LN,
        {"flashinfer_fused": ["flashinfer_missing"], LF: ["flashinfer_missing"]},
        {},
    ),
    (
        "old-flashinfer",
        H200.replace(flashinfer_version="0.6.0"),
        DSV3,
        LN,
        {"flashinfer_fused": ["flashinfer_too_old"]},
        {},
    ),
    (
        "multi-node",
        H200.replace(single_node=False, world_size=16),
        DSV3,
        LN,
        {"flashinfer_fused": ["multi_node_group"], LF: ["multi_node_group"]},
        {},
    ),
    (
        "every-reason-at-once",
        A100.replace(world_size=3, single_node=False),
        GPT_OSS,
        LN,
        {
            "flashinfer_fused": [
                "sm_too_low",
                "world_size_unsupported",
                "multi_node_group",
                "hidden_not_multiple_of_256",
            ]
        },
        {},
    ),
    (
        "nvfp4-h200",
        H200,
        NVFP4,
        LF,
        {
            "flashinfer_fused": [],
            "flashinfer_fused_fp4": ["flashinfer_fused_fp4_broken", "fp4_needs_sm100"],
        },
        {
            "flashinfer_fused": [
                "flashinfer.moe_finalize_ar_residual_rmsnorm",
                "local.quant_nvfp4",
            ],
            LF: [FI_AR, "local.quant_nvfp4"],
            LN: ["local.add_rmsnorm_nvfp4"],
        },
    ),
    (
        "nvfp4-b200",
        B200,
        NVFP4,
        LF,
        {"flashinfer_fused_fp4": ["flashinfer_fused_fp4_broken"]},
        {LF: ["flashinfer.ar_residual_rmsnorm_fp4"]},
    ),
    (
        "nvfp4-b200-newer-flashinfer",
        B200.replace(flashinfer_version="0.8.0"),
        NVFP4,
        LF,
        {"flashinfer_fused_fp4": []},
        {},
    ),
    (
        "nvfp4-linear",
        B200.replace(flashinfer_version="0.8.0"),
        EpilogueSpec(hidden_size=7168, top_k=8, quant=QuantSpec.nvfp4(336.0, "linear")),
        LF,
        {"flashinfer_fused_fp4": ["sf_layout_fixed"]},
        {},
    ),
    (
        "fp8-h200",
        H200,
        EpilogueSpec(hidden_size=7168, top_k=8, quant=QuantSpec.fp8(0.05)),
        LF,
        {
            "flashinfer_fused_fp4": ["quant_not_nvfp4"]
        },  # a variant that does not apply says only that
        {
            LF: ["flashinfer.ar_residual_rmsnorm_fp8"],
            "flashinfer_fused": ["local.quant_fp8"],
            LN: ["local.add_rmsnorm_fp8"],
        },
    ),
    (
        "huge-hidden",
        H200,
        EpilogueSpec(hidden_size=65536, top_k=8),
        LF,
        {LN: ["hidden_too_large"], LF: []},
        {},
    ),
    (
        "huge-hidden-nvfp4",
        H200,
        EpilogueSpec(hidden_size=65536, top_k=8, quant=QuantSpec.nvfp4(1.0)),
        "flashinfer_fused",
        {LN: ["hidden_too_large"], LF: ["hidden_too_large"]},
        {},
    ),
]


@pytest.mark.parametrize("case", GOLDEN, ids=[c[0] for c in GOLDEN])
def test_golden_selection(case):
    _, env, spec, selected, codes, steps = case
    statuses = {s.name: s for s in static_statuses(spec, env)}
    assert select(list(statuses.values()), spec).strategy_for(16) == selected
    for name, expected in codes.items():
        assert [r.code for r in statuses[name].reasons] == expected, name
    for name, expected in steps.items():
        names = [s.name for s in statuses[name].steps]
        assert all(e in names for e in expected), (name, names)


def test_every_reason_says_what_was_required_and_what_was_seen():
    statuses = static_statuses(GPT_OSS, A100.replace(world_size=3))
    fi = {s.name: s for s in statuses}["flashinfer_fused"]
    messages = {r.code: r.message for r in fi.reasons}
    assert "SM >= 90" in messages["sm_too_low"] and "SM 80" in messages["sm_too_low"]
    assert (
        "[2, 4, 8, 16]" in messages["world_size_unsupported"]
        and "3 ranks" in messages["world_size_unsupported"]
    )
    assert "2880" in messages["hidden_not_multiple_of_256"]
    assert all(r.hint for r in fi.reasons)


def test_reference_is_never_auto_selected_but_can_be_requested():
    statuses = static_statuses(DSV3, CPU)
    assert "reference" not in select(statuses, DSV3).choice
    assert set(select(statuses, DSV3, "reference").choice) == {"reference"}


def test_explicit_request_that_cannot_run_raises_with_all_reasons():
    with pytest.raises(NoStrategyAvailable) as err:
        select(static_statuses(GPT_OSS, A100), GPT_OSS, "flashinfer_fused")
    assert "sm_too_low" in str(err.value) and "hidden_not_multiple_of_256" in str(err.value)


def test_unknown_strategy_name_is_rejected():
    with pytest.raises(ValueError, match="'auto' or one of"):
        select(static_statuses(DSV3, CPU), DSV3, "fastest")


def test_measurements_pick_fastest_strategy_and_variant_per_bucket_static_order_fills_gaps():
    spec = EpilogueSpec(hidden_size=7168, top_k=8, max_tokens=16)
    statuses = static_statuses(spec, H200)
    measured = {
        LF: {"oneshot": {1: 7.2, 2: 7.5, 16: 12.0}, "twoshot": {16: 11.0}},
        "flashinfer_fused": {"default": {1: 6.0, 2: 9.0, 16: 10.5}},
        "separate": {"default": {1: 45.0}},
    }
    plan = select(statuses, spec, measured_us=measured)
    assert plan.bounds == (1, 2, 4, 8, 16)
    assert plan.choice == ("flashinfer_fused", LF, LF, LF, "flashinfer_fused")
    assert plan.variants == ("default", "oneshot", "oneshot", "oneshot", "default")
    assert plan.measured_us[0] == 6.0 and plan.measured_us[2] is None and plan.source == "measured"
    measured[LF]["twoshot"][16] = 9.0
    plan = select(statuses, spec, measured_us=measured)
    assert plan.route_for(16) == (LF, "twoshot") and plan.route_for(9) == (LF, "twoshot")


def test_equal_times_go_to_the_static_order():
    """Documented rule (planner._fastest): ties go to the static order (registry order), whatever
    order the measurements come in. Mutant killed: ties going to the last strategy instead."""
    spec = EpilogueSpec(hidden_size=7168, top_k=8, max_tokens=2)
    statuses = static_statuses(spec, H200)
    order = [s.name for s in statuses]
    assert order.index(LF) < order.index("flashinfer_fused") < order.index("separate")
    tied = {
        "separate": {"default": {1: 5.0, 2: 9.0}},
        "flashinfer_fused": {"default": {1: 5.0, 2: 7.0}},
        LF: {"oneshot": {1: 5.0, 2: 7.0}},
    }
    plan = select(statuses, spec, measured_us=tied)
    assert plan.route_for(1) == (LF, "oneshot") and plan.route_for(2) == (LF, "oneshot")
    # without the first one, the tie goes to the next in static order (not the last)
    del tied[LF]
    plan = select(statuses, spec, measured_us=tied)
    assert plan.strategy_for(1) == "flashinfer_fused" and plan.strategy_for(2) == "flashinfer_fused"


def test_unmeasured_buckets_take_the_strategy_s_own_variant_heuristic():
    spec = EpilogueSpec(hidden_size=7168, top_k=8, max_tokens=8192)
    plan = select(static_statuses(spec, H200.replace(world_size=8)), spec)
    # FlashInfer's heuristic at TP8: one-shot up to 42 MB of traffic, and always for T <= world size
    assert plan.route_for(1) == (LF, "oneshot") and plan.route_for(8) == (LF, "oneshot")
    assert plan.route_for(256) == (LF, "twoshot")


def test_measurements_for_unknown_strategies_or_variants_are_ignored_with_a_note():
    spec = EpilogueSpec(hidden_size=7168, top_k=8, max_tokens=4)
    measured = {
        "local_fused": {"default": {1: 1.0}},
        LF: {"threeshot": {1: 1.0}, "oneshot": {2: 9.0}},
        "separate": {"default": {1: 50.0}},
    }
    plan = select(static_statuses(spec, H200), spec, measured_us=measured)
    assert plan.route_for(1) == ("separate", "default") and plan.route_for(2) == (LF, "oneshot")
    notes = " ".join(plan.notes)
    assert (
        "unknown strategy 'local_fused'" in notes
        and "unknown variant local_fused_flashinfer:threeshot" in notes
    )


def test_buckets_above_the_flashinfer_workspace_choose_the_nccl_strategy():
    # FlashInfer's Lamport buffers cap its workspace below max_tokens at H=7168: 2^31 / (2 * 7168 *
    # 2)
    spec = EpilogueSpec(hidden_size=7168, top_k=8, max_tokens=131072)
    statuses = {s.name: s for s in static_statuses(spec, H200)}
    limit = statuses[LF].max_tokens_per_call
    assert limit is not None and limit < spec.max_tokens
    plan = select(list(statuses.values()), spec)
    assert plan.strategy_for(limit // 2) == LF
    first_above = min(b for b in plan.bounds if b > limit)
    assert plan.strategy_for(first_above) == LN and plan.overflow == LN


def test_tokens_above_a_workspace_limit_go_to_a_strategy_without_one():
    spec = EpilogueSpec(hidden_size=7168, top_k=8, max_tokens=64)
    statuses = [
        s for s in static_statuses(spec, H200) if s.name in ("flashinfer_fused", "separate")
    ]
    plan = select(statuses, spec)
    assert plan.strategy_for(64) == "flashinfer_fused" and plan.strategy_for(65) == "separate"
    explicit = select(statuses, spec, "flashinfer_fused")
    assert explicit.overflow is None


def test_bucket_index_is_the_power_of_two_ceiling():
    assert [bucket_index(t) for t in (1, 2, 3, 4, 5, 8, 9, 1024, 1025)] == [
        0,
        1,
        2,
        2,
        3,
        3,
        4,
        10,
        11,
    ]
    assert bucket_bounds(1) == (1,) and bucket_bounds(100) == (1, 2, 4, 8, 16, 32, 64, 100)


def test_error_bounds_are_wider_for_flashinfer_bf16_accumulation():
    statuses = {s.name: s for s in static_statuses(DSV3, H200)}
    assert statuses["reference"].error_bound < statuses[LF].error_bound
    assert statuses[LF].error_bound < statuses["flashinfer_fused"].error_bound
    fp16 = {
        s.name: s
        for s in static_statuses(EpilogueSpec(hidden_size=7168, top_k=8, dtype=torch.float16), H200)
    }
    assert fp16[LF].error_bound < statuses[LF].error_bound / 4
