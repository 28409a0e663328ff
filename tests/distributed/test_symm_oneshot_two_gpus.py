"""GPU tests of `symm_fused_oneshot` over 2 ranks (NCCL + symmetric memory, multicast off), on 2
GPUs of one host (run on 2x H200). One spawned process group runs every case (a spawn costs seconds)
and returns its problems; the test asserts there are none.

Covered: parity against a float64 oracle built here (T in 1,3,16,64,129,256; H in 7168,4096,2880; K
in 1,8;
inputs different per rank with -1 slots and NaN in unreferenced rows; none/fp8/nvfp4 in both scale
layouts), quant bit-exact against the torch reference on the kernel's own norm_out, bitwise identity
of every output across ranks, CUDA-graph capture with replays on new inputs mixed with eager calls,
a
stress loop of >= 10,000 calls at random T, and a rank that skips a call (error, not a hang).
"""

import math
import os
import random

import pytest
import torch

from fusion_bridge.cli.launch import run_distributed

pytestmark = pytest.mark.gpu
WORLD = 2
U_BF16 = 2.0**-8
# partial rounding + output rounding, independent, in quadrature, against the exact (float64) oracle
BOUND = math.sqrt(2) * U_BF16


def needs_two_gpus():
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs, found {torch.cuda.device_count()}")


def _strategy(spec, dev, timeout_s=20.0, name="symm_fused_oneshot"):
    import torch.distributed as dist

    from fusion_bridge.environment import detect
    from fusion_bridge.registry import strategy_class

    env = detect(device=dev, probe_flashinfer=False)
    cls = strategy_class(name)
    reasons = cls.not_supported_reasons(spec, env)
    assert not reasons, reasons
    strat = cls(spec, env, group=dist.group.WORLD, device=dev)
    strat.timeout_s = timeout_s
    strat.prepare()
    return strat


def _oracle(spec, inp):
    """float64 residual_out, norm_out of the exact math, partials all-gathered in rank order."""
    import torch.distributed as dist

    perm = inp.expanded_idx_to_permuted_idx.long()
    valid = (perm >= 0).unsqueeze(-1)
    rows = inp.gemm2_out.double()[perm.clamp(min=0)]
    part = torch.where(valid, rows * inp.expert_weights.double().unsqueeze(-1), 0.0).sum(1)
    part = part * spec.routed_scaling_factor
    if inp.shared_output is not None:
        part = part + inp.shared_output.double()
    parts = [torch.empty_like(part) for _ in range(WORLD)]
    dist.all_gather(parts, part.contiguous())
    x = inp.residual.double() + sum(parts)
    norm = (
        x
        / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + spec.eps)
        * (inp.gamma.double() + spec.weight_bias)
    )
    return x, norm


def _check(spec, out, inp, tag, problems, bound=BOUND):
    import torch.distributed as dist

    from fusion_bridge.oracle.numerics import rel_err
    from fusion_bridge.oracle.quant_ref import quantize_fp8, quantize_nvfp4
    from fusion_bridge.spec import QuantKind

    x, norm = _oracle(spec, inp)
    for name, got, ref in (("residual_out", out.residual_out, x), ("norm_out", out.norm_out, norm)):
        err = rel_err(got, ref)
        if not err <= bound:
            problems.append(f"{tag}: {name} rel err {err:.3g} > {bound:.3g}")
    q = spec.quant
    if q.kind is QuantKind.FP8 and not torch.equal(
        out.quant.view(torch.uint8), quantize_fp8(out.norm_out, q.scale).view(torch.uint8)
    ):
        problems.append(f"{tag}: fp8 codes differ from the reference on the kernel's norm_out")
    if q.kind is QuantKind.NVFP4:
        ref_q, ref_sf = quantize_nvfp4(out.norm_out, q.global_scale, q.sf_layout)
        if not (torch.equal(out.quant, ref_q) and torch.equal(out.scale, ref_sf)):
            problems.append(
                f"{tag}: nvfp4 codes/scales differ from the reference on the kernel's norm_out"
            )
    for name, t in out.named().items():  # bitwise identity across ranks
        b = t.contiguous().view(torch.uint8).flatten()
        gathered = [torch.empty_like(b) for _ in range(WORLD)]
        dist.all_gather(gathered, b)
        if not all(torch.equal(gathered[0], g) for g in gathered[1:]):
            problems.append(f"{tag}: {name} differs across ranks")


def _poison(out):
    for t in out.named().values():
        t.view(torch.uint8).fill_(0xFF)


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
                    max_tokens=256,
                    has_shared_output=(top_k == 8 or qi % 2 == 0),
                )
                strat = _strategy(spec, dev)
                for tokens in (1, 3, 16, 64, 129, 256):
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
                    out = strat.run(inp)
                    _check(
                        spec,
                        out,
                        inp,
                        f"H={hidden} K={top_k} {quant.kind.value}/{quant.sf_layout.value} "
                        f"T={tokens}",
                        problems,
                    )
                    cases += 1
                strat.check_error()
                strat.close()
    return cases


def _graphs_and_stress(rank, dev, problems, stress_calls):
    from fusion_bridge.spec import EpilogueSpec, QuantSpec
    from fusion_bridge.oracle.synthetic import make_inputs

    spec = EpilogueSpec(
        hidden_size=7168,
        top_k=8,
        routed_scaling_factor=2.5,
        quant=QuantSpec.nvfp4(448.0),
        max_tokens=256,
    )
    strat = _strategy(spec, dev)
    graphs = {}
    for tokens in (1, 16, 64):
        static = make_inputs(spec, tokens, rank=rank, seed=1, device=dev)
        strat.run(static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = strat.run(static)
        graphs[tokens] = (graph, static, got)
    # replays on fresh inputs, eager calls in between
    for i in range(3):
        for tokens, (graph, static, got) in graphs.items():
            fresh = make_inputs(spec, tokens, rank=rank, seed=100 + i * 7 + tokens, device=dev)
            for a, b in zip(static, fresh):
                a.copy_(b)
            _poison(got)
            graph.replay()
            _check(spec, got, fresh, f"graph T={tokens} replay {i}", problems)
            eager = make_inputs(spec, tokens + 5, rank=rank, seed=200 + i, device=dev)
            _check(spec, strat.run(eager), eager, f"eager T={tokens + 5} between replays", problems)
    # stress: random T (the same on both ranks), graph replays and eager calls mixed
    rng = random.Random(1234)
    pool = {
        t: make_inputs(spec, t, rank=rank, seed=t, device=dev)
        for t in (1, 2, 3, 5, 17, 33, 100, 200, 256)
    }
    last = {}
    for call in range(stress_calls):
        if rng.random() < 0.5:
            tokens = rng.choice(list(graphs))
            graphs[tokens][0].replay()
            last = {"graph": tokens}
        else:
            tokens = rng.choice(list(pool))
            out = strat.run(pool[tokens])
            last = {"eager": tokens}
            if call % 997 == 0:
                _check(spec, out, pool[tokens], f"stress call {call} T={tokens}", problems)
    torch.cuda.synchronize()
    for tokens, (graph, static, got) in graphs.items():  # no drift: still exact after the loop
        _poison(got)
        graph.replay()
        _check(spec, got, static, f"graph T={tokens} after stress", problems)
    strat.check_error()
    strat.close()
    return last


def _skipped_call(rank, dev, problems):
    """Rank 1 skips one call: rank 0's call times out (NaN outputs, then a clear error); rank 1's
    next
    call is aborted at once (a peer timed out), then raises too. Nothing hangs."""
    import torch.distributed as dist

    from fusion_bridge.kernels.symm.protocol import SENTINEL_BITS
    from fusion_bridge.spec import EpilogueSpec
    from fusion_bridge.oracle.synthetic import make_inputs

    spec = EpilogueSpec(hidden_size=4096, top_k=8, max_tokens=64)
    strat = _strategy(spec, dev, timeout_s=1.0)
    inp = make_inputs(spec, 16, rank=rank, device=dev)
    strat.run(inp)
    torch.cuda.synchronize()
    # both ranks finished call 1 before anyone inspects a buffer the peer writes into
    dist.barrier()
    ws = (
        strat._ws
    )  # after one call: slot 0 holds both ranks' rows, slots 1 and 2 the sentinel, no abort
    slots = ws.buffer[2 * ws.data_off :].view(torch.int16).view(3, WORLD, ws.cap, spec.hidden_size)
    head = ws.buffer[:4].view(torch.int32)
    state = ws.state.tolist()
    if int(head[0]) != 0 or state[0] != 1 or state[4] != 16 or state[1] != 0:
        problems.append(f"rank {rank}: after one call abort word {int(head[0]):#x}, state {state}")
    if bool((slots[0, :, :16] == SENTINEL_BITS).any()) or not bool(
        (slots[0, :, 16:] == SENTINEL_BITS).all()
    ):
        problems.append(
            f"rank {rank}: slot 0 after one call: rows < 16 not all arrived or rows >= 16 written"
        )
    if not bool((slots[1:] == SENTINEL_BITS).all()):
        problems.append(f"rank {rank}: slots 1, 2 after one call do not all hold the sentinel")
    dist.barrier()  # rank 0's next call pushes into rank 1's slot 1: only after rank 1 has looked
    skip_one_call_and_check(rank, strat, inp, problems)


def skip_one_call_and_check(rank, strat, inp, problems):
    """Rank 1 skips a call that rank 0 makes (timeout 1 s): rank 0's call must come back after about
    the
    timeout with NaN outputs, rank 1's next call at once (aborted) with NaN outputs, and the call
    after
    that must raise on both ranks, naming the strategy, the missing or timed-out rank and the
    rebuild."""
    import time

    import torch.distributed as dist

    start = time.monotonic()
    out = strat.run(inp) if rank == 0 else None
    torch.cuda.synchronize()
    waited = time.monotonic() - start
    dist.barrier()
    if rank == 1:
        out = strat.run(inp)  # a peer timed out: aborted without waiting
        torch.cuda.synchronize()
    for name, t in (("residual_out", out.residual_out), ("norm_out", out.norm_out)):
        if not torch.isnan(t).all():
            problems.append(
                f"rank {rank}: the failed call's {name} is not all NaN "
                f"({int(torch.isnan(t).sum())} of {t.numel()})"
            )
    try:
        strat.run(inp)
        problems.append(f"rank {rank}: no error after the skipped call")
        torch.cuda.synchronize()
    except RuntimeError as exc:
        want = (
            "timed out waiting for rank(s) [1]" if rank == 0 else "stopped because rank 0 timed out"
        )
        if (
            want not in str(exc)
            or strat.name not in str(exc)
            or "rebuild the bridge" not in str(exc).lower()
        ):
            problems.append(f"rank {rank}: unclear error: {exc}")
    if rank == 0 and not 0.9 < waited < 10:
        problems.append(f"rank 0 waited {waited:.1f} s for a 1 s timeout")
    strat.close()


def progress_printer(rank, problems, label):
    """progress(what): rank 0 prints the step, the problems so far and the last few of them."""
    import time

    t0 = time.monotonic()

    def progress(what):
        if rank == 0:
            print(
                f"[{label}] {what}: {len(problems)} problems so far, {time.monotonic() - t0:.0f} s",
                flush=True,
            )
            for p in problems[-5:]:
                print("   ", p[:300], flush=True)

    return progress


def _all(rank, world_size, stress_calls):
    os.environ.setdefault("FUSION_BRIDGE_DEBUG", "0")
    dev = torch.device("cuda", rank)
    problems = []
    progress = progress_printer(rank, problems, "symm gpu test")
    _skipped_call(rank, dev, problems)
    progress("skipped call")
    cases = _parity(rank, dev, problems)
    progress(f"parity ({cases} cases)")
    last = _graphs_and_stress(rank, dev, problems, stress_calls)
    progress(f"graphs + {stress_calls} stress calls")
    return problems, cases, last


def test_symm_oneshot_on_two_gpus():
    needs_two_gpus()
    results = run_distributed(_all, WORLD, 10_000, backend="nccl", timeout_s=420)
    for problems, cases, _ in results:
        assert cases == 3 * 2 * 4 * 6
        assert not problems, "\n".join(problems[:30])
