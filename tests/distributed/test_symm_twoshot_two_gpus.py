"""GPU tests of `symm_fused_twoshot` (the bandwidth path: the two-shot pipeline
kernels/symm/twoshot.py, its one launch shape) over 2 ranks (NCCL + symmetric memory, multicast
off), on 2 GPUs of one host (run on 2x H200), through the strategy: its workspace comes from the
symmetric-memory rendezvous. One spawned process group runs every case and returns its problems.

Covered: parity against the float64 oracle (T in 1, 3, 129, 1000, 1023, 1024, 1025, 2049, 4096,
8192; H in 7168, 4096, 2880; K in 1, 8; inputs different per rank with -1 slots and NaN in
unreferenced rows; none/fp8/nvfp4 in both scale layouts), quant bit-exact on the kernel's own
norm_out, bitwise identity of every output across ranks, T up to 16384 through the bridge with no
overflow route (the two-shot's workspace does not limit T), CUDA graphs replayed on new inputs
mixed with eager calls, a stress loop of 10,000 calls at random T up to 8192, and a rank that
skips a call (NaN and a clear error on both ranks, no hang).
"""

import math
import os
import random

import pytest
import torch

from fusion_bridge.cli.launch import run_distributed
from tests.distributed.test_symm_oneshot_two_gpus import (
    U_BF16,
    _check,
    _poison,
    _strategy,
    needs_two_gpus,
    progress_printer,
)

pytestmark = pytest.mark.gpu
WORLD = 2
NAME = "symm_fused_twoshot"
# the partial's rounding, residual_out's (norm_out is computed from it) and norm_out's, independent,
# in quadrature, against the exact (float64) oracle
BOUND = math.sqrt(3) * U_BF16
# chunk boundaries (1024 tokens), the 2 slots turned within a call (T > 2048) and many chunks
TOKENS = (1, 3, 129, 1000, 1023, 1024, 1025, 2049, 4096, 8192)
VARIANTS = ("default",)  # the strategy's (the earlier "f_after_x" shape: the benchmark's alone)
VARIANT_TOKENS = (1025, 4096)  # where every variant runs (the default elsewhere)


def _parity(rank, dev, problems):
    from fusion_bridge.spec import EpilogueSpec, QuantSpec, SFLayout
    from fusion_bridge.oracle.synthetic import make_inputs

    quants = [
        QuantSpec.none(),
        QuantSpec.fp8(0.05),
        QuantSpec.nvfp4(448 * 6 / 8.0, SFLayout.SWIZZLED_128x4),
        QuantSpec.nvfp4(448 * 6 / 8.0, SFLayout.LINEAR),
    ]
    cases = 0
    for hidden in (7168, 4096, 2880):
        for top_k in (1, 8):
            for qi, quant in enumerate(quants):
                spec = EpilogueSpec(
                    hidden_size=hidden,
                    top_k=top_k,
                    routed_scaling_factor=2.5,
                    weight_bias=0.5,
                    quant=quant,
                    max_tokens=8192,
                    has_shared_output=(top_k == 8 or qi % 2 == 0),
                )
                strat = _strategy(spec, dev, name=NAME)
                for tokens in TOKENS:
                    wdt = torch.float32 if tokens % 2 else torch.bfloat16
                    inp = make_inputs(
                        spec,
                        tokens,
                        rank=rank,
                        seed=tokens + hidden + top_k,
                        device=dev,
                        weight_dtype=wdt,
                        skip_fraction=0.2,
                    )
                    for variant in VARIANTS if tokens in VARIANT_TOKENS else VARIANTS[:1]:
                        out = strat.run(inp, variant)
                        _check(
                            spec,
                            out,
                            inp,
                            f"H={hidden} K={top_k} {quant.kind.value}/{quant.sf_layout.value} "
                            f"T={tokens} {variant}",
                            problems,
                            BOUND,
                        )
                        cases += 1
                strat.check_error()
                strat.close()
    return cases


def _large_t_through_the_bridge(rank, dev, problems):
    """max_tokens 16384: the two-shot's fixed workspace takes every T, so the bridge routes T=4096,
    8192 and 16384 to the two-shot (no overflow route)."""
    from fusion_bridge import EpilogueSpec, FusionBridge
    from fusion_bridge.oracle.synthetic import make_inputs

    spec = EpilogueSpec(hidden_size=7168, top_k=8, max_tokens=16384)
    with FusionBridge(spec, strategy=NAME, debug=False) as bridge:
        routes = {t: bridge.route_for(t) for t in (4096, 8192, 16384)}
        if any(route[0] != NAME for route in routes.values()):
            problems.append(f"routes {routes}: expected {NAME} at every T")
        bound = max(s.error_bound for s in bridge.statuses if s.name == NAME)
        for tokens in (4096, 16384):
            inp = make_inputs(spec, tokens, rank=rank, seed=tokens, device=dev)
            out = bridge.finalize_epilogue(
                inp.gemm2_out,
                inp.expanded_idx_to_permuted_idx,
                inp.expert_weights,
                inp.shared_output,
                inp.residual,
                inp.gamma,
            )
            _check(spec, out, inp, f"bridge T={tokens} via {routes[tokens]}", problems, bound)
    return routes


def _graphs_and_stress(rank, dev, problems, stress_calls):
    from fusion_bridge.spec import EpilogueSpec, QuantSpec
    from fusion_bridge.oracle.synthetic import make_inputs

    spec = EpilogueSpec(
        hidden_size=7168,
        top_k=8,
        routed_scaling_factor=2.5,
        quant=QuantSpec.nvfp4(448.0),
        max_tokens=8192,
    )
    strat = _strategy(spec, dev, name=NAME)
    graphs = {}
    for tokens in (129, 1024, 4096):
        static = make_inputs(spec, tokens, rank=rank, seed=1, device=dev)
        strat.run(static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = strat.run(static)
        graphs[tokens] = (graph, static, got)
    for i in range(2):  # replays on fresh inputs, eager calls in between
        for tokens, (graph, static, got) in graphs.items():
            fresh = make_inputs(spec, tokens, rank=rank, seed=100 + i * 7 + tokens, device=dev)
            for a, b in zip(static, fresh):
                if a is not None:
                    a.copy_(b)
            _poison(got)
            graph.replay()
            _check(spec, got, fresh, f"graph T={tokens} replay {i}", problems, BOUND)
            eager = make_inputs(spec, tokens - 5, rank=rank, seed=200 + i, device=dev)
            _check(
                spec,
                strat.run(eager),
                eager,
                f"eager T={tokens - 5} between replays",
                problems,
                BOUND,
            )
    # random T (the same on both ranks), graph replays and eager calls mixed
    rng = random.Random(4321)
    pool = {
        t: make_inputs(spec, t, rank=rank, seed=t, device=dev)
        for t in (1, 2, 7, 130, 257, 1000, 2048, 4095, 8192)
    }
    for call in range(stress_calls):
        if rng.random() < 0.5:
            graphs[rng.choice(list(graphs))][0].replay()
        else:
            tokens, variant = rng.choice(list(pool)), rng.choice(VARIANTS)
            out = strat.run(pool[tokens], variant)
            if call % 997 == 0:
                tag = f"stress call {call} T={tokens} {variant}"
                _check(spec, out, pool[tokens], tag, problems, BOUND)
    torch.cuda.synchronize()
    for tokens, (graph, static, got) in graphs.items():  # still exact after the loop
        _poison(got)
        graph.replay()
        _check(spec, got, static, f"graph T={tokens} after stress", problems, BOUND)
    strat.check_error()
    strat.close()


def _skipped_call(rank, dev, problems):
    """Rank 1 skips one call (timeout 1 s): rank 0's call comes back after about the timeout with
    NaN rows and the error word; rank 1's next call is aborted (NaN rows); the call after that
    raises on both ranks, naming the strategy, the missing or timed-out rank and the rebuild.
    Nothing hangs."""
    import time

    import torch.distributed as dist

    from fusion_bridge.kernels.symm.protocol import TWOSHOT_CHUNK, TWOSHOT_SLOTS
    from fusion_bridge.spec import EpilogueSpec
    from fusion_bridge.oracle.synthetic import make_inputs

    spec = EpilogueSpec(hidden_size=4096, top_k=8, max_tokens=1024)
    inp = make_inputs(spec, 600, rank=rank, device=dev)
    # compile every launch of the default variant first, with the default timeout: its first call
    # compiles several kernels between dependent waits, which a 1 s timeout may not cover
    warm = _strategy(spec, dev, name=NAME)
    warm.run(inp)
    torch.cuda.synchronize()
    warm.close()
    dist.barrier()
    strat = _strategy(spec, dev, timeout_s=1.0, name=NAME)
    base = int(strat._ws.state[0])  # 0, or the warm-up's chunks if the workspace outlived it
    strat.run(inp)
    torch.cuda.synchronize()
    # the device state: (chunk base, -, error word, -): the base moves on by the call's chunks
    # of TWOSHOT_CHUNK tokens rounded up to whole turns of the TWOSHOT_SLOTS slots
    state = strat._ws.state.tolist()
    chunks = -(-600 // TWOSHOT_CHUNK)
    turns = -(-chunks // TWOSHOT_SLOTS)
    if state[:3] != [base + turns * TWOSHOT_SLOTS, 0, 0]:
        problems.append(f"rank {rank}: after one call state {state}")
    dist.barrier()
    start = time.monotonic()
    out = strat.run(inp) if rank == 0 else None
    torch.cuda.synchronize()
    waited = time.monotonic() - start
    dist.barrier()
    if rank == 1:
        out = strat.run(inp)  # a peer timed out: its waits end on the abort word
        torch.cuda.synchronize()
    for name, t in (("residual_out", out.residual_out), ("norm_out", out.norm_out)):
        if not torch.isnan(t).any():
            problems.append(f"rank {rank}: the failed call's {name} holds no NaN")
    try:
        strat.run(inp)
        problems.append(f"rank {rank}: no error after the skipped call")
        torch.cuda.synchronize()
    except RuntimeError as exc:
        want = (
            "timed out waiting for rank(s) [1]" if rank == 0 else "stopped because rank 0 timed out"
        )
        text = str(exc)
        if want not in text or NAME not in text or "rebuild the bridge" not in text.lower():
            problems.append(f"rank {rank}: unclear error: {exc}")
    if rank == 0 and not 0.9 < waited < 10:
        problems.append(f"rank 0 waited {waited:.1f} s for a 1 s timeout")
    strat.close()


def _all(rank, world_size, stress_calls):
    os.environ.setdefault("FUSION_BRIDGE_DEBUG", "0")
    dev = torch.device("cuda", rank)
    problems = []
    progress = progress_printer(rank, problems, "twoshot gpu test")
    _skipped_call(rank, dev, problems)
    progress("skipped call")
    cases = _parity(rank, dev, problems)
    progress(f"parity ({cases} cases)")
    routes = _large_t_through_the_bridge(rank, dev, problems)
    progress(f"bridge large T {routes}")
    _graphs_and_stress(rank, dev, problems, stress_calls)
    progress(f"graphs + {stress_calls} stress calls")
    return problems, cases


def test_symm_twoshot_on_two_gpus():
    needs_two_gpus()
    results = run_distributed(_all, WORLD, 10_000, backend="nccl", timeout_s=540)
    for problems, cases in results:
        assert cases == 3 * 2 * 4 * (len(TOKENS) + len(VARIANT_TOKENS) * (len(VARIANTS) - 1))
        assert not problems, "\n".join(problems[:30])
