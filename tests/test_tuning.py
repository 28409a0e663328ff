"""Bucket logic and table keying of the measured selection (no GPU needed)."""

import json
import os

import torch

from fusion_bridge import EpilogueSpec, Environment, QuantSpec
from fusion_bridge.launch import run_distributed
from fusion_bridge.planner import select, static_statuses
from fusion_bridge.tuning import (as_measurements, cache_path, default_table_path, load_table, per_strategy,
                                  save_table, table_key)

H200_TP2 = Environment(device_type="cuda", sm=90, gpu_name="NVIDIA H200", world_size=2, triton_version="3.6.0",
                       flashinfer_version="0.7.2.post1", torch_version="2.11.0")
DSV3 = EpilogueSpec(hidden_size=7168, top_k=8)


def test_keys_follow_gpu_world_spec_and_versions_but_not_numerics_or_max_tokens():
    base = table_key(DSV3, H200_TP2, True)
    assert table_key(EpilogueSpec(hidden_size=7168, top_k=8, eps=1e-5, max_tokens=64, weight_bias=1.0),
                     H200_TP2, True) == base
    for spec in (EpilogueSpec(hidden_size=4096, top_k=8), EpilogueSpec(hidden_size=7168, top_k=8, quant=QuantSpec.fp8(1.0)),
                 EpilogueSpec(hidden_size=7168, top_k=8, dtype=torch.float16)):
        assert table_key(spec, H200_TP2, True) != base
    for env in (H200_TP2.replace(world_size=4), H200_TP2.replace(gpu_name="NVIDIA B200"),
                H200_TP2.replace(flashinfer_version="0.8.0")):
        assert table_key(DSV3, env, True) != base
    assert table_key(DSV3, H200_TP2.replace(flashinfer_version="0.8.0"), False) == table_key(DSV3, H200_TP2, False)


def test_sub_path_candidates_collapse_to_their_strategy_and_remember_the_winner():
    measured = {"local_fused/flashinfer_ar_norm": {1: 7.0, 4096: 430.0},
                "local_fused/nccl_local_norm": {1: 14.0, 4096: 420.0}, "flashinfer_fused": {1: 8.5, 4096: 1070.0}}
    best, subpaths = per_strategy(measured)
    assert best["local_fused"] == {1: 7.0, 4096: 420.0}
    assert subpaths == {1: "flashinfer_ar_norm", 4096: "nccl_local_norm"}
    spec = EpilogueSpec(hidden_size=7168, top_k=8, max_tokens=4096)
    plan = select(static_statuses(spec, H200_TP2), spec, measured_us=best)
    assert plan.strategy_for(1) == "local_fused" and plan.strategy_for(2) == "local_fused"  # 2: static order


def test_shipped_h200_tables_resolve_and_pick_local_fused():
    for world in (1, 2):
        path = default_table_path(DSV3, H200_TP2.replace(world_size=world))
        assert path.is_file(), path
        best, _ = per_strategy(as_measurements(json.loads(path.read_text())))
        env = H200_TP2.replace(world_size=world)
        plan = select(static_statuses(DSV3, env), DSV3, measured_us=best)
        assert set(plan.choice) == {"local_fused"} and plan.source == "measured"


def test_cache_wins_over_the_shipped_default(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSION_BRIDGE_CACHE_DIR", str(tmp_path))
    env1 = H200_TP2.replace(world_size=1)
    assert load_table(DSV3, env1, None)["path"] == str(default_table_path(DSV3, env1))
    save_table({"measured_us": {"separate": {"1": 1.0}}}, cache_path(DSV3, env1))
    table = load_table(DSV3, env1, None)
    assert table["path"] == str(cache_path(DSV3, env1)) and as_measurements(table) == {"separate": {1: 1.0}}


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
        save_table({"measured_us": {"separate": {"1": 3.0}}}, cache_path(DSV3, env))
    finally:
        del os.environ["FUSION_BRIDGE_CACHE_DIR"]
    r0, r1 = run_distributed(_load_on_ranks, 2, dirs, backend="gloo", timeout_s=120)
    assert r0 == r1 == {"separate": {"1": 3.0}}


def test_local_fused_keeps_flashinfer_for_buckets_the_table_did_not_measure():
    from fusion_bridge.strategies.local_fused import LocalFusedStrategy
    strategy = LocalFusedStrategy(DSV3, H200_TP2)
    strategy.subpath_by_bucket = ["nccl_local_norm", "flashinfer_ar_norm", ""]
    assert [strategy._flashinfer_wanted(t) for t in (1, 2, 3, 4096)] == [False, True, True, True]
    strategy.forced_subpath = "nccl_local_norm"
    assert not strategy._flashinfer_wanted(2)
