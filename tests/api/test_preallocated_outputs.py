"""finalize_epilogue(..., out=): preallocated outputs (issue 51). Every CPU strategy writes into
the caller's EpilogueOutputs and returns it, bit for bit what the same call without `out` gives
(world size 1 here and 2 gloo ranks); a wrong `out` is refused naming the field, what it must be
and what it is; an `out` sharing memory with an input (residual_out over residual) is refused and
the inputs stay untouched; a CUDA-graph capture with `out` replays into it (gpu).

And the unpacking convention: `norm_out, residual_out = outputs` (the engines' order, the reverse
of the field order), len 2 whatever the quant."""

import dataclasses

import pytest
import torch

from fusion_bridge import EpilogueSpec, FusionBridge, QuantSpec
from fusion_bridge.epilogue_tensors import EpilogueInputError, EpilogueOutputs, allocate_outputs
from fusion_bridge.oracle.synthetic import make_inputs
from tests.helpers import clone_inputs, cpu_strategy_names, inputs_equal

STRATEGIES = cpu_strategy_names()
QUANTS = {
    "none": QuantSpec.none(),
    "fp8": QuantSpec.fp8(0.02),
    "nvfp4_linear": QuantSpec.nvfp4(448.0, "linear"),
    "fp8_group_column_major_tma": QuantSpec.fp8_per_token_group(16, "column_major_tma"),
    "fp8_per_token": QuantSpec.fp8_per_token(),
}


def _sentinel_outputs(spec, tokens):
    """Outputs filled with values no call writes (NaN rows, 0x7F codes), so an unwritten field
    shows."""
    out = allocate_outputs(spec, tokens, torch.device("cpu"))
    out.residual_out.fill_(float("nan"))
    out.norm_out.fill_(float("nan"))
    if out.quant is not None:
        out.quant.view(torch.uint8).fill_(0x7F)
    if out.scale is not None:
        out.scale.fill_(0x7F)
        if out.scale.dtype == torch.float32 and out.scale.numel():  # the TMA padding too
            width = out.scale.stride(1)
            torch.as_strided(out.scale, (out.scale.shape[1], width), (width, 1)).fill_(0x7F)
    return out


def _same(a: EpilogueOutputs, b: EpilogueOutputs) -> bool:
    return all(
        (x is None and y is None)
        or (
            x is not None
            and y is not None
            and x.stride() == y.stride()
            and torch.equal(_bits(x), _bits(y))
        )
        for x, y in ((a.residual_out, b.residual_out), (a.norm_out, b.norm_out))
        + ((a.quant, b.quant), (a.scale, b.scale))
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes; a dynamic FP8 scale view (strided) by its whole storage, TMA padding included."""
    if t.dtype == torch.float32 and t.dim() == 2 and t.numel() and t.stride(1) != 1:
        width = t.stride(1)
        t = torch.as_strided(t, (t.shape[1], width), (width, 1))
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_writes_into_out_what_it_returns_without(name, quant):
    spec = EpilogueSpec(
        hidden_size=64, top_k=2, quant=QUANTS[quant], weight_bias=0.5, routed_scaling_factor=2.5
    )
    inp = make_inputs(spec, 5, seed=3)
    before = clone_inputs(inp)
    out = _sentinel_outputs(spec, 5)
    with FusionBridge(spec, strategy=name, self_test=False) as bridge:
        fresh = bridge(*inp)
        got = bridge(*inp, out=out)
    assert got is out
    assert _same(got, fresh), name
    assert inputs_equal(inp, before)


def test_zero_tokens_with_out_returns_out():
    spec = EpilogueSpec(hidden_size=64, top_k=2, quant=QuantSpec.fp8(1.0))
    inp = make_inputs(spec, 0, seed=1)
    out = allocate_outputs(spec, 0, torch.device("cpu"))
    with FusionBridge(spec) as bridge:
        assert bridge(*inp, out=out) is out


def _refusal(spec, inp, out) -> str:
    before = clone_inputs(inp)
    with FusionBridge(spec, strategy="separate", self_test=False) as bridge:
        with pytest.raises(EpilogueInputError) as info:
            bridge(*inp, out=out)
    assert inputs_equal(inp, before)
    return str(info.value)


SPEC = EpilogueSpec(hidden_size=64, top_k=2)
SPEC_FP8 = EpilogueSpec(hidden_size=64, top_k=2, quant=QuantSpec.fp8(0.5))


def test_a_wrong_out_is_refused_naming_field_expected_and_actual():
    inp = make_inputs(SPEC, 4, seed=2)
    good = allocate_outputs(SPEC, 4, torch.device("cpu"))
    msg = _refusal(SPEC, inp, dataclasses.replace(good, norm_out=good.norm_out.float()))
    assert "out.norm_out.dtype" in msg and "torch.bfloat16" in msg and "torch.float32" in msg
    msg = _refusal(
        SPEC, inp, dataclasses.replace(good, residual_out=torch.empty(5, 64, dtype=torch.bfloat16))
    )
    assert "out.residual_out.shape" in msg and "[4, 64]" in msg and "[5, 64]" in msg
    transposed = torch.empty(64, 4, dtype=torch.bfloat16).t()
    msg = _refusal(SPEC, inp, dataclasses.replace(good, norm_out=transposed))
    assert "out.norm_out must be contiguous" in msg
    msg = _refusal(SPEC, inp, (good.norm_out, good.residual_out))
    assert "out must be an EpilogueOutputs" in msg and "tuple" in msg
    fp8_inp = make_inputs(SPEC_FP8, 4, seed=2)
    msg = _refusal(SPEC_FP8, fp8_inp, good)  # the spec quantizes: out.quant is needed
    assert "out.quant" in msg and "float8_e4m3fn" in msg and "NoneType" in msg
    msg = _refusal(SPEC, inp, allocate_outputs(SPEC_FP8, 4, torch.device("cpu")))
    assert "out.quant must be None" in msg


def test_out_sharing_memory_with_an_input_or_itself_is_refused():
    inp = make_inputs(SPEC, 4, seed=2)
    good = allocate_outputs(SPEC, 4, torch.device("cpu"))
    msg = _refusal(SPEC, inp, dataclasses.replace(good, residual_out=inp.residual))
    assert "out.residual_out" in msg and "residual" in msg and "overlapping" in msg
    # a view into the middle of gemm2_out overlaps it too
    rows = inp.gemm2_out.view(-1)[64 : 64 + 4 * 64].view(4, 64)
    msg = _refusal(SPEC, inp, dataclasses.replace(good, norm_out=rows))
    assert "out.norm_out" in msg and "gemm2_out" in msg
    msg = _refusal(SPEC, inp, dataclasses.replace(good, norm_out=good.residual_out))
    assert "out.norm_out" in msg and "out.residual_out" in msg
    # adjacent halves of one buffer do not overlap: accepted
    both = torch.empty(2, 4, 64, dtype=torch.bfloat16)
    with FusionBridge(SPEC, strategy="separate", self_test=False) as bridge:
        bridge(*inp, out=EpilogueOutputs(both[0], both[1]))


def test_a_failing_call_leaves_the_inputs_alone_and_out_holds_no_result():
    inp = make_inputs(SPEC, 4, seed=2)
    bad = inp._replace(gamma=inp.gamma[:32].contiguous())
    out = _sentinel_outputs(SPEC, 4)
    with FusionBridge(SPEC, self_test=False) as bridge:
        with pytest.raises(EpilogueInputError, match="gamma"):
            bridge(*bad, out=out)
    assert out.norm_out.isnan().all()  # untouched: the call refused before any route ran


# ---------------------------------------------------------------- unpacking


@pytest.mark.parametrize("quant", list(QUANTS))
def test_outputs_unpack_as_norm_out_then_residual_out(quant):
    spec = EpilogueSpec(hidden_size=64, top_k=2, quant=QUANTS[quant])
    inp = make_inputs(spec, 3, seed=5)
    with FusionBridge(spec, strategy="separate", self_test=False) as bridge:
        outputs = bridge(*inp)
    norm_out, residual_out = outputs
    assert norm_out is outputs.norm_out and residual_out is outputs.residual_out
    assert len(outputs) == 2 and list(outputs) == [outputs.norm_out, outputs.residual_out]
    # the fields keep their order: residual_out first (by name, positionally and in named())
    fields = [f.name for f in dataclasses.fields(EpilogueOutputs)]
    assert fields[:2] == ["residual_out", "norm_out"]
    assert list(outputs.named())[:2] == ["residual_out", "norm_out"]
    assert EpilogueOutputs(norm_out, residual_out).residual_out is norm_out
    if quant != "none":
        assert outputs.quant is not None  # by name only


# ---------------------------------------------------------------- two gloo ranks


def _ranks_with_out(rank, world_size, name):
    from fusion_bridge.oracle.synthetic import make_inputs as make

    spec = EpilogueSpec(
        hidden_size=64, top_k=2, routed_scaling_factor=2.5, quant=QuantSpec.fp8(0.5)
    )
    inp = make(spec, 5, rank=rank, seed=7)
    out = allocate_outputs(spec, 5, torch.device("cpu"))
    with FusionBridge(spec, strategy=name, self_test=False) as bridge:
        fresh = bridge(*inp)
        got = bridge(*inp, out=out)
        try:
            bridge(*inp, out=EpilogueOutputs(inp.residual, out.norm_out, out.quant))
            refused = ""
        except EpilogueInputError as exc:
            refused = str(exc)
        again = bridge(*inp)  # the group is still in step after the refusal
    return got is out, _same(got, fresh), refused, torch.equal(again.norm_out, fresh.norm_out)


@pytest.mark.parametrize("name", cpu_strategy_names(2))
def test_out_over_two_gloo_ranks(name):
    from fusion_bridge.cli.launch import run_distributed

    results = run_distributed(_ranks_with_out, 2, name, backend="gloo", timeout_s=240)
    for is_out, same, refused, in_step in results:
        assert is_out and same and in_step
        assert "out.residual_out" in refused and "residual" in refused


# ---------------------------------------------------------------- CUDA graphs


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["none", "fp8"])
def test_out_under_a_cuda_graph_replays_into_the_callers_buffers(quant):
    device = torch.device("cuda")
    spec = EpilogueSpec(hidden_size=1024, top_k=8, quant=QUANTS[quant], max_tokens=64)
    inp = make_inputs(spec, 16, seed=1, device=device)
    out = allocate_outputs(spec, 16, device)
    with FusionBridge(spec, device=device) as bridge:
        # what the route a captured call takes computes (the eager plan may route elsewhere)
        name, variant = bridge.route_for(16)
        expected = bridge.run_strategy(name, inp, variant)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the capture
                bridge(*inp, out=out)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = bridge(*inp, out=out)
        assert got is out
        out.norm_out.fill_(float("nan"))
        out.residual_out.fill_(float("nan"))
        if out.quant is not None:
            out.quant.view(torch.uint8).fill_(0x7F)
        graph.replay()
        torch.cuda.synchronize()
    assert _same(out, expected)


def test_a_strategy_whose_run_takes_no_out_gets_its_outputs_copied_into_it():
    """A strategy written before `out=` (a third party's run(inputs, variant)): the bridge copies
    its outputs into the caller's `out` rather than failing or returning other tensors."""
    from fusion_bridge.call.out_check import run_into
    from fusion_bridge.environment import Environment
    from fusion_bridge.strategies.separate import SeparateStrategy

    class OldSignature(SeparateStrategy):
        def run(self, inputs, variant="default"):
            return super().run(inputs, variant)

    inp = make_inputs(SPEC, 4, seed=2)
    strategy = OldSignature(SPEC, Environment(world_size=1))
    out = _sentinel_outputs(SPEC, 4)
    got = run_into(strategy, inp, "default", out)
    assert got is out and _same(out, strategy.run(inp))


def test_a_route_whose_strategy_takes_no_out_gets_its_outputs_copied_by_the_bridge():
    """The bridge's own dispatch (its inline case of run_into): after calls through a strategy
    class whose run takes `out`, the route's strategy becomes one of a class whose run does not;
    its outputs are copied into `out` rather than `out=` passed to a run that takes none."""
    from fusion_bridge.strategies.separate import SeparateStrategy

    class OldSignature(SeparateStrategy):
        def run(self, inputs, variant="default"):
            return super().run(inputs, variant)

    inp = make_inputs(SPEC, 4, seed=2)
    with FusionBridge(SPEC, strategy="separate", self_test=False) as bridge:
        fresh = bridge(*inp)
        first = allocate_outputs(SPEC, 4, torch.device("cpu"))
        assert bridge(*inp, out=first) is first and _same(first, fresh)
        bridge._instances["separate"].__class__ = OldSignature  # the route's own instance
        out = _sentinel_outputs(SPEC, 4)
        got = bridge(*inp, out=out)
    assert got is out and _same(out, fresh)


def _debug_ranks(rank, world_size):
    spec = EpilogueSpec(hidden_size=64, top_k=2)
    inp = make_inputs(spec, 4, rank=rank, seed=9)
    out = allocate_outputs(spec, 4, torch.device("cpu"))
    bad = EpilogueOutputs(inp.residual, out.norm_out) if rank == 1 else out
    with FusionBridge(spec, strategy="separate", debug=True, self_test=False) as bridge:
        try:
            bridge(*inp, out=bad)
            first = "returned"
        except EpilogueInputError as exc:
            first = str(exc)
        fresh = bridge(*inp)
        again = bridge(*inp, out=out)  # the group is in step: the next call pairs correctly
    return first, again is out and torch.equal(again.norm_out, fresh.norm_out)


def test_debug_mode_refuses_one_ranks_bad_out_on_every_rank():
    from fusion_bridge.cli.launch import run_distributed

    (first0, ok0), (first1, ok1) = run_distributed(_debug_ranks, 2, backend="gloo", timeout_s=240)
    assert "out.residual_out" in first1 and "residual" in first1, first1
    assert first0 != "returned", first0  # debug mode: every rank raises together
    assert ok0 and ok1


def test_torch_compile_writes_the_ops_outputs_into_out():
    """Under torch.compile the call is one opaque op; its outputs are copied into `out` (a
    mutation of the caller's buffers the compiled graph keeps)."""
    spec = EpilogueSpec(hidden_size=64, top_k=2, quant=QuantSpec.fp8(0.05))
    inp = tuple(make_inputs(spec, 5, seed=4))
    out = _sentinel_outputs(spec, 5)
    with FusionBridge(spec, strategy="separate", self_test=False) as bridge:
        expected = bridge(*inp)

        def epilogue(*args):
            bridge.finalize_epilogue(*args, out=out)
            return out.norm_out * 1

        torch._dynamo.reset()
        torch.compile(epilogue, fullgraph=True, backend="aot_eager")(*inp)
        assert _same(out, expected)


@pytest.mark.parametrize("layout", ["row_major", "column_major", "column_major_tma"])
def test_a_dynamic_fp8_scale_must_be_the_layouts_own_view(layout):
    """out.scale of a per-token-group spec: exactly the view allocate_outputs hands out (the
    layout's strides); another layout's view, or the right values in a contiguous tensor where a
    column-major view is due, is refused naming the field, the strides expected and given."""
    spec = EpilogueSpec(hidden_size=64, top_k=2, quant=QuantSpec.fp8_per_token_group(16, layout))
    inp = make_inputs(spec, 5, seed=2)
    good = allocate_outputs(spec, 5, torch.device("cpu"))
    with FusionBridge(spec, strategy="separate", self_test=False) as bridge:
        assert bridge(*inp, out=good) is good
    others = [o for o in ("row_major", "column_major", "column_major_tma") if o != layout]
    for other in others:
        wrong = allocate_outputs(
            EpilogueSpec(**{**spec.__dict__, "quant": QuantSpec.fp8_per_token_group(16, other)}),
            5,
            torch.device("cpu"),
        ).scale
        msg = _refusal(spec, inp, dataclasses.replace(good, scale=wrong))
        assert "out.scale" in msg and layout in msg and str(wrong.stride()) in msg, msg
    msg = _refusal(
        spec, inp, dataclasses.replace(good, scale=torch.empty(5, 4, dtype=torch.bfloat16))
    )
    assert "out.scale.dtype" in msg and "torch.float32" in msg
