"""Bucket logic and table keying of the measured selection (no GPU needed)."""

import json
import os

import torch

import pytest

from fusion_bridge import EpilogueSpec, QuantSpec
from fusion_bridge.cli.launch import run_distributed
from fusion_bridge.strategies import Environment
from fusion_bridge.plan.planner import select, static_statuses
from fusion_bridge.tuning.tables import (
    SCHEMA_VERSION,
    as_measurements,
    cache_path,
    default_table_path,
    load_table,
    make_table,
    read_table,
    save_table,
    table_key,
)

H200_TP2 = Environment(
    device_type="cuda",
    sm=90,
    gpu_name="NVIDIA H200",
    world_size=2,
    triton_version="3.6.0",
    flashinfer_version="0.7.2.post1",
    torch_version="2.11.0",
)
DSV3 = EpilogueSpec(hidden_size=7168, top_k=8)


def test_keys_follow_gpu_world_spec_and_versions_but_not_numerics_or_max_tokens():
    base = table_key(DSV3, H200_TP2, True)
    assert (
        table_key(
            EpilogueSpec(hidden_size=7168, top_k=8, eps=1e-5, max_tokens=64, weight_bias=1.0),
            H200_TP2,
            True,
        )
        == base
    )
    for spec in (
        EpilogueSpec(hidden_size=4096, top_k=8),
        EpilogueSpec(hidden_size=7168, top_k=8, quant=QuantSpec.fp8(1.0)),
        EpilogueSpec(hidden_size=7168, top_k=8, dtype=torch.float16),
    ):
        assert table_key(spec, H200_TP2, True) != base
    for env in (
        H200_TP2.replace(world_size=4),
        H200_TP2.replace(gpu_name="NVIDIA B200"),
        H200_TP2.replace(flashinfer_version="0.8.0"),
    ):
        assert table_key(DSV3, env, True) != base
    assert table_key(DSV3, H200_TP2.replace(flashinfer_version="0.8.0"), False) == table_key(
        DSV3, H200_TP2, False
    )


@pytest.mark.parametrize(
    "layer_a, layer_b",
    [
        (QuantSpec.fp8(0.05), QuantSpec.fp8(0.73)),
        (QuantSpec.nvfp4(448 * 6 / 8.0), QuantSpec.nvfp4(448 * 6 / 3.1)),
    ],
)
def test_two_layers_with_different_quant_scales_share_one_table(
    tmp_path, monkeypatch, layer_a, layer_b
):
    # the scales are calibrated per layer; the table key must not see them, or no layer of a
    # quantized model would ever find a tuned (or shipped) table
    a = EpilogueSpec(hidden_size=7168, top_k=8, quant=layer_a)
    b = EpilogueSpec(hidden_size=7168, top_k=8, quant=layer_b)
    for versions in (True, False):
        assert table_key(a, H200_TP2, versions) == table_key(b, H200_TP2, versions)
    assert default_table_path(a, H200_TP2) == default_table_path(b, H200_TP2)
    # a table `tune` saved while building layer a is the one layer b loads
    monkeypatch.setenv("FUSION_BRIDGE_CACHE_DIR", str(tmp_path))
    measured = {"local_fused_nccl": {"default": {1: 6.0, 8192: 400.0}}}
    save_table(make_table(a, H200_TP2.replace(world_size=1), measured), cache_path(a, H200_TP1))
    loaded = load_table(b, H200_TP1, None)
    assert loaded is not None and as_measurements(loaded) == measured
    # the kind and the scale layout still count: they change the work
    assert table_key(a, H200_TP2, False) != table_key(DSV3, H200_TP2, False)
    if layer_a.kind.value == "nvfp4":
        linear = EpilogueSpec(
            hidden_size=7168, top_k=8, quant=QuantSpec.nvfp4(layer_a.global_scale, "linear")
        )
        assert table_key(linear, H200_TP2, False) != table_key(a, H200_TP2, False)


def test_the_unquantized_key_is_unchanged_so_the_shipped_tables_are_found():
    assert default_table_path(DSV3, H200_TP2).is_file()


H200_TP1 = H200_TP2.replace(world_size=1)


def test_tables_round_trip_strategy_variant_bucket(tmp_path):
    measured = {
        "local_fused_flashinfer": {"oneshot": {1: 7.0, 4096: 430.0}, "twoshot": {4096: 420.0}}
    }
    table = make_table(DSV3, H200_TP2, measured)
    assert table["schema_version"] == SCHEMA_VERSION == 2
    save_table(table, tmp_path / "t.json")
    assert as_measurements(read_table(tmp_path / "t.json")) == measured


@pytest.mark.parametrize(
    "content, why",
    [
        ({"measured_us": {"local_fused/nccl_local_norm": {"1": 5.0}}}, "schema_version None"),
        ({"schema_version": 1, "measured_us": {}}, "schema_version 1"),
        (
            {"schema_version": 2, "measured_us": {"separate": {"1": 5.0}}},
            r"measured_us\['separate'\]\['1'\] is not",
        ),
        ([1, 2], "not a JSON object"),
    ],
)
def test_a_table_in_another_format_is_ignored_with_a_warning_that_says_why(tmp_path, content, why):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(content))
    with pytest.warns(UserWarning, match=why):
        assert read_table(path) is None
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="ignored"):
        assert read_table(path) is None


@pytest.mark.parametrize(
    "content, why",
    [
        (
            {"measured_us": {"separate": {"default": {"1": float("nan")}}}},
            r"\[1\] is 'nan', not a number of microseconds",
        ),
        (
            {"measured_us": {"separate": {"default": {"1": float("inf")}}}},
            r"\[1\] is 'inf', not a number of microseconds",
        ),
        (
            {"measured_us": {}, "eager_us": {"separate": {"1": 5.0}}},
            r"eager_us\['separate'\]\['1'\] is not",
        ),
        (
            {"measured_us": {}, "eager_us": {"separate": {"default": {"1": float("-inf")}}}},
            r"eager_us\['separate'\]\['default'\]\[1\] is '-inf'",
        ),
        ({"measured_us": {}, "eager_us": {"separate": {"default": {"0": 5.0}}}}, "bucket '0'"),
    ],
    ids=["nan", "infinity", "eager_shape", "eager_infinity", "eager_bucket"],
)
def test_non_finite_times_and_a_malformed_eager_section_make_the_table_ignored(
    tmp_path, content, why
):
    """Mutants killed: NaN / Infinity times accepted (json writes and reads them: a NaN time never
    loses a comparison, so the planner's choice would be arbitrary), and the eager_us section left
    unvalidated (a malformed one crashes the build instead of being ignored with a warning)."""
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"schema_version": SCHEMA_VERSION, **content}))
    with pytest.warns(UserWarning, match=why):
        assert read_table(path) is None


def test_shipped_h200_tables_resolve_and_are_used():
    table = read_table(default_table_path(DSV3, H200_TP2))
    assert table is not None, default_table_path(DSV3, H200_TP2)
    plan = select(static_statuses(DSV3, H200_TP2), DSV3, measured_us=as_measurements(table))
    assert plan.source == "measured" and all(t is not None for t in plan.measured_us[:13])
    assert not plan.notes, plan.notes  # every strategy and variant in the table is known


@pytest.mark.parametrize("quant", [QuantSpec.none(), QuantSpec.fp8(0.05), QuantSpec.nvfp4(336.0)])
def test_shipped_tp1_tables_pick_fused_tp1_at_every_bucket(quant):
    """The TP1 tables that ship (`tune --world-size 1` on one H200, benchmarks/results/
    tune_h200_tp1.txt) measured fused_tp1 fastest at every bucket, so auto takes it on measured
    times."""
    spec = EpilogueSpec(hidden_size=7168, top_k=8, quant=quant)
    table = read_table(default_table_path(spec, H200_TP1))
    assert table is not None, default_table_path(spec, H200_TP1)
    measured = as_measurements(table)
    assert set(measured) == {"fused_tp1", "local_fused_nccl", "separate"}, set(measured)
    plan = select(static_statuses(spec, H200_TP1), spec, measured_us=measured)
    assert plan.source == "measured" and not plan.notes, plan
    assert set(plan.choice) == {"fused_tp1"} and plan.overflow == "fused_tp1", plan
    for bucket, us in measured["fused_tp1"]["default"].items():  # faster than the two launches
        assert us < measured["local_fused_nccl"]["default"][bucket], (bucket, measured)


def test_cache_wins_over_the_shipped_default(tmp_path, monkeypatch):
    from fusion_bridge.tuning import tables as tuning

    shipped = tmp_path / "tables"
    shipped.mkdir()
    monkeypatch.setattr(tuning, "TABLES_DIR", shipped)  # a shipped default for TP1 in a copy
    monkeypatch.setenv("FUSION_BRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    env1 = H200_TP1
    shipped_table = make_table(DSV3, env1, {"fused_tp1": {"default": {1: 2.0}}})
    save_table(shipped_table, default_table_path(DSV3, env1))
    assert load_table(DSV3, env1, None)["path"] == str(default_table_path(DSV3, env1))
    save_table(make_table(DSV3, env1, {"separate": {"default": {1: 1.0}}}), cache_path(DSV3, env1))
    table = load_table(DSV3, env1, None)
    assert table["path"] == str(cache_path(DSV3, env1))
    assert as_measurements(table) == {"separate": {"default": {1: 1.0}}}


def _load_on_ranks(rank, world_size, cache_dirs):
    os.environ["FUSION_BRIDGE_CACHE_DIR"] = cache_dirs[rank]
    env = H200_TP2.replace(gpu_name="NVIDIA test GPU")  # no shipped default for it
    table = load_table(DSV3, env, torch.distributed.group.WORLD)
    return None if table is None else table["measured_us"]


def test_every_rank_uses_rank_zeros_table(tmp_path):
    dirs = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
    env = H200_TP2.replace(gpu_name="NVIDIA test GPU")
    os.environ["FUSION_BRIDGE_CACHE_DIR"] = dirs[0]
    try:
        save_table(
            make_table(DSV3, env, {"separate": {"default": {1: 3.0}}}), cache_path(DSV3, env)
        )
    finally:
        del os.environ["FUSION_BRIDGE_CACHE_DIR"]
    r0, r1 = run_distributed(_load_on_ranks, 2, dirs, backend="gloo", timeout_s=120)
    assert r0 == r1 == {"separate": {"default": {"1": 3.0}}}


def _load_on_a_subgroup(rank, world_size, cache_dirs):
    """Ranks 1 and 2 of 3 form the TP group; rank 0 is not in it (and calls nothing of it)."""
    group = torch.distributed.new_group([1, 2])
    if rank == 0:
        return None
    os.environ["FUSION_BRIDGE_CACHE_DIR"] = cache_dirs[rank]
    env = H200_TP2.replace(gpu_name="NVIDIA test GPU")
    table = load_table(DSV3, env, group)
    return None if table is None else table["measured_us"]


def test_a_group_without_global_rank_zero_uses_its_own_first_ranks_table(tmp_path):
    """The table is broadcast from the group's first rank (global rank 1 here), not from global
    rank 0, which is not in the group: both members get rank 1's table."""
    dirs = [str(tmp_path / f"rank{r}") for r in range(3)]
    env = H200_TP2.replace(gpu_name="NVIDIA test GPU")
    os.environ["FUSION_BRIDGE_CACHE_DIR"] = dirs[1]
    try:
        save_table(
            make_table(DSV3, env, {"separate": {"default": {1: 5.0}}}), cache_path(DSV3, env)
        )
    finally:
        del os.environ["FUSION_BRIDGE_CACHE_DIR"]
    r0, r1, r2 = run_distributed(_load_on_a_subgroup, 3, dirs, backend="gloo", timeout_s=120)
    assert r0 is None and r1 == r2 == {"separate": {"default": {"1": 5.0}}}


def _spec_of_shipped(fields: dict, **extra) -> EpilogueSpec:
    from fusion_bridge.spec import DTYPE_BY_NAME, QuantKind, SFLayout

    quant = fields["quant"]
    kind, layout = QuantKind(quant["kind"]), SFLayout(quant["sf_layout"])
    q = {
        QuantKind.NONE: QuantSpec.none(),
        QuantKind.FP8: QuantSpec.fp8(0.05),
        QuantKind.NVFP4: QuantSpec.nvfp4(336.0, layout),
    }[kind]
    return EpilogueSpec(
        hidden_size=fields["hidden_size"],
        top_k=fields["top_k"],
        dtype=DTYPE_BY_NAME[fields["dtype"]],
        has_shared_output=fields["has_shared_output"],
        quant=q,
        **extra,
    )


def test_every_shipped_table_is_found_with_the_new_spec_fields_at_their_defaults():
    """Spec fields added after the tables shipped (shared_output_replicated) stay out of the key at
    their defaults: every shipped table is found from a spec built the way it was measured, its
    new fields left at (or set to) their defaults; set away from the default, it is not."""
    from fusion_bridge.tuning.tables import TABLES_DIR

    shipped = sorted(TABLES_DIR.glob("*.json"))
    assert len(shipped) >= 4, shipped
    for path in shipped:
        table = json.loads(path.read_text())
        env = H200_TP2.replace(world_size=table["world_size"], gpu_name=table["gpu"])
        for spec in (
            _spec_of_shipped(table["spec"]),
            _spec_of_shipped(table["spec"], shared_output_replicated=False),
        ):
            assert default_table_path(spec, env) == path, (path, spec)
            assert read_table(path) is not None
        replicated = _spec_of_shipped(table["spec"], shared_output_replicated=True)
        assert default_table_path(replicated, env) != path


def _spec_of_table(stored: dict) -> EpilogueSpec:
    """The EpilogueSpec a shipped table's stored spec (its key) describes, with the key's left-out
    values (eps, scales, ...) at anything valid: the key ignores them."""
    quant = dict(stored["quant"])
    kind = quant["kind"]
    if kind == "fp8":
        q = QuantSpec.fp8(0.5)
    elif kind == "nvfp4":
        q = QuantSpec.nvfp4(336.0, quant["sf_layout"])
    elif kind == "fp8_per_token_group":
        q = QuantSpec.fp8_per_token_group(quant["group_size"], quant["scale_layout"])
    else:
        q = QuantSpec(kind)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[stored["dtype"]]
    extra = {k: stored[k] for k in ("shared_output_replicated",) if k in stored}
    return EpilogueSpec(
        hidden_size=stored["hidden_size"],
        top_k=stored["top_k"],
        dtype=dtype,
        has_shared_output=stored["has_shared_output"],
        quant=q,
        **extra,
    )


def test_every_shipped_table_is_found_for_its_spec():
    """Each file in tuning/shipped/ is the table default_table_path names for the spec it stores,
    today's spec_key included: a field added to the spec (the dynamic FP8 group_size and
    scale_layout) stays out of the key at its default, so no shipped table is orphaned."""
    import json

    from fusion_bridge.tuning.tables import TABLES_DIR, spec_key

    files = sorted(TABLES_DIR.glob("*.json"))
    assert files
    for path in files:
        stored = json.loads(path.read_text())
        spec = _spec_of_table(stored["spec"])
        assert spec_key(spec) == stored["spec"], (path.name, spec_key(spec), stored["spec"])
        env = Environment(
            device_type="cuda",
            sm=90,
            gpu_name=stored["gpu"],
            world_size=stored["world_size"],
            triton_version="3.6.0",
        )
        assert default_table_path(spec, env) == path, path.name
        assert read_table(path) is not None


def test_the_dynamic_fp8_fields_are_in_the_key_when_set():
    from fusion_bridge.tuning.tables import spec_key

    none_key = spec_key(EpilogueSpec(hidden_size=7168, top_k=8))
    group = EpilogueSpec(hidden_size=7168, top_k=8, quant=QuantSpec.fp8_per_token_group(128))
    tma = EpilogueSpec(
        hidden_size=7168, top_k=8, quant=QuantSpec.fp8_per_token_group(128, "column_major_tma")
    )
    keys = [spec_key(s) for s in (group, tma)]
    assert keys[0]["quant"]["group_size"] == 128 and keys[0]["quant"]["scale_layout"] == "row_major"
    assert keys[0] != keys[1] != none_key
    assert "group_size" not in none_key["quant"] and "scale_layout" not in none_key["quant"]
