"""The ring two-shot kernel (`kernels/symm_ring.py`) with W ranks emulated on ONE GPU: each rank's
buffer its own allocation, each rank's launch on its own CUDA stream with SMs / W programs per SM
share, so every program of every rank is resident at once and the ranks really wait for each other.

Checks what the interpreter cannot: the compiled kernel, its release counters and acquire/release
ordering under real concurrency, the ring reused many times within one call (T up to 16384 with
256-token chunks and 4 slots), the chunk base carried across calls in device state, CUDA graphs
replayed between eager calls, bitwise identity across ranks, and a rank that skips a call (NaN and
the error word on the others, no hang). Not the NVLink test (peers here share one L2) and times
nothing. W >= 2 needs the GPU to itself (under pytest-xdist those cases skip):
`python -m pytest -n 0 tests/test_gpu_symm_ring_one_device.py`.
"""

import math
import os
import random

import pytest
import torch

from tests.test_gpu_symm_one_device import _problems, needs_gpu

pytestmark = pytest.mark.gpu
U_BF16 = 2.0**-8


# Emulated ranks need every program of every rank resident at once (each rank's programs wait for
# the others'): a pytest-xdist worker beside them would occupy SMs with its own kernels and a rank
# would time out on a peer that never got an SM (seen on the H200 with -n 12). So W >= 2 runs only
# in a pytest process that has the GPU to itself: `python -m pytest -n 0 <this file>`.
def _needs_gpu_alone(world):
    if world > 1 and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        pytest.skip("emulated ranks need the GPU to themselves: run this file with -n 0")


_KEEP: list = []  # the emulated groups' buffers, alive for the whole module
# the partial's rounding, residual_out's (the norm reads it) and norm_out's, in quadrature
BOUND = math.sqrt(3) * U_BF16


def _call(layers, streams, spec, inputs, skip_rank=None):
    """One epilogue call on every emulated rank (each on its own stream); outputs poisoned first."""
    from fusion_bridge.epilogue_tensors import quant_buffers
    from fusion_bridge.kernels import symm_ring
    from fusion_bridge.kernels.symm_testing import call_tensors

    outs = []
    main = torch.cuda.current_stream()
    for rank, (layer, stream, inp) in enumerate(zip(layers, streams, inputs)):
        tokens, hidden = inp.residual.shape
        ro = torch.full_like(inp.residual, float("nan"))
        no = torch.full_like(inp.residual, float("nan"))
        q, sf = quant_buffers(
            tokens, hidden, spec.quant.kind, spec.quant.sf_layout, inp.residual.device
        )
        empty = torch.empty(0, dtype=torch.uint8, device=inp.residual.device)
        q = empty if q is None else q.view(torch.uint8)
        sf = empty if sf is None else sf
        for t in (q, sf):
            t.fill_(0xFF)
        outs.append((ro, no, q, sf))
        if rank == skip_rank:
            continue
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            symm_ring.launch(layer, **call_tensors(inp, (ro, no, q, sf)))
    for stream in streams:
        main.wait_stream(stream)
    return outs


def _quant_problems(spec, outs, tag):
    """Rank 0's codes are the torch reference's quantization of its own norm_out, bit for bit."""
    from fusion_bridge import quant_ref
    from fusion_bridge.spec import QuantKind

    _, norm_out, q, sf = outs[0]
    kind = spec.quant.kind
    if kind == QuantKind.FP8:
        ref = quant_ref.quantize_fp8(norm_out, spec.quant.scale).view(torch.uint8)
        return [] if torch.equal(q, ref) else [f"{tag}: fp8 codes differ from the reference"]
    if kind == QuantKind.NVFP4:
        ref_q, ref_sf = quant_ref.quantize_nvfp4(
            norm_out, spec.quant.global_scale, spec.quant.sf_layout
        )
        same = torch.equal(q, ref_q.view(torch.uint8)) and torch.equal(sf, ref_sf.view(torch.uint8))
        return [] if same else [f"{tag}: nvfp4 codes/scales differ from the reference"]
    return []


def _setup(world, spec, timeout_s=10.0):
    """W ranks' layers for `spec` (its hidden size, scalars and quantization) and their pinned
    error words, one stream each."""
    from fusion_bridge.kernels.symm_testing import ring_layers_on_one_gpu

    _needs_gpu_alone(world)
    group = ring_layers_on_one_gpu(world, spec.hidden_size, spec, timeout_s=timeout_s)
    _KEEP.append(group)  # the layers hold raw pointers into its buffers
    return group.layers, group.errs, [torch.cuda.Stream() for _ in range(world)]


def _inputs(spec, tokens, world, seed):
    from fusion_bridge.synthetic import make_inputs

    return [
        make_inputs(spec, tokens, rank=r, seed=seed, device="cuda", skip_fraction=0.2)
        for r in range(world)
    ]


QUANTS = ("none", "fp8", "nvfp4_swizzled", "nvfp4_linear")


def _quant_spec(name):
    from fusion_bridge.spec import QuantSpec, SFLayout

    return {
        "none": QuantSpec.none(),
        "fp8": QuantSpec.fp8(0.05),
        "nvfp4_swizzled": QuantSpec.nvfp4(448 * 6 / 8.0, SFLayout.SWIZZLED_128x4),
        "nvfp4_linear": QuantSpec.nvfp4(448 * 6 / 8.0, SFLayout.LINEAR),
    }[name]


@pytest.mark.parametrize(
    "world",
    [1, 2, 4, 8],
    ids=lambda w: f"W{w}",
)  # fmt: skip
@pytest.mark.parametrize("hidden,top_k", [(7168, 8), (2880, 1)], ids=["H7168K8", "H2880K1"])
@pytest.mark.parametrize("quant", QUANTS)
def test_ring_parity_and_identity_on_emulated_ranks(world, hidden, top_k, quant):
    """One ring through T = 1, 3, 255, 257 (chunk edges), 1000, 4096: the base carries over."""
    needs_gpu()
    from fusion_bridge.spec import EpilogueSpec

    spec = EpilogueSpec(
        hidden_size=hidden, top_k=top_k, routed_scaling_factor=2.5, weight_bias=0.5,
        quant=_quant_spec(quant),
    )  # fmt: skip
    layers, errs, streams = _setup(world, spec)
    problems = []
    for tokens in (1, 3, 255, 257, 1000, 4096):
        inputs = _inputs(spec, tokens, world, seed=tokens + hidden + world)
        outs = _call(layers, streams, spec, inputs)
        tag = f"W={world} H={hidden} K={top_k} {quant} T={tokens}"
        problems += _problems(spec, outs, inputs, BOUND, tag)
        if tokens <= 1000:
            problems += _quant_problems(spec, outs, tag)
    torch.cuda.synchronize()
    assert [int(e[0]) for e in errs] == [0] * world, [hex(int(e[0])) for e in errs]
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("world", [1, 8], ids=lambda w: f"W{w}")
def test_ring_t16384_turns_the_ring_within_one_call(world):
    """4 slots of 256 tokens: T = 16384 turns the ring 16 times in one call."""
    needs_gpu()
    from fusion_bridge.spec import EpilogueSpec

    spec = EpilogueSpec(hidden_size=4096, top_k=8, routed_scaling_factor=2.5)
    layers, errs, streams = _setup(world, spec)
    inputs = _inputs(spec, 16384, world, seed=5)
    problems = _problems(spec, _call(layers, streams, spec, inputs), inputs, BOUND, "T=16384")
    torch.cuda.synchronize()
    assert [int(e[0]) for e in errs] == [0] * world
    assert not problems, "\n".join(problems[:20])


def test_ring_stress_graphs_and_eager_at_random_t():
    """Random T (the same on every rank), CUDA-graph replays of three captured T mixed with eager
    calls of others, through one ring: the chunk base and the release counters stay in step."""
    needs_gpu()
    from fusion_bridge.spec import EpilogueSpec

    world = 4
    spec = EpilogueSpec(hidden_size=4096, top_k=8)
    wss, errs, streams = _setup(world, spec)
    problems = []
    graphs = {}
    for tokens in (5, 1024, 3000):
        static = _inputs(spec, tokens, world, seed=1)
        _call(wss, streams, spec, static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = _call(wss, streams, spec, static)
        graphs[tokens] = (graph, static, got)
    rng = random.Random(11)
    pool = {t: _inputs(spec, t, world, seed=t) for t in (1, 2, 255, 256, 257, 700, 1300, 5000)}
    for call in range(400):
        if rng.random() < 0.5:
            tokens = rng.choice(list(graphs))
            graph, static, got = graphs[tokens]
            for o in got:
                o[0].fill_(float("nan"))
                o[1].fill_(float("nan"))
            graph.replay()
            if call % 40 == 0:
                problems += _problems(spec, got, static, BOUND, f"call {call} graph T={tokens}")
        else:
            tokens = rng.choice(list(pool))
            outs = _call(wss, streams, spec, pool[tokens])
            if call % 40 == 1:
                problems += _problems(spec, outs, pool[tokens], BOUND, f"call {call} T={tokens}")
    torch.cuda.synchronize()
    assert [int(e[0]) for e in errs] == [0] * world
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("world,skip", [(2, 1), (4, 0)])
def test_ring_a_rank_that_skips_a_call_gives_nan_and_the_error_word(world, skip):
    needs_gpu()
    from fusion_bridge.kernels.symm_protocol import ERR_ABORTED, ERR_TIMEOUT
    from fusion_bridge.spec import EpilogueSpec

    spec = EpilogueSpec(hidden_size=4096, top_k=8)
    wss, errs, streams = _setup(world, spec, timeout_s=1.0)
    first = _inputs(spec, 600, world, seed=1)
    assert not _problems(spec, _call(wss, streams, spec, first), first, BOUND, "before the skip")
    torch.cuda.synchronize()
    outs = _call(wss, streams, spec, _inputs(spec, 1500, world, seed=2), skip_rank=skip)
    torch.cuda.synchronize()  # returns: every wait is bounded
    for rank in range(world):
        if rank == skip:
            continue
        ro, no, _, _ = outs[rank]
        err = int(errs[rank][0])
        assert err & (int(ERR_TIMEOUT) | int(ERR_ABORTED)), (rank, hex(err))
        assert torch.isnan(ro).any() and torch.isnan(no).any(), rank
        if err & int(ERR_TIMEOUT) and not err & int(ERR_ABORTED):
            assert err & (1 << skip), (rank, hex(err))  # names the rank that never came
