"""`exclude=[...]` / FUSION_BRIDGE_EXCLUDE across ranks: the exclusions are a setting every rank
must share (compared at build like the requested strategy), and an agreed exclusion keeps the
strategy out of every rank's plan. Two gloo ranks on CPU."""

import os

import torch

from fusion_bridge.cli.launch import run_distributed
from fusion_bridge.oracle.synthetic import make_inputs

SPEC_ARGS = dict(hidden_size=64, top_k=2, max_tokens=8)


def _ranks(rank, world_size):
    from fusion_bridge import EpilogueSpec, FusionBridge

    spec = EpilogueSpec(**SPEC_ARGS)
    group = torch.distributed.group.WORLD
    out = {}
    if rank == 1:  # the variable set on one rank only
        os.environ["FUSION_BRIDGE_EXCLUDE"] = "local_fused_nccl"
    try:
        FusionBridge(spec, group, build_timeout_s=60).close()
        out["one_rank"] = ("built", "")
    except Exception as exc:  # returned to the parent, which asserts on it
        out["one_rank"] = (type(exc).__name__, str(exc))
    os.environ.pop("FUSION_BRIDGE_EXCLUDE", None)
    # the same exclusion on every rank (argument): agreed, and out of the plan everywhere
    with FusionBridge(spec, group, exclude=["local_fused_nccl"], build_timeout_s=60) as bridge:
        inputs = make_inputs(spec, 3, rank=rank)
        bridge.finalize_epilogue(
            inputs.gemm2_out,
            inputs.expanded_idx_to_permuted_idx,
            inputs.expert_weights,
            inputs.shared_output,
            inputs.residual,
            inputs.gamma,
        )
        out["plan"] = set(bridge.plan.choice)
        out["calls"] = bridge.route_calls()
    return out


def test_exclusions_are_agreed_across_ranks_like_the_other_settings():
    results = run_distributed(_ranks, 2, backend="gloo", timeout_s=240)
    for rank, out in enumerate(results):
        kind, message = out["one_rank"]
        assert kind == "RankAgreementError", (rank, out["one_rank"])
        assert "excluded: '' on rank 0" in message and "'local_fused_nccl' on rank 1" in message
        assert out["plan"] == {"separate"}
        assert out["calls"] == [
            {"strategy": "separate", "variant": "default", "eager": 1, "captured": 0}
        ]
