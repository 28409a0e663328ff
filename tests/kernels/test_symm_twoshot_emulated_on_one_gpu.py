"""The two-shot (`kernels/symm/twoshot.py`) with W ranks emulated on ONE GPU: each
rank's buffer its own allocation, every rank's launches in one global order on one stream
(`symm_testing_twoshot.twoshot_call`: chunk by chunk and stage by stage, the syncs split into their
signal and wait halves), so every wait is for a launch made before it. At W = 1 the production
launch runs (F on two side streams, the merged sync launches, the L2 hints and row drops).

Checks what the interpreter cannot: the compiled kernels, their release counters and arrival /
reduced flags on the GPU (rows read with plain loads after the sync launch, then dropped from
L2), the slots reused many times within one call (T up to 16384), the chunk base carried across
calls in device state, CUDA graphs replayed between eager calls, bitwise identity across ranks,
and a rank that skips a call (NaN and the error word on the others, no hang). Not the NVLink test
(peers here share one L2) and times nothing. Run alone: `python -m pytest -n 0 <this file>`.
"""

import math
import os
import random

import pytest
import torch

from tests.kernels.test_symm_oneshot_emulated_on_one_gpu import _problems, needs_gpu

pytestmark = pytest.mark.gpu
U_BF16 = 2.0**-8
# the partial's rounding, residual_out's (the norm reads it) and norm_out's, in quadrature
BOUND = math.sqrt(3) * U_BF16
_KEEP: list = []  # the emulated groups' buffers, alive for the whole module


# Emulated ranks need every program of every rank resident at once (each rank's programs wait for
# the others'): a pytest-xdist worker beside them would occupy SMs with its own kernels and a rank
# would time out on a peer that never got an SM. So W >= 2 runs only in a pytest process that has
# the GPU to itself: `python -m pytest -n 0 <this file>`.
def _needs_gpu_alone(world):
    if world > 1 and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        pytest.skip("emulated ranks need the GPU to themselves: run this file with -n 0")


def _quant_problems(spec, outs, tag):
    """Rank 0's codes are the torch reference's quantization of its own norm_out, bit for bit."""
    from fusion_bridge.oracle import quant_ref
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


def _quant_spec(name):
    from fusion_bridge.spec import QuantSpec, SFLayout

    return {
        "none": QuantSpec.none(),
        "fp8": QuantSpec.fp8(0.05),
        "nvfp4_swizzled": QuantSpec.nvfp4(448 * 6 / 8.0, SFLayout.SWIZZLED_128x4),
        "nvfp4_linear": QuantSpec.nvfp4(448 * 6 / 8.0, SFLayout.LINEAR),
    }[name]


def _setup(world, spec, timeout_s=10.0, config=None):
    """W ranks' layers, their buffers laid out for `config` (None: the default)."""
    from fusion_bridge.testing.symm_twoshot_rig import twoshot_layers_on_one_gpu

    _needs_gpu_alone(world)
    group = twoshot_layers_on_one_gpu(world, spec.hidden_size, spec, timeout_s, config=config)
    _KEEP.append(group)  # the layers hold raw pointers into its buffers
    return group.layers, group.errs


def _inputs(spec, tokens, world, seed):
    from fusion_bridge.oracle.synthetic import make_inputs

    return [
        make_inputs(spec, tokens, rank=r, seed=seed, device="cuda", skip_fraction=0.2)
        for r in range(world)
    ]


def _outputs(spec, inp):
    from fusion_bridge.epilogue_tensors import quant_buffers

    tokens, hidden = inp.residual.shape
    ro = torch.full_like(inp.residual, float("nan"))
    no = torch.full_like(inp.residual, float("nan"))
    q, sf = quant_buffers(tokens, hidden, spec.quant.kind, spec.quant.sf_layout, "cuda")
    empty = torch.empty(0, dtype=torch.uint8, device="cuda")
    q = empty if q is None else q.view(torch.uint8)
    sf = empty if sf is None else sf
    q.fill_(0xFF)
    sf.fill_(0xFF)
    return ro, no, q, sf


def _call(layers, spec, inputs, config=None, skip_rank=None, outs=None):
    """One call on every emulated rank (W = 1: the production launch, two streams); outputs
    poisoned first (or reused: graph capture)."""
    from fusion_bridge.kernels.symm import twoshot as symm_twoshot
    from fusion_bridge.testing.symm_oneshot_rig import call_records
    from fusion_bridge.testing.symm_twoshot_rig import twoshot_call

    outs = outs or [_outputs(spec, inp) for inp in inputs]
    per_rank = [call_records(inp, out) for inp, out in zip(inputs, outs)]
    if len(layers) == 1:
        symm_twoshot.TwoshotLauncher(layers[0])(*per_rank[0], config)
    else:
        twoshot_call(layers, per_rank, config=config, skip_rank=skip_rank)
    return outs


@pytest.mark.parametrize("world", [1, 2, 4, 8], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("hidden,top_k", [(7168, 8), (2880, 1)], ids=["H7168K8", "H2880K1"])
@pytest.mark.parametrize("quant", ("none", "fp8", "nvfp4_swizzled", "nvfp4_linear"))
def test_twoshot_parity_and_identity_on_emulated_ranks(world, hidden, top_k, quant):
    """One workspace through T = 1, 3, 1023, 1025 (chunk edges), 4096 (the 2 slots turned twice):
    the base carries over."""
    needs_gpu()
    from fusion_bridge.spec import EpilogueSpec

    spec = EpilogueSpec(
        hidden_size=hidden, top_k=top_k, routed_scaling_factor=2.5, weight_bias=0.5,
        quant=_quant_spec(quant),
    )  # fmt: skip
    layers, errs = _setup(world, spec)
    problems = []
    for tokens in (1, 3, 1023, 1025, 4096):
        inputs = _inputs(spec, tokens, world, seed=tokens + hidden + world)
        outs = _call(layers, spec, inputs)
        tag = f"W={world} H={hidden} K={top_k} {quant} T={tokens}"
        problems += _problems(spec, outs, inputs, BOUND, tag)
        if tokens <= 1025:
            problems += _quant_problems(spec, outs, tag)
    torch.cuda.synchronize()
    assert [int(e[0]) for e in errs] == [0] * world, [hex(int(e[0])) for e in errs]
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("world", [1, 2, 8], ids=lambda w: f"W{w}")
@pytest.mark.parametrize(
    "fields",
    [
        dict(chunk=512, slots=4),
        dict(chunk=256, slots=4),
        dict(chunk=512, slots=3),
        dict(pdl=False),
    ],
    ids=["c512_s4", "c256_s4", "c512_s3", "pdl_off"],
)
def test_twoshot_other_shapes(world, fields):
    """The other launch shapes TwoshotConfig allows, each on buffers laid out for it: 4 slots of
    512 or 256 tokens, 3 slots, PDL off; T = 1, 700, 5000. (The benchmark's ablations, no L2
    hints, one finalize stream, other warps, are checked by benchmarks/twoshot_local.py against
    our standalone kernels before it times them.)"""
    needs_gpu()
    from fusion_bridge.kernels.symm.twoshot import TwoshotConfig
    from fusion_bridge.spec import EpilogueSpec

    config = TwoshotConfig(**fields)
    spec = EpilogueSpec(hidden_size=7168, top_k=8, routed_scaling_factor=2.5, weight_bias=0.5)
    layers, errs = _setup(world, spec, config=config)
    problems = []
    for tokens in (1, 700, 5000):
        inputs = _inputs(spec, tokens, world, seed=tokens + world)
        outs = _call(layers, spec, inputs, config=config)
        problems += _problems(spec, outs, inputs, BOUND, f"{fields} W={world} T={tokens}")
    torch.cuda.synchronize()
    assert [int(e[0]) for e in errs] == [0] * world, [hex(int(e[0])) for e in errs]
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("world", [1, 8], ids=lambda w: f"W{w}")
def test_twoshot_t16384_turns_the_ring_within_one_call(world):
    """2 slots of 1024 tokens: T = 16384 turns them 8 times in one call."""
    needs_gpu()
    from fusion_bridge.spec import EpilogueSpec

    spec = EpilogueSpec(hidden_size=4096, top_k=8, routed_scaling_factor=2.5)
    layers, errs = _setup(world, spec)
    inputs = _inputs(spec, 16384, world, seed=5)
    problems = _problems(spec, _call(layers, spec, inputs), inputs, BOUND, "T=16384")
    torch.cuda.synchronize()
    assert [int(e[0]) for e in errs] == [0] * world
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("world", [1, 4], ids=lambda w: f"W{w}")
def test_twoshot_stress_graphs_and_eager_at_random_t(world):
    """Random T (the same on every rank), CUDA-graph replays of three captured T mixed with eager
    calls of others, through one workspace: the chunk base and the release counters stay in step.
    W = 1: the production launch's side-stream fork and join inside the capture."""
    needs_gpu()
    from fusion_bridge.spec import EpilogueSpec

    spec = EpilogueSpec(hidden_size=4096, top_k=8)
    layers, errs = _setup(world, spec)
    problems = []
    graphs = {}
    for tokens in (5, 1024, 3000):
        static = _inputs(spec, tokens, world, seed=1)
        got = _call(layers, spec, static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _call(layers, spec, static, outs=got)
        graphs[tokens] = (graph, static, got)
    rng = random.Random(11)
    pool = {t: _inputs(spec, t, world, seed=t) for t in (1, 2, 255, 1023, 1024, 1025, 1300, 5000)}
    for call in range(300):
        if rng.random() < 0.5:
            tokens = rng.choice(list(graphs))
            graph, static, got = graphs[tokens]
            for o in got:
                o[0].fill_(float("nan"))
                o[1].fill_(float("nan"))
            graph.replay()
            if call % 30 == 0:
                problems += _problems(spec, got, static, BOUND, f"call {call} graph T={tokens}")
        else:
            tokens = rng.choice(list(pool))
            outs = _call(layers, spec, pool[tokens])
            if call % 30 == 1:
                problems += _problems(spec, outs, pool[tokens], BOUND, f"call {call} T={tokens}")
    torch.cuda.synchronize()
    assert [int(e[0]) for e in errs] == [0] * world
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("world,skip", [(2, 1), (4, 0)])
def test_twoshot_a_rank_that_skips_a_call_gives_nan_and_the_error_word(world, skip):
    needs_gpu()
    from fusion_bridge.kernels.symm.protocol import ERR_ABORTED, ERR_TIMEOUT
    from fusion_bridge.spec import EpilogueSpec

    spec = EpilogueSpec(hidden_size=4096, top_k=8)
    layers, errs = _setup(world, spec, timeout_s=0.2)
    first = _inputs(spec, 600, world, seed=1)
    assert not _problems(spec, _call(layers, spec, first), first, BOUND, "before the skip")
    torch.cuda.synchronize()
    outs = _call(layers, spec, _inputs(spec, 1500, world, seed=2), skip_rank=skip)
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


@pytest.mark.parametrize("world", [1, 2], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("quant", ("fp8", "nvfp4_swizzled"))
def test_twoshot_a_nan_residual_row_stays_nan_in_the_quantized_outputs(world, quant):
    """Issue 41 on a GPU: a residual row of NaN; every rank's quantized row is NaN as quant_ref
    writes it (fp8 NaN codes, NVFP4 NaN block scales), through the GPU's own conversions."""
    needs_gpu()
    from fusion_bridge.spec import EpilogueSpec
    from tests.helpers import quant_problems

    spec = EpilogueSpec(hidden_size=7168, top_k=8, quant=_quant_spec(quant))
    layers, errs = _setup(world, spec)
    inputs = _inputs(spec, 5, world, seed=41)
    for inp in inputs:
        inp.residual[2] = float("nan")
    outs = _call(layers, spec, inputs)
    torch.cuda.synchronize()
    problems = [quant_problems(spec.quant, out[1], out[2], out[3], nan_rows=[2]) for out in outs]
    assert not any(problems), problems
