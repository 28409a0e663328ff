"""Programmatic dependent launch (kernels/pdl.py) on one GPU of compute capability >= 9.0: our
PDL-launched kernels wait for the kernel before them before they read anything.

The writer before them is built to expose a kernel that reads too early: a Triton kernel that
first lets the next grid be scheduled (`gdc_launch_dependents`, as a PDL-aware GEMM does), then
spins for a while and only then writes the routing weights (or the residual) our kernel reads;
before it, a torch kernel zeroes them. A PDL kernel that read before its `griddepcontrol.wait`
would see zeros and fail the oracle. Checked eagerly and in CUDA graphs replayed on new inputs,
and after a plain torch kernel writing the same tensor. Run alone or under xdist (no emulated
ranks here).

What fails without the wait (a copy of the tree whose `pdl_enter` skips it, on one H200): both
late-writer cases of fused_tp1. The torch-writer cases and the twoshot case pass there: a kernel
that does not trigger early lets ours start only as it exits, and the two-shot pipeline's first
memory readers wait for the finalize's event (a full dependency); they check the PDL launches'
parity in graphs and eagerly, not the wait."""

import pytest
import torch
import triton
import triton.language as tl

from fusion_bridge.kernels.pdl import gdc_launch_dependents
from fusion_bridge.kernels.symm.device import _globaltimer
from tests.kernels.test_tp1 import call_records, poisoned_outputs
from tests.kernels.test_tp1_shapes_and_graphs import _poison, _problems, _quant, _strategy
from tests.kernels.test_tp1_shapes_and_graphs import needs_gpu

pytestmark = pytest.mark.gpu
SPIN_NS = 200_000  # the writer's delay after it lets dependents launch: far beyond our kernels


def needs_pdl():
    needs_gpu()
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90 or newer")


@triton.jit
def _late_copy(src_ptr, dst_ptr, n, spin_ns, BLOCK: tl.constexpr):
    """dst[:n] = src[:n], after letting the next grid launch and then spinning spin_ns."""
    gdc_launch_dependents()
    start = _globaltimer()
    now = start
    while now - start < spin_ns:
        now = _globaltimer()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def _write_late(dst, src, torch_only=False):
    """dst := src, through a zeroing torch kernel then (unless torch_only) the late writer."""
    if torch_only:
        dst.copy_(src)
        return
    dst.zero_()
    n = dst.numel()
    _late_copy[(triton.cdiv(n, 1024),)](src, dst, n, SPIN_NS, BLOCK=1024)


@pytest.mark.parametrize("quant", ("none", "nvfp4-swizzled"))
@pytest.mark.parametrize("writer", ("late_triton", "torch"))
def test_fused_tp1_pdl_reads_its_routing_weights_after_the_writer(quant, writer):
    """T = 1 and 16 (split rows), 300 (whole rows), H = 4096, K = 8: the default launch config
    (PDL on) right after a kernel that writes its routing weights; eager, then a CUDA graph
    replayed on new inputs."""
    needs_pdl()
    from fusion_bridge.spec import EpilogueSpec
    from fusion_bridge.oracle.synthetic import make_inputs

    spec = EpilogueSpec(hidden_size=4096, top_k=8, quant=_quant(quant), max_tokens=512)
    strat, env = _strategy(spec)
    launcher = strat._launcher
    assert launcher.pdl_ok
    problems = []
    torch_only = writer == "torch"
    for tokens in (1, 16, 300):
        assert launcher.config_for(tokens).pdl
        static = make_inputs(spec, tokens, seed=tokens, device="cuda")
        src = static.expert_weights.clone()
        for _ in range(3):  # eager (the first call compiles), into poisoned outputs
            got = poisoned_outputs(spec, tokens, "cuda")
            _write_late(static.expert_weights, src, torch_only)  # the launch right after it
            launcher(*call_records(static, got, strat._unused))
        torch.cuda.synchronize()
        # every launch this strategy made went through a PDL launcher
        assert all(plan.kernel.options.get("launch_pdl") for plan in launcher._plans.values())
        problems += _problems(spec, strat, env, static, got, f"eager T={tokens}")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _write_late(static.expert_weights, src, torch_only)
            got = strat.run(static)
        for seed in (1, 2):
            fresh = make_inputs(spec, tokens, seed=100 * seed + tokens, device="cuda")
            for dst, new in zip(static, fresh):
                if dst is not None:
                    dst.copy_(new)
            src.copy_(fresh.expert_weights)
            static.expert_weights.fill_(float("nan"))
            _poison(got)  # the replay must rewrite every output
            graph.replay()
            torch.cuda.synchronize()
            problems += _problems(spec, strat, env, fresh, got, f"graph T={tokens} seed {seed}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("tokens", (700, 2500))
def test_twoshot_pdl_after_a_late_writer_and_bitwise_without_pdl(tokens):
    """The two-shot at world size 1 with PDL on, after the late writer of its residual,
    eagerly and in a graph replayed on new inputs: the fp32 oracle's bound, and bit for bit the
    same launch with PDL off (the same arithmetic)."""
    needs_pdl()
    from fusion_bridge.kernels.symm import twoshot as symm_twoshot
    from tests.kernels.test_symm_twoshot_emulated_on_one_gpu import (
        BOUND,
        _call,
        _inputs,
        _outputs,
        _setup,
    )
    from tests.kernels.test_symm_oneshot_emulated_on_one_gpu import _problems as twoshot_problems
    from fusion_bridge.spec import EpilogueSpec

    spec = EpilogueSpec(hidden_size=4096, top_k=8, max_tokens=4096)
    on = symm_twoshot.TwoshotConfig(pdl=True)
    off = symm_twoshot.TwoshotConfig(pdl=False)
    layers_on, errs_on = _setup(1, spec, config=on)
    layers_off, errs_off = _setup(1, spec, config=off)
    static = _inputs(spec, tokens, 1, seed=tokens)
    src = static[0].residual.clone()
    outs = [_outputs(spec, static[0])]
    problems = []
    for _ in range(2):
        for t in outs[0]:
            t.view(torch.uint8).fill_(0xFF)  # poisoned: this call must rewrite every output
        _write_late(static[0].residual, src)
        _call(layers_on, spec, static, config=on, outs=outs)
    torch.cuda.synchronize()
    problems += twoshot_problems(spec, outs, static, BOUND, f"eager T={tokens}")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _write_late(static[0].residual, src)
        _call(layers_on, spec, static, config=on, outs=outs)
    for seed in (1, 2):
        fresh = _inputs(spec, tokens, 1, seed=1000 * seed + tokens)
        for dst, new in zip(static[0], fresh[0]):
            if dst is not None:
                dst.copy_(new)
        src.copy_(fresh[0].residual)
        for t in outs[0]:
            t.view(torch.uint8).fill_(0xFF)  # the replay must rewrite every output
        graph.replay()
        torch.cuda.synchronize()
        tag = f"graph T={tokens} seed {seed}"
        problems += twoshot_problems(spec, outs, fresh, BOUND, tag)
        ref = _call(layers_off, spec, fresh, config=off)
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(outs[0], ref[0])):
            if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                problems.append(f"{tag}: output {i} differs from the launch without PDL")
    assert int(errs_on[0][0]) == 0 and int(errs_off[0][0]) == 0
    assert not problems, "\n".join(problems)
