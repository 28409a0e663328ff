"""GPU tests of the two-shot ring kernel (`kernels/symm_ring.py`) over 2 ranks (NCCL + PyTorch
symmetric memory, multicast off), for the two-GPU run: one spawned process group runs every case and
returns its problems. The kernel is launched directly (no bridge, no strategy) on the workspace
`symm_fused_twoshot` uses: strategies/symm_workspace.create(kind="twoshot"), bound as its layer.
tests/test_gpu_symm_twoshot.py runs the same kernel through the strategy.

Covered: parity against the float64 oracle (T in 1, 3, 255, 257 (chunk edges), 1000, 4096, 16384
(the ring turns 16 times in one call); H in 7168, 2880; K in 8, 1; inputs different per rank with
-1 slots; none / fp8 / nvfp4 in both scale layouts), quant bit-exact on the kernel's own norm_out,
bitwise identity of every output across ranks, a workspace under 64 MB whatever T, CUDA graphs
replayed on new inputs mixed with eager calls and a stress loop at random T, and a rank that skips
a call (NaN and the error word on both ranks, no hang).
"""

import os
import random

import pytest
import torch

from fusion_bridge.cli.launch import run_distributed
from tests.test_gpu_symm_oneshot import U_BF16, _check, needs_two_gpus, progress_printer

pytestmark = pytest.mark.gpu
WORLD = 2
BOUND = 3**0.5 * U_BF16  # the partial's rounding, residual_out's (the norm reads it), norm_out's


def ring_over_symmetric_memory(group, spec, device, timeout_s: float = 20.0):
    """Collective (every rank of `group`): the ring's workspace in PyTorch symmetric memory, made
    as `symm_fused_twoshot` makes it (strategies/symm_workspace.create, kind "twoshot"), and this
    rank's layer. Returns a namespace (layer, err: pinned int32 [4], buffer, handle, ws); keep it
    alive while the layer is used."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from fusion_bridge.kernels.symm_protocol import SymmLayer
    from fusion_bridge.strategies import symm_workspace as sw

    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    ws = sw.create(group, spec, world, device, timeout_s, kind="twoshot")
    layer = SymmLayer.bind(ws, spec)
    return SimpleNamespace(layer=layer, err=ws.err, buffer=ws.buffer, handle=ws.handle, ws=ws)


def _runner(spec, dev, timeout_s=20.0):
    """A ring on symmetric memory and a call that returns EpilogueOutputs."""
    from fusion_bridge.epilogue_tensors import EpilogueOutputs, quant_buffers
    from fusion_bridge.kernels import symm_ring
    from fusion_bridge.kernels.symm_testing import call_tensors

    ring = ring_over_symmetric_memory(None, spec, dev, timeout_s)
    empty = torch.empty(0, dtype=torch.uint8, device=dev)

    def run(inp):
        tokens, hidden = inp.residual.shape
        ro, no = torch.empty_like(inp.residual), torch.empty_like(inp.residual)
        q, sf = quant_buffers(tokens, hidden, spec.quant.kind, spec.quant.sf_layout, dev)
        qv = empty if q is None else q.view(torch.uint8)
        sfv = empty if sf is None else sf
        symm_ring.launch(ring.layer, **call_tensors(inp, (ro, no, qv, sfv)))
        return EpilogueOutputs.for_quant(spec.quant.kind, ro, no, q, sf)

    return ring, run


def _parity(rank, dev, problems):
    from fusion_bridge.kernels import symm_protocol
    from fusion_bridge.spec import EpilogueSpec, QuantSpec, SFLayout
    from fusion_bridge.synthetic import make_inputs

    quants = [
        QuantSpec.none(),
        QuantSpec.fp8(0.05),
        QuantSpec.nvfp4(448 * 6 / 8.0, SFLayout.SWIZZLED_128x4),
        QuantSpec.nvfp4(448 * 6 / 8.0, SFLayout.LINEAR),
    ]
    cases = 0
    for hidden, top_k in ((7168, 8), (2880, 1)):
        if symm_protocol.ring_buffer_bytes(WORLD, hidden, 2) > 64 << 20:
            problems.append(f"H={hidden}: ring buffer above 64 MB")
        for quant in quants:
            spec = EpilogueSpec(
                hidden_size=hidden, top_k=top_k, routed_scaling_factor=2.5, weight_bias=0.5,
                quant=quant, max_tokens=16384,
            )  # fmt: skip
            ring, run = _runner(spec, dev)
            for tokens in (1, 3, 255, 257, 1000, 4096, 16384):
                if tokens == 16384 and (hidden != 7168 or quant.kind.value != "none"):
                    continue
                wdt = torch.float32 if tokens % 2 else torch.bfloat16
                inp = make_inputs(
                    spec, tokens, rank=rank, seed=tokens + hidden + top_k, device=dev,
                    weight_dtype=wdt, skip_fraction=0.2,
                )  # fmt: skip
                tag = f"H={hidden} K={top_k} {quant.kind.value}/{quant.sf_layout.value} T={tokens}"
                _check(spec, run(inp), inp, tag, problems, BOUND)
                cases += 1
            torch.cuda.synchronize()
            if int(ring.err[0]):
                problems.append(f"rank {rank} {spec.quant.kind.value}: error {int(ring.err[0]):#x}")
    return cases


def _graphs_and_stress(rank, dev, problems, stress_calls):
    from fusion_bridge.spec import EpilogueSpec, QuantSpec
    from fusion_bridge.synthetic import make_inputs

    spec = EpilogueSpec(
        hidden_size=7168, top_k=8, routed_scaling_factor=2.5, quant=QuantSpec.nvfp4(448.0)
    )
    ring, run = _runner(spec, dev)
    graphs = {}
    for tokens in (129, 1024, 5000):
        static = make_inputs(spec, tokens, rank=rank, seed=1, device=dev)
        run(static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = run(static)
        graphs[tokens] = (graph, static, got)
    rng = random.Random(4321)  # the same T on both ranks
    pool = {t: make_inputs(spec, t, rank=rank, seed=t, device=dev) for t in (1, 7, 255, 257, 3000)}
    for call in range(stress_calls):
        if rng.random() < 0.5:
            graph, static, got = graphs[rng.choice(list(graphs))]
            graph.replay()
        else:
            tokens = rng.choice(list(pool))
            out = run(pool[tokens])
            if call % 499 == 0:
                _check(spec, out, pool[tokens], f"stress call {call} T={tokens}", problems, BOUND)
    torch.cuda.synchronize()
    for tokens, (graph, static, got) in graphs.items():
        graph.replay()
        _check(spec, got, static, f"graph T={tokens} after stress", problems, BOUND)
    if int(ring.err[0]):
        problems.append(f"rank {rank} stress: error {int(ring.err[0]):#x}")


def _skipped_call(rank, dev, problems):
    """Rank 1 skips one call: rank 0's call comes back (bounded wait) with NaN and the error word
    naming rank 1; rank 1's next call is aborted (NaN, the abort word). Nothing hangs."""
    import torch.distributed as dist

    from fusion_bridge.kernels.symm_protocol import ERR_ABORTED, ERR_TIMEOUT
    from fusion_bridge.spec import EpilogueSpec
    from fusion_bridge.synthetic import make_inputs

    spec = EpilogueSpec(hidden_size=4096, top_k=8)
    ring, run = _runner(spec, dev, timeout_s=1.0)
    inp = make_inputs(spec, 600, rank=rank, device=dev)
    run(inp)
    torch.cuda.synchronize()
    if ring.layer.state.tolist() != [3, 0, 0, 0]:  # chunk base (600 tokens: 3 chunks), ticket, -
        problems.append(f"rank {rank}: after one call state {ring.layer.state.tolist()}")
    dist.barrier()
    out = run(inp) if rank == 0 else None
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:
        out = run(inp)
        torch.cuda.synchronize()
    err = int(ring.err[0])
    if not torch.isnan(out.residual_out).all():
        problems.append(f"rank {rank}: the failed call's residual_out is not all NaN")
    want = (ERR_TIMEOUT | 0b10) if rank == 0 else None
    if rank == 0 and err != want:
        problems.append(f"rank 0: error word {err:#x}, expected {want:#x}")
    if rank == 1 and not err & ERR_ABORTED:
        problems.append(f"rank 1: error word {err:#x}, expected the abort")


def _all(rank, world_size, stress_calls):
    os.environ.setdefault("FUSION_BRIDGE_DEBUG", "0")
    dev = torch.device("cuda", rank)
    problems = []
    progress = progress_printer(rank, problems, "ring gpu test")
    _skipped_call(rank, dev, problems)
    progress("skipped call")
    cases = _parity(rank, dev, problems)
    progress(f"parity ({cases} cases)")
    _graphs_and_stress(rank, dev, problems, stress_calls)
    progress(f"graphs + {stress_calls} stress calls")
    return problems, cases


def test_symm_ring_on_two_gpus():
    needs_two_gpus()
    results = run_distributed(_all, WORLD, 4000, backend="nccl", timeout_s=480)
    for problems, cases in results:
        assert cases == 2 * 4 * 6 + 1
        assert not problems, "\n".join(problems[:30])
