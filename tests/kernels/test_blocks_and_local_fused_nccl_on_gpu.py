"""GPU tests of our kernels and the local_fused_nccl strategy on one GPU.

test_blocks.py also runs on the GPU when one is present (same parity grid, poisoned
outputs)."""

import pytest
import torch

from fusion_bridge import EpilogueSpec, FusionBridge, QuantSpec
from fusion_bridge.spec import SFLayout
from fusion_bridge.strategies.reference import reference_epilogue
from fusion_bridge.oracle.numerics import compare, failures, rel_err
from fusion_bridge.oracle.synthetic import make_inputs
from fusion_bridge.oracle.torch_math import finalize_fp32

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda", 0)


def call(bridge, inp):
    return bridge.finalize_epilogue(
        inp.gemm2_out,
        inp.expanded_idx_to_permuted_idx,
        inp.expert_weights,
        inp.shared_output,
        inp.residual,
        inp.gamma,
    )


@pytest.mark.parametrize(
    "quant",
    [
        QuantSpec.none(),
        QuantSpec.fp8(0.05),
        QuantSpec.nvfp4(336.0),
        QuantSpec.nvfp4(336.0, "linear"),
    ],
)
@pytest.mark.parametrize("hidden,top_k", [(7168, 8), (4096, 8), (2880, 4), (7168, 1)])
def test_local_fused_parity_grid(hidden, top_k, quant):
    spec = EpilogueSpec(
        hidden_size=hidden, top_k=top_k, quant=quant, routed_scaling_factor=2.5, weight_bias=1.0
    )
    with FusionBridge(spec, strategy="local_fused_nccl", debug=False) as bridge:
        status = {s.name: s for s in bridge.statuses}["local_fused_nccl"]
        assert status.self_test == "passed"
        for tokens in (1, 3, 64, 129, 1000):
            for wdt in (torch.float32, torch.bfloat16):
                inp = make_inputs(spec, tokens, seed=tokens, device=DEV, weight_dtype=wdt)
                got, ref = call(bridge, inp), reference_epilogue(spec, inp)
                bad = failures(spec, compare(spec, got, ref), ref, status.error_bound)
                assert not bad, f"T={tokens} {wdt}: {bad}"


def test_auto_on_one_gpu_selects_fused_tp1_after_the_self_tests():
    # world size 1: the one-launch kernel leads the static order and wins every measured TP1 bucket
    with FusionBridge(EpilogueSpec(hidden_size=7168, top_k=8)) as bridge:
        status = {s.name: s for s in bridge.statuses}
        assert bridge.strategy_for(16) == "fused_tp1"
        for name in ("fused_tp1", "local_fused_nccl"):
            assert status[name].self_test == "passed", (name, status[name])
            assert status[name].self_test_error < 5e-3, (name, status[name].self_test_error)
        assert status["flashinfer_fused"].reasons[0].code in (
            "world_size_unsupported",
            "flashinfer_missing",
        )


# every world-size-1 route, captured: `separate`'s torch NVFP4 once copied a host table over (which
# a capture refuses) and stopped `tune --quant nvfp4` at T=1
@pytest.mark.parametrize("strategy", ["auto", "local_fused_nccl", "separate"])
@pytest.mark.parametrize("layout", [SFLayout.SWIZZLED_128x4, SFLayout.LINEAR])
def test_cuda_graph_capture_and_replay_with_new_inputs(strategy, layout):
    spec = EpilogueSpec(hidden_size=7168, top_k=8, quant=QuantSpec.nvfp4(336.0, layout))
    with FusionBridge(spec, strategy=strategy, debug=False) as bridge:
        static = make_inputs(spec, 16, seed=1, device=DEV)
        call(bridge, static)  # warm up: compile the kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(bridge, static)
        for seed in (2, 3):
            fresh = make_inputs(spec, 16, seed=seed, device=DEV)
            for dst, src in zip(
                (
                    static.gemm2_out,
                    static.expanded_idx_to_permuted_idx,
                    static.expert_weights,
                    static.shared_output,
                    static.residual,
                    static.gamma,
                ),
                (
                    fresh.gemm2_out,
                    fresh.expanded_idx_to_permuted_idx,
                    fresh.expert_weights,
                    fresh.shared_output,
                    fresh.residual,
                    fresh.gamma,
                ),
            ):
                dst.copy_(src)
            out.norm_out.fill_(float("nan"))  # poison: the replay must rewrite it
            graph.replay()
            ref = reference_epilogue(spec, fresh)
            bound = {s.name: s.error_bound for s in bridge.statuses}[bridge.strategy_for(16)]
            assert not failures(spec, compare(spec, out, ref), ref, bound)


def test_torch_compile_of_a_function_calling_the_ops():
    import fusion_bridge.kernels.ops  # noqa: F401

    spec = EpilogueSpec(hidden_size=2048, top_k=4)
    inp = make_inputs(spec, 33, device=DEV)

    def epilogue(g, p, w, s, r, gamma):
        partial = torch.ops.fusion_bridge.finalize_add(g, p, w, s, 1.0)
        res, norm, _, _ = torch.ops.fusion_bridge.add_rmsnorm_quant(
            r, partial, gamma, 1e-6, 0.0, 0, 1.0, True
        )
        return res, norm * 2

    args = (
        inp.gemm2_out,
        inp.expanded_idx_to_permuted_idx,
        inp.expert_weights,
        inp.shared_output,
        inp.residual,
        inp.gamma,
    )
    eager = epilogue(*args)
    compiled = torch.compile(epilogue, fullgraph=True)(*args)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_finalize_add_with_more_than_2_to_the_31_elements():
    import fusion_bridge.kernels.ops  # noqa: F401

    hidden, tokens, top_k = 7168, 8, 4
    rows = (2**31) // hidden + 4096  # P * H > 2^31: 32-bit offsets would wrap
    gemm2_out = torch.empty(rows, hidden, dtype=torch.bfloat16, device=DEV)
    perm = torch.randint(
        rows - 4096, rows, (tokens, top_k), dtype=torch.int32, device=DEV
    )  # the far rows
    gemm2_out[rows - 4096 :].normal_()
    weights = torch.rand(tokens, top_k, device=DEV)
    out = torch.ops.fusion_bridge.finalize_add(gemm2_out, perm, weights, None, 1.0)
    ref = finalize_fp32(gemm2_out, perm, weights, 1.0)
    assert rel_err(out, ref) < 2 * 2**-8
    del gemm2_out
    torch.cuda.empty_cache()


def test_shadow_samples_eager_calls_and_skips_graph_capture():
    spec = EpilogueSpec(hidden_size=4096, top_k=8)
    with FusionBridge(spec, debug=False, shadow="reference:1") as bridge:
        inp = make_inputs(spec, 8, device=DEV)
        call(bridge, inp)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call(bridge, inp)
        graph.replay()
        shadow = bridge.explain().to_dict()["shadow"]
    assert shadow["calls"] == 2 and shadow["sampled"] == 1 and shadow["skipped_in_capture"] == 1
    assert 0 < shadow["outputs"]["norm_out"]["max_rel_err"] < 5e-3
