"""`fused_tp1` (world size 1, one launch) on one GPU: parity against the oracle over T in {1, 3, 16,
64, 129, 256, 1000, 4096}, H in {7168, 4096, 2880}, K in {1, 8}, none / fp8 / nvfp4 in both scale
layouts; residual_out bit for bit the two-launch path's; quant codes bit for bit on the kernel's own
norm_out; CUDA-graph replays on new inputs."""

import pytest
import torch

from fusion_bridge.kernels.tp1.configs import Tp1Config
from tests.kernels.test_tp1 import _launch_with, call_records, poisoned_outputs, whole_rows

pytestmark = pytest.mark.gpu
TOKENS = (1, 3, 16, 64, 129, 256, 1000, 4096)


def needs_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (on a GPU machine: `python -m pytest -m gpu`)")


def _strategy(spec, name="fused_tp1"):
    from fusion_bridge.environment import detect
    from fusion_bridge.registry import strategy_class

    dev = torch.device("cuda", 0)
    env = detect(device=dev)
    cls = strategy_class(name)
    assert cls.not_supported_reasons(spec, env) == []
    strat = cls(spec, env, None, dev)
    strat.prepare()
    return strat, env


def _problems(spec, strat, env, inp, out, tag):
    from fusion_bridge.oracle.numerics import rel_err
    from fusion_bridge.oracle.quant_ref import quantize_fp8, quantize_nvfp4
    from fusion_bridge.spec import QuantKind
    from fusion_bridge.strategies.reference import reference_epilogue

    found = []
    ref = reference_epilogue(spec, inp)  # the fp32 oracle, rounded once
    bound = strat.error_bound(spec, env)
    for name, got, want in (
        ("residual_out", out.residual_out, ref.residual_out),
        ("norm_out", out.norm_out, ref.norm_out),
    ):
        err = rel_err(got, want)
        if not (torch.isfinite(got).all() and err <= bound):
            found.append(f"{tag}: {name} rel err {err:.3g} > {bound:.3g}")
    if spec.quant.kind is QuantKind.FP8:
        want = quantize_fp8(out.norm_out, spec.quant.scale)
        if not torch.equal(out.quant.view(torch.uint8), want.view(torch.uint8)):
            found.append(f"{tag}: fp8 codes differ from the quantized norm_out")
    if spec.quant.kind is QuantKind.NVFP4:
        q, sf = quantize_nvfp4(out.norm_out, spec.quant.global_scale, spec.quant.sf_layout)
        if not (torch.equal(out.quant, q) and torch.equal(out.scale, sf)):
            found.append(f"{tag}: nvfp4 codes or scales differ from the quantized norm_out")
    return found


def _poison(out):
    """Every output of `out` (EpilogueOutputs) poisoned: NaN activations, 0xFF bytes."""
    for t in (out.residual_out, out.norm_out, out.quant, out.scale):
        if t is not None:
            t.view(torch.uint8).fill_(0xFF)


def _quant(name):
    from fusion_bridge.spec import QuantSpec, SFLayout

    return {
        "none": QuantSpec.none(),
        "fp8": QuantSpec.fp8(0.05),
        "nvfp4-swizzled": QuantSpec.nvfp4(448 * 6 / 8.0, SFLayout.SWIZZLED_128x4),
        "nvfp4-linear": QuantSpec.nvfp4(448 * 6 / 8.0, SFLayout.LINEAR),
    }[name]


QUANTS = ("none", "fp8", "nvfp4-swizzled", "nvfp4-linear")


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("top_k", (1, 8))
@pytest.mark.parametrize("hidden", (7168, 4096, 2880))
def test_fused_tp1_parity_grid(hidden, top_k, quant):
    """The strategy's default configs (split rows for small T, whole rows above; the launcher's own
    rule, `Tp1Launcher.config_for`: `_launch_with` reads it there)."""
    needs_gpu()
    from fusion_bridge.spec import EpilogueSpec
    from fusion_bridge.oracle.synthetic import make_inputs

    spec = EpilogueSpec(
        hidden_size=hidden,
        top_k=top_k,
        routed_scaling_factor=2.5,
        weight_bias=0.5,
        quant=_quant(quant),
        max_tokens=4096,
    )
    strat, env = _strategy(spec)
    two, _ = _strategy(spec, "local_fused_nccl")
    problems = []
    for tokens in TOKENS:
        inp = make_inputs(
            spec, tokens, seed=tokens + hidden + top_k, device="cuda", skip_fraction=0.2
        )
        out = _launch_with(strat, inp, None)  # the launcher's config for T, into poisoned outputs
        tag = f"H={hidden} K={top_k} {quant} T={tokens}"
        problems += _problems(spec, strat, env, inp, out, tag)
        if not torch.equal(out.residual_out, two.run(inp).residual_out):
            problems.append(f"{tag}: residual_out differs from the two-launch path's")
    assert not problems, "\n".join(problems[:30])


@pytest.mark.parametrize("quant", QUANTS)
def test_split_rows_match_whole_rows_at_every_chunk(quant):
    """Every split config that fits against whole rows on the same inputs: residual_out bit for bit,
    norm_out within one rounding (the sum of squares is added in another order), the quant codes
    those of the kernel's own norm_out; calls alternate chunk counts and T (the arrival counters
    of one chunk count must stay in step while other counts run)."""
    needs_gpu()
    from fusion_bridge.kernels.tp1 import launcher as L
    from fusion_bridge.spec import EpilogueSpec
    from fusion_bridge.oracle.synthetic import make_inputs

    spec = EpilogueSpec(hidden_size=7168, top_k=8, quant=_quant(quant), max_tokens=256)
    strat, env = _strategy(spec)
    problems = []
    for rep in range(3):
        for tokens in (1, 3, 16, 64):
            inp = make_inputs(spec, tokens, seed=rep * 100 + tokens, device="cuda")
            # both configs named (the default at small T is itself a split), outputs poisoned
            whole = _launch_with(strat, inp, whole_rows(spec))
            for chunk, warps in ((256, 2), (512, 4), (1024, 4), (2048, 8), (4096, 8)):
                config = Tp1Config(chunk, warps)
                if not L.split_ok(config, tokens, 7168, strat._launcher.num_sms):
                    continue
                got = _launch_with(strat, inp, config)
                tag = f"{quant} T={tokens} chunk={chunk} rep={rep}"
                problems += _problems(spec, strat, env, inp, got, tag)
                if not torch.equal(got.residual_out, whole.residual_out):
                    problems.append(f"{tag}: residual_out differs from whole rows")
                diff = (got.norm_out.float() - whole.norm_out.float()).abs()
                ulp = whole.norm_out.float().abs() * 2**-7 + 1e-30
                if not bool((diff <= ulp).all()):
                    problems.append(f"{tag}: norm_out more than one rounding from whole rows")
    assert not problems, "\n".join(problems[:30])


def test_fused_tp1_graph_replays_on_new_inputs():
    needs_gpu()
    from fusion_bridge.spec import EpilogueSpec, QuantSpec
    from fusion_bridge.oracle.synthetic import make_inputs

    problems = []
    for quant in (QuantSpec.none(), QuantSpec.nvfp4(336.0)):
        spec = EpilogueSpec(hidden_size=7168, top_k=8, quant=quant, max_tokens=256)
        strat, env = _strategy(spec)
        for tokens in (1, 129):
            static = make_inputs(spec, tokens, seed=1, device="cuda")
            strat.run(static)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                got = strat.run(static)
            for seed in (2, 3, 4):
                fresh = make_inputs(spec, tokens, seed=seed, device="cuda")
                for dst, src in zip(static, fresh):
                    if dst is not None:
                        dst.copy_(src)
                _poison(got)  # the replay must rewrite every output
                graph.replay()
                torch.cuda.synchronize()
                tag = f"graph {quant.kind.value} T={tokens} replay seed {seed}"
                problems += _problems(spec, strat, env, fresh, got, tag)
    assert not problems, "\n".join(problems)


def test_split_rows_in_one_graph_and_on_two_streams():
    """One CUDA graph holding calls of several T (chunk counts 14, 7 and 2 at H=7168) replayed on
    fresh inputs: the arrival counters and tags carry over replays with no reset. Then two streams
    calling at once: each stream has its own set of words, so neither reads the other's sums."""
    needs_gpu()
    from fusion_bridge.spec import EpilogueSpec, QuantSpec
    from fusion_bridge.oracle.synthetic import make_inputs

    spec = EpilogueSpec(hidden_size=7168, top_k=8, quant=QuantSpec.fp8(0.05), max_tokens=64)
    strat, env = _strategy(spec)
    statics = {t: make_inputs(spec, t, seed=t, device="cuda") for t in (1, 3, 64)}
    for inp in statics.values():
        strat.run(inp)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = {t: strat.run(inp) for t, inp in statics.items()}
    problems = []
    for seed in (11, 12, 13):
        fresh = {t: make_inputs(spec, t, seed=seed + t, device="cuda") for t in statics}
        for t, inp in fresh.items():
            for dst, src in zip(statics[t], inp):
                if dst is not None:
                    dst.copy_(src)
        for out in outs.values():
            _poison(out)  # the replay must rewrite every output
        graph.replay()
        torch.cuda.synchronize()
        for t in statics:
            problems += _problems(spec, strat, env, fresh[t], outs[t], f"graph T={t} seed {seed}")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    inputs = [make_inputs(spec, 16, seed=40 + i, device="cuda") for i in range(2)]
    got = [None, None]
    torch.cuda.synchronize()
    for _ in range(20):
        for i, stream in enumerate(streams):
            with torch.cuda.stream(stream):  # the strategy's launch, into poisoned outputs
                got[i] = poisoned_outputs(spec, 16, "cuda")  # fp8: codes, no scales
                strat._launcher(*call_records(inputs[i], got[i], strat._unused))
    torch.cuda.synchronize()
    for i in range(2):
        problems += _problems(spec, strat, env, inputs[i], got[i], f"stream {i}")
    assert len(strat._launcher._sync) >= 3  # the graph's capture stream and the two streams
    assert not problems, "\n".join(problems)


def test_graphs_of_one_layer_share_words_zeroed_before_any_capture():
    """Serving engines capture one graph per batch size and replay whichever fits, in any order.
    Every capture uses the set of words the strategy zeroed when it was prepared (a set allocated
    during a capture would be zeroed only by the graph that captured it), so a graph captured
    later can replay first."""
    needs_gpu()
    from fusion_bridge.kernels.tp1.launcher import GRAPH_WORDS
    from fusion_bridge.spec import EpilogueSpec
    from fusion_bridge.oracle.synthetic import make_inputs

    spec = EpilogueSpec(hidden_size=7168, top_k=8, max_tokens=64)
    strat, env = _strategy(spec)
    words = strat._launcher._sync[GRAPH_WORDS]
    assert words.count_nonzero().item() == 0
    statics = {t: make_inputs(spec, t, seed=t, device="cuda") for t in (1, 3, 16)}
    for inp in statics.values():
        strat.run(inp)  # compile outside the captures
    torch.cuda.synchronize()
    graphs, outs = {}, {}
    for t, inp in statics.items():
        graphs[t] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[t]):
            assert strat._launcher.sync_words() is words
            outs[t] = strat.run(inp)
    problems = []
    for round_, order in enumerate(((16, 3, 1), (1, 16, 3), (3, 1, 16))):
        for t in order:  # the last captured first
            fresh = make_inputs(spec, t, seed=100 * round_ + t, device="cuda")
            for dst, src in zip(statics[t], fresh):
                if dst is not None:
                    dst.copy_(src)
            graphs[t].replay()
            torch.cuda.synchronize()
            problems += _problems(spec, strat, env, fresh, outs[t], f"graph T={t} round {round_}")
    assert not problems, "\n".join(problems)


def test_fp8_division_through_one_reciprocal_is_exact():
    """`quant._div_by_scale` (fp8 through one reciprocal, as `fused_tp1` quantizes on a GPU)
    against torch's correctly rounded division, over every bf16 value (norm_out is bf16) and
    scales across `recip_ok`'s range: the quotient bit for bit wherever it is a normal float up to
    2^64 and |y| >= 2^-102 (the remainder exact), and the e4m3 code (saturated at 448, as the
    kernels store it) everywhere."""
    needs_gpu()
    import triton
    import triton.language as tl

    from fusion_bridge.kernels.quant import _div_by_scale, recip_ok

    @triton.jit
    def divide(y_ptr, out_ptr, scale, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        y = tl.load(y_ptr + offs, mask=offs < n)
        tl.store(out_ptr + offs, _div_by_scale(y, scale), mask=offs < n)

    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32, device="cuda").to(torch.int16)
    y = bits.view(torch.bfloat16).float()
    scales = [0.05, 1 / 3, 448 * 6 / 8.0, 1e-6, 3.0e5, 2.0**-90, 2.0**126, 1.2345678e-20]
    scales += torch.empty(8).uniform_(-30, 30).exp2().tolist()
    problems = []
    for scale in scales:
        scale = float(torch.tensor(scale, dtype=torch.float32))
        assert recip_ok(scale)
        got = torch.empty_like(y)
        divide[(triton.cdiv(y.numel(), 1024),)](y, got, scale, y.numel(), BLOCK=1024)
        want = y / torch.tensor(scale, dtype=torch.float32, device="cuda")
        normal = (want.abs() >= 2.0**-126) & (want.abs() <= 2.0**64) & (y.abs() >= 2.0**-102)
        exact = normal | (y == 0) | y.isinf()
        same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
        if not bool(same[exact].all()):
            problems.append(f"scale {scale}: {int((~same & exact).sum())} quotients differ")
        codes = [q.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8) for q in (got, want)]
        finite = ~want.isnan()
        if not torch.equal(codes[0][finite], codes[1][finite]):
            problems.append(f"scale {scale}: e4m3 codes differ")
    assert not problems, "\n".join(problems)


def test_nvfp4_block_scale_by_the_gpu_conversion_is_exact():
    """`quant._block_scale_hw` (the world-size-1 kernels' NVFP4 block scale on a GPU: the GPU's
    e4m3 conversion of v = global_scale * (amax * fp32(1/6))) against the software form the other
    kernels use (`_e4m3_rne_satfinite(v)`), code and value bit for bit, for v = every e4m3
    value, every midpoint between two of them (the ties) and one fp32 step either side, and random
    fp32 over the whole range, 0, subnormals, inf and NaN."""
    needs_gpu()
    import triton
    import triton.language as tl

    from fusion_bridge.kernels.quant import _block_scale_hw, _e4m3_rne_satfinite

    @triton.jit
    def both(v_ptr, code_ptr, value_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(v_ptr + offs, mask=offs < n)
        hw_code, hw_value = _block_scale_hw(v)
        sw_code, sw_value = _e4m3_rne_satfinite(v)
        tl.store(code_ptr + offs, hw_code, mask=offs < n)
        tl.store(code_ptr + n + offs, sw_code, mask=offs < n)
        tl.store(value_ptr + offs, hw_value, mask=offs < n)
        tl.store(value_ptr + n + offs, sw_value, mask=offs < n)

    grid = torch.arange(0, 127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    grid = grid.float().cuda()
    points = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([448.0 + 16.0]).cuda()])
    v = torch.cat(
        [
            points,
            torch.nextafter(points, torch.zeros_like(points)),
            torch.nextafter(points, points + 1e30),
        ]
    )
    bits = torch.randint(0, 0x7F800000, (1 << 16,), dtype=torch.int32, device="cuda")
    special = torch.tensor([0.0, 1e-45, 1e-40, 2.0**-126, float("inf"), float("nan")]).cuda()
    v = torch.cat([v, bits.view(torch.float32), special])
    n = v.numel()
    codes = torch.full((2 * n,), -1, dtype=torch.int32, device="cuda")
    values = torch.full((2 * n,), -1.0, device="cuda")
    both[(triton.cdiv(n, 1024),)](v, codes, values, n, BLOCK=1024)
    hw, sw = codes[:n], codes[n:]
    nan = torch.isnan(v)
    # a finite or infinite v saturates to a finite scale (0x7E at most); NaN stays e4m3's NaN
    assert (sw[~nan] >= 0).all() and (sw[~nan] <= 0x7E).all()
    assert (sw[nan] == 0x7F).all() and (hw[nan] == 0x7F).all()
    same_value = values[:n].view(torch.int32) == values[n:].view(torch.int32)
    same_value |= torch.isnan(values[:n]) & torch.isnan(values[n:])  # a NaN's bits: any NaN
    bad = (hw != sw) | ~same_value
    assert not bad.any(), [
        (float(v[i]), int(hw[i]), int(sw[i]), float(values[i]), float(values[n + i]))
        for i in bad.nonzero().flatten()[:5].tolist()
    ]
