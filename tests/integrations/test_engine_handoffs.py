"""vLLM's and SGLang's deferred-finalize handoffs through fusion_bridge.integrations.vllm / .sglang,
built with the engines' own class definitions (tests/integrations/engine_wheels.py), judged
against tests/oracle64.py; and every convention trap refused.

World size 1 in this process and 2 gloo ranks in one spawned group; -1 slots (experts on another
rank), route-major maps (vLLM's route_major_moe_output), bf16 and fp32 routing weights, buffers
longer than the call (FlashInfer's 1-D buffers, SGLang's m).
"""

from __future__ import annotations

import functools

import pytest
import torch

from fusion_bridge import EpilogueInputError, EpilogueSpec, FusionBridge
from fusion_bridge.integrations import engine_handoff as eh, sglang as sg, vllm as vl
from fusion_bridge.integrations.engine_norms import HandoffError, engine_norm_offset
from tests.helpers import once_per_run
from tests.integrations import engine_cases as ec, engine_wheels as ew

WEIGHT_DTYPES = [torch.bfloat16, torch.float32]


@functools.lru_cache(maxsize=None)
def bridge(factor: float = 1.0, weight_bias: float = 0.0, shared: bool = True) -> FusionBridge:
    """A world-size-1 bridge per spec, built once per test process."""
    spec = EpilogueSpec(
        hidden_size=ec.H,
        top_k=ec.K,
        eps=ec.EPS,
        routed_scaling_factor=factor,
        weight_bias=weight_bias,
        has_shared_output=shared,
    )
    return FusionBridge(spec, strategy="separate")


# ---------------------------------------------------------------- what the sources say
def test_the_engine_sources_say_what_the_adapters_assume():
    """The conventions the adapters encode, read from the engines' own sources."""
    moe_output = " ".join(ew.source(ew.VLLM, ew.MOE_OUTPUT).replace("#", " ").split())
    assert "Already folded into the routing weights for methods that do so" in moe_output
    assert "-1 = expert not local" in moe_output
    deferred = ew.source(ew.SGLANG, ew.SGL_DEFERRED)
    assert "gemm2_out.view(\n                -1, deferred_output.gemm2_out.shape[-1]" in deferred
    assert deferred.count(".view(-1, top_k)[:m]") == 1  # the weights' view
    assert "expanded_idx_to_permuted_idx.view(\n                -1, top_k\n            )[:m]" in (
        deferred
    )
    flashinfer = ew.source(ew.SGLANG, ew.SGL_FLASHINFER)
    finish = flashinfer[flashinfer.index("def finalize_flashinfer_trtllm_deferred_output") :]
    finish = finish[: finish.index("\n\n\n")]
    assert "scaling" not in finish  # SGLang's deferred finalize applies no routed scale
    assert "return layernorm.gemma_weight" in ew.source(ew.SGLANG, ew.SGL_FUSED_GAMMA)
    for engine, member, applied in (
        (ew.VLLM, ew.VLLM_NORMS, "self.weight.float() + 1.0"),
        (ew.SGLANG, ew.SGL_NORMS, "1.0 + self.weight.float()"),
    ):
        text = ew.source(engine, member)
        gemma = ew.class_def(text, "GemmaRMSNorm")
        assert applied in ast_source(text, gemma), (engine, applied)
        for cls, offset in (("RMSNorm", 0.0), ("GemmaRMSNorm", 1.0)):
            norm = ew.engine_norm(engine, cls, torch.zeros(ec.H), 1e-6)
            assert engine_norm_offset(norm) == offset == engine_norm_offset(type(norm))


def ast_source(text: str, node) -> str:
    lines = text.splitlines()
    return "\n".join(lines[node.lineno - 1 : node.end_lineno])


# ---------------------------------------------------------------- vLLM, world size 1
def vllm_output(p: ec.Pieces, folded: bool, w_dtype, route_major: bool, finalized: bool = False):
    mo = ew.vllm_moe_output()
    weights = ec.handoff_weights(p, folded, w_dtype)
    if route_major:
        routed = mo.route_major_moe_output(p.gemm2, weights, p.topk_ids, p.expert_map)
        assert torch.equal(routed.expanded_idx_to_permuted_idx, p.perm)  # vLLM's own map
    else:
        routed = mo.UnfinalizedMoEOutput(p.gemm2, weights, p.perm)
    if finalized:
        routed = torch.zeros(p.residual.shape, dtype=p.residual.dtype)
    return mo.MoEOutput(routed, p.shared, 1.0 if folded else ec.FACTOR)


@pytest.mark.parametrize("w_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("route_major,folded", [(True, True), (False, False)])
def test_vllm_moe_output_matches_the_oracle(w_dtype, route_major, folded):
    # experts of 2 ranks, this process holds rank 0's: -1 slots
    tokens, kw = 6, dict(route_major=route_major)
    p = ec.pieces(tokens, tokens, 2, 0, **kw)
    out = vl.finalize_moe_output(
        bridge(1.0 if folded else ec.FACTOR),
        vllm_output(p, folded, w_dtype, route_major),
        p.residual,
        norm_weight=p.norm_weight,
    )
    assert (p.perm == -1).any()
    exact = ec.oracle(tokens, tokens, 2, folded=folded, w_dtype=w_dtype, ranks=1, **kw)
    ec.check(out, exact)


@pytest.mark.parametrize("folded", [True, False])
def test_vllm_refuses_a_spec_that_scales_twice_or_not_at_all(folded):
    p = ec.pieces(4, 4, 1, 0, route_major=True)
    moe_output = vllm_output(p, folded, torch.float32, True)
    with pytest.raises(HandoffError, match="routed_scaling_factor must be") as info:
        vl.finalize_moe_output(
            bridge(ec.FACTOR if folded else 1.0), moe_output, p.residual, norm_weight=p.norm_weight
        )
    assert ("a second time" in str(info.value)) == folded, info.value


def test_vllm_refuses_a_finalized_routed_output_and_a_short_route_major_buffer():
    p = ec.pieces(4, 4, 1, 0, route_major=True)
    finalized = vllm_output(p, True, torch.float32, True, finalized=True)
    with pytest.raises(HandoffError, match="finalized tensor"):
        vl.finalize_moe_output(bridge(), finalized, p.residual, norm_weight=p.norm_weight)
    moe_output = vllm_output(p, True, torch.float32, True)
    moe_output.routed.gemm2_permuted = p.gemm2[:-1]
    with pytest.raises(HandoffError, match="one row per route"):
        vl.finalize_moe_output(bridge(), moe_output, p.residual, norm_weight=p.norm_weight)


def test_vllm_gemma_norm_module_sets_the_offset():
    p = ec.pieces(4, 4, 1, 0, route_major=True, gemma=True)
    moe_output = vllm_output(p, True, torch.bfloat16, True)
    norm = ew.engine_norm(ew.VLLM, "GemmaRMSNorm", p.norm_weight, ec.EPS)
    out = vl.finalize_moe_output(bridge(weight_bias=1.0), moe_output, p.residual, norm=norm)
    exact = ec.oracle(
        4, 4, 1, folded=True, w_dtype=torch.bfloat16, weight_bias=1.0, gemma=True, route_major=True
    )
    ec.check(out, exact)
    with pytest.raises(HandoffError, match=r"weight_bias must be 1.0 .*GemmaRMSNorm"):
        vl.finalize_moe_output(bridge(), moe_output, p.residual, norm=norm)
    with pytest.raises(HandoffError, match=r"spec.eps must be the norm's variance_epsilon"):
        norm.variance_epsilon = 1e-5
        vl.finalize_moe_output(bridge(weight_bias=1.0), moe_output, p.residual, norm=norm)


# ---------------------------------------------------------------- SGLang, world size 1
def flashinfer_buffers(p: ec.Pieces, w_dtype, t_buf: int):
    """FlashInfer's deferred output as SGLang wraps it: 1-D weight and index buffers for t_buf
    tokens (the weights carry the model's factor)."""
    cls = ew.sglang_classes()["FlashInferTrtllmDeferredFinalizeOutput"]
    weights = ec.handoff_weights(p, True, w_dtype).reshape(-1)
    return cls(p.gemm2, weights, p.perm.reshape(-1), ec.K)


@pytest.mark.parametrize("w_dtype", WEIGHT_DTYPES)
def test_sglang_deferred_finalize_from_flashinfer_buffers_longer_than_m(w_dtype):
    tokens, t_buf = 5, 9
    p = ec.pieces(tokens, t_buf, 2, 0)
    buffers = flashinfer_buffers(p, w_dtype, t_buf)
    inputs = (*(getattr(buffers, f) for f in sg.FLASHINFER_FIELDS[:3]), p.shared, p.residual)
    before = [t.clone() for t in (*inputs, p.norm_weight)]
    handoff = ew.sglang_from_flashinfer(buffers, gated_shared_output=p.shared, m=tokens)
    out = sg.finalize_deferred(bridge(), handoff, p.residual, norm_weight=p.norm_weight)
    exact = ec.oracle(tokens, t_buf, 2, folded=True, w_dtype=w_dtype, ranks=1)
    ec.check(out, exact)
    # SGLang's MoEOutput with the raw buffers: the same, its model factor not applied again
    moe_output = ew.sglang_classes()["MoEOutput"](buffers, p.shared, None, ec.FACTOR, False)
    out = sg.finalize_moe_output(bridge(), moe_output, p.residual, norm_weight=p.norm_weight)
    ec.check(out, exact)
    for a, b in zip(before, (*inputs, p.norm_weight)):  # never modified (gemm2_out's NaN rows too)
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def test_sglang_refuses_the_model_factor_a_short_buffer_and_a_finalized_output():
    p = ec.pieces(5, 9, 1, 0)
    buffers = flashinfer_buffers(p, torch.bfloat16, 9)
    handoff = ew.sglang_from_flashinfer(buffers, gated_shared_output=p.shared, m=5)
    with pytest.raises(HandoffError, match="a second time"):
        sg.finalize_deferred(bridge(ec.FACTOR), handoff, p.residual, norm_weight=p.norm_weight)
    moe_output = ew.sglang_classes()["MoEOutput"]
    short = type(buffers)(
        p.gemm2, buffers.expert_weights, buffers.expanded_idx_to_permuted_idx[:8], 4
    )
    with pytest.raises(
        HandoffError, match=r"length must be .*at least tokens \* top_k \(20\), got 8"
    ):
        sg.finalize_moe_output(
            bridge(), moe_output(short, p.shared, None, ec.FACTOR, False), p.residual,
            norm_weight=p.norm_weight,
        )  # fmt: skip
    with pytest.raises(HandoffError, match="finalized tensor"):
        sg.finalize_moe_output(
            bridge(), moe_output(p.shared, p.shared, None, ec.FACTOR, False), p.residual,
            norm_weight=p.norm_weight,
        )  # fmt: skip


def test_sglang_norms_the_module_its_applied_gamma_and_the_double_offset():
    p = ec.pieces(5, 5, 1, 0, gemma=True)
    handoff = ew.sglang_from_flashinfer(
        flashinfer_buffers(p, torch.float32, 5), gated_shared_output=p.shared, m=5
    )
    norm = ew.engine_norm(ew.SGLANG, "GemmaRMSNorm", p.norm_weight, ec.EPS)
    exact = ec.oracle(5, 5, 1, folded=True, w_dtype=torch.float32, weight_bias=1.0, gemma=True)
    ec.check(sg.finalize_deferred(bridge(weight_bias=1.0), handoff, p.residual, norm=norm), exact)
    # fused_norm_gamma(norm) is gemma_weight, 1 + w (rounded to bf16 once): the multiplier as is
    fused = norm.gemma_weight
    ec.check(sg.finalize_deferred(bridge(), handoff, p.residual, applied_gamma=fused), exact)
    with pytest.raises(HandoffError, match="apply the offset twice"):
        sg.finalize_deferred(bridge(weight_bias=1.0), handoff, p.residual, applied_gamma=fused)


# ---------------------------------------------------------------- the traps, for direct callers
class LookAlikeRMSNorm(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight, self.variance_epsilon = weight, ec.EPS


def test_norm_given_twice_not_at_all_or_as_an_unknown_class_is_refused():
    p = ec.pieces(4, 4, 1, 0, route_major=True)
    moe_output = vllm_output(p, True, torch.float32, True)
    rms = ew.engine_norm(ew.VLLM, "RMSNorm", p.norm_weight, ec.EPS)
    sub = type("MyRMSNorm", (type(rms),), {"__module__": "my_model.layers"})
    for kwargs, message in (
        (dict(norm=rms, norm_weight=p.norm_weight), r"exactly once.*2 of them \(norm, norm_weight"),
        ({}, r"exactly once.*0 of them \(none\)"),
        (dict(norm=LookAlikeRMSNorm(p.norm_weight)), "LookAlikeRMSNorm"),
        (dict(norm=sub()), "a subclass may compute another norm"),
        (dict(norm_weight=p.norm_weight.float()), r"cast the weight once at load time"),
    ):
        with pytest.raises(HandoffError, match=message):
            vl.finalize_moe_output(bridge(), moe_output, p.residual, **kwargs)
    out = vl.finalize_moe_output(bridge(), moe_output, p.residual, norm=rms)  # RMSNorm: offset 0
    ec.check(out, ec.oracle(4, 4, 1, folded=True, w_dtype=torch.float32, route_major=True))


def test_direct_callers_name_the_index_maps_direction_and_the_rows_layout():
    tokens, t_buf = 4, 6
    p = ec.pieces(tokens, t_buf, 1, 0)
    w = ec.handoff_weights(p, True, torch.float32)[:tokens]
    call = functools.partial(
        eh.finalize_handoff, bridge(), expert_weights=w, shared_output=p.shared,
        residual=p.residual, norm_weight=p.norm_weight, scale_to_apply=1.0,
        shared_replicated=False,
    )  # fmt: skip
    with pytest.raises(HandoffError, match="an ExpandedToPermuted .* got Tensor"):
        call(gemm2_out=p.gemm2, index_map=p.perm[:tokens])
    exact = ec.oracle(tokens, t_buf, 1, folded=True, w_dtype=torch.float32)
    flat_map = eh.ExpandedToPermuted.from_flat(p.perm.reshape(-1), tokens, ec.K)
    ec.check(call(gemm2_out=p.gemm2.reshape(-1), index_map=flat_map), exact)  # packed rows, 1-D
    padded = torch.nn.functional.pad(p.gemm2, (0, ec.H))  # [P, 2H]: as many elements as 2P rows
    with pytest.raises(HandoffError, match=r"gemm2_out\[:, :64\]\.contiguous\(\).*view\(-1, 64\)"):
        call(gemm2_out=padded, index_map=flat_map)
    ec.check(call(gemm2_out=padded[:, : ec.H].contiguous(), index_map=flat_map), exact)
    with pytest.raises(HandoffError, match=r"at least tokens \* top_k \(16\), got 12"):
        eh.ExpandedToPermuted.from_flat(p.perm.reshape(-1)[:12], tokens, ec.K)
    with pytest.raises(HandoffError, match="at least the handoff's token count 7"):
        eh.ExpandedToPermuted.from_2d(p.perm, 7)


# ---------------------------------------------------------------- 2 gloo ranks
def _two_ranks(rank: int, world: int) -> dict:
    """Every engine case at world size 2; returns {case: (residual_out error, norm_out error)}
    against the oracle, and the refusal of the replicated shared output without a shared slot."""
    results = {}
    spec = dict(hidden_size=ec.H, top_k=ec.K, eps=ec.EPS)
    with FusionBridge(EpilogueSpec(**spec), strategy="separate") as b:
        p = ec.pieces(6, 6, world, rank, route_major=True)
        out = vl.finalize_moe_output(
            b, vllm_output(p, True, torch.bfloat16, True), p.residual, norm_weight=p.norm_weight
        )
        exact = ec.oracle(6, 6, world, folded=True, w_dtype=torch.bfloat16, route_major=True)
        results["vllm route-major bf16"] = ec.errors(out, exact)
        p = ec.pieces(5, 8, world, rank)
        handoff = ew.sglang_from_flashinfer(
            flashinfer_buffers(p, torch.float32, 8), gated_shared_output=p.shared, m=5
        )
        out = sg.finalize_deferred(b, handoff, p.residual, norm_weight=p.norm_weight)
        exact = ec.oracle(5, 8, world, folded=True, w_dtype=torch.float32)
        results["sglang deferred fp32, m < buffers"] = ec.errors(out, exact)
        p = ec.pieces(5, 7, world, rank, replicated_shared=True)
        moe_output = ew.sglang_classes()["MoEOutput"](
            flashinfer_buffers(p, torch.bfloat16, 7), p.shared, None, ec.FACTOR, True
        )
        try:  # a spec that would sum the replicated output over the ranks: refused
            sg.finalize_moe_output(b, moe_output, p.residual, norm_weight=p.norm_weight)
        except HandoffError as exc:
            results["replicated refused"] = str(exc)
    replicated = EpilogueSpec(**spec, shared_output_replicated=True)
    with FusionBridge(replicated, strategy="separate") as b:
        out = sg.finalize_moe_output(b, moe_output, p.residual, norm_weight=p.norm_weight)
        exact = ec.oracle(5, 7, world, folded=True, w_dtype=torch.bfloat16, replicated_shared=True)
        results["sglang replicated shared"] = ec.errors(out, exact)
        # the bridge itself, called directly with the replicated output on every rank
        q = ec.pieces(5, 5, world, rank, replicated_shared=True)
        weights = ec.handoff_weights(q, True, torch.float32)
        gamma = q.norm_weight
        direct = b.finalize_epilogue(q.gemm2, q.perm, weights, q.shared, q.residual, gamma)
        exact = ec.oracle(5, 5, world, folded=True, w_dtype=torch.float32, replicated_shared=True)
        results["direct replicated shared"] = ec.errors(direct, exact)
    with FusionBridge(EpilogueSpec(**spec, has_shared_output=False), strategy="separate") as b:
        try:
            sg.finalize_moe_output(b, moe_output, p.residual, norm_weight=p.norm_weight)
        except EpilogueInputError as exc:  # the bridge's own refusal names no fix: the test says
            results["refused"] = str(exc)
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from fusion_bridge.cli.launch import run_distributed

    ew.sglang_classes(), ew.vllm_moe_output()  # skips here when a wheel cannot be had
    return once_per_run(
        tmp_path_factory,
        "engine_handoffs_two_ranks",
        lambda _: run_distributed(_two_ranks, 2, backend="gloo", timeout_s=240),
    )


@pytest.mark.parametrize(
    "case",
    [
        "vllm route-major bf16",
        "sglang deferred fp32, m < buffers",
        "sglang replicated shared",
        "direct replicated shared",
    ],
)
def test_two_gloo_ranks_match_the_oracle(two_ranks, case):
    for rank, results in enumerate(two_ranks):
        assert max(results[case]) < ec.BOUND, (rank, case, results[case])


def test_two_gloo_ranks_refuse_a_replicated_shared_output_without_its_slot(two_ranks):
    for results in two_ranks:
        assert "has_shared_output must be True for a replicated shared" in results["refused"]


def test_two_gloo_ranks_refuse_a_replicated_shared_output_the_spec_calls_a_partial(two_ranks):
    for results in two_ranks:
        message = results["replicated refused"]
        assert "spec.shared_output_replicated must be True" in message, message
        assert "shared_output_replicated=True" in message.split(";")[-1]


# ---------------------------------------------------------------- preallocated outputs
def test_the_adapters_write_into_out_and_refuse_one_over_the_residual():
    from fusion_bridge.epilogue_tensors import EpilogueOutputs, allocate_outputs

    tokens = 6
    p = ec.pieces(tokens, tokens, 2, 0)
    b = bridge()
    moe_output = vllm_output(p, True, torch.bfloat16, False)
    fresh = vl.finalize_moe_output(b, moe_output, p.residual, norm_weight=p.norm_weight)
    out = allocate_outputs(b.spec, tokens, torch.device("cpu"))
    got = vl.finalize_moe_output(b, moe_output, p.residual, norm_weight=p.norm_weight, out=out)
    assert got is out and torch.equal(out.norm_out, fresh.norm_out)
    hidden, residual = got  # the engines' order
    assert hidden is out.norm_out and residual is out.residual_out
    handoff = ew.sglang_from_flashinfer(
        flashinfer_buffers(p, torch.float32, tokens), gated_shared_output=p.shared, m=tokens
    )
    out = allocate_outputs(b.spec, tokens, torch.device("cpu"))
    got = sg.finalize_deferred(b, handoff, p.residual, norm_weight=p.norm_weight, out=out)
    assert got is out
    residual_before = p.residual.clone()
    over_residual = EpilogueOutputs(p.residual, out.norm_out)
    with pytest.raises(EpilogueInputError, match="out.residual_out.*overlapping residual"):
        sg.finalize_deferred(b, handoff, p.residual, norm_weight=p.norm_weight, out=over_residual)
    assert torch.equal(p.residual, residual_before)
