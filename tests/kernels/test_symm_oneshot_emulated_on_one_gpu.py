"""Our one-shot symmetric-memory kernel (`symm_oneshot`) with W ranks emulated on ONE GPU: each
rank's buffer is its own allocation, each rank's launch runs on its own CUDA stream with at most
SMs / W programs, so every program of every rank is resident at once and the ranks really wait for
each other.

This checks, on any single GPU, what the interpreter cannot: the compiled kernel, its waits and
device-side epochs under real concurrency, slot rotation and clearing over many calls at changing
T, and bitwise identity across ranks. It is not the NVLink test (peers here share one L2) and times
nothing: tests/distributed/test_symm_oneshot_two_gpus.py runs the real thing on 2 GPUs. The
two-shot (behind
`symm_fused_twoshot`) has its own: tests/kernels/test_symm_twoshot_emulated_on_one_gpu.py (emulated
ranks) and
tests/distributed/test_symm_twoshot_two_gpus.py (2 GPUs).
"""

import math
import random

import pytest
import torch

pytestmark = pytest.mark.gpu
U_BF16 = 2.0**-8


def needs_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (on a GPU machine: `python -m pytest -m gpu`)")


def _group(spec, world, cap, timeout_s=10.0):
    """W ranks' buffers (each its own allocation), states, pinned error words and layers, with at
    most SMs / W programs per rank (kernels/symm_testing)."""
    from fusion_bridge.testing.symm_oneshot_rig import emulated_group

    return emulated_group(spec, world, cap, device="cuda", timeout=int(timeout_s * 1e6))


def _call(kernel, group, streams, spec, inputs):
    """One epilogue call on every emulated rank (the production launch), each on its own stream;
    returns each rank's outputs."""
    from fusion_bridge.epilogue_tensors import quant_buffers
    from fusion_bridge.testing.symm_oneshot_rig import call_records

    outs = []
    main = torch.cuda.current_stream()
    for layer, stream, inp in zip(group.layers, streams, inputs):
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
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            kernel.OneshotLauncher(layer)(*call_records(inp, (ro, no, q, sf)))
        outs.append((ro, no, q, sf))
    for stream in streams:
        main.wait_stream(stream)
    return outs


def _oracle(spec, inputs):
    parts = []
    for inp in inputs:
        perm = inp.expanded_idx_to_permuted_idx.long()
        valid = (perm >= 0).unsqueeze(-1)
        rows = inp.gemm2_out.double()[perm.clamp(min=0)]
        part = torch.where(valid, rows * inp.expert_weights.double().unsqueeze(-1), 0.0).sum(1)
        part = part * spec.routed_scaling_factor
        if inp.shared_output is not None:
            part = part + inp.shared_output.double()
        parts.append(part)
    x = inputs[0].residual.double() + sum(parts)
    norm = (
        x
        / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + spec.eps)
        * (inputs[0].gamma.double() + spec.weight_bias)
    )
    return x, norm


def _problems(spec, outs, inputs, bound, tag):
    from fusion_bridge.oracle.numerics import rel_err

    found = []
    x, norm = _oracle(spec, inputs)
    for name, got, ref in (("residual_out", outs[0][0], x), ("norm_out", outs[0][1], norm)):
        err = rel_err(got, ref)
        if not err <= bound:
            found.append(f"{tag}: {name} rel err {err:.3g} > {bound:.3g}")
    for r in range(1, len(outs)):
        for i, (a, b) in enumerate(zip(outs[0], outs[r])):
            if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                found.append(f"{tag}: output {i} of rank {r} differs from rank 0")
    return found


@pytest.mark.parametrize("world", [2])
def test_emulated_ranks_on_one_gpu(world):
    needs_gpu()
    from fusion_bridge.kernels.symm import oneshot as symm_oneshot
    from fusion_bridge.spec import EpilogueSpec, QuantSpec, SFLayout
    from fusion_bridge.oracle.synthetic import make_inputs

    kernel = symm_oneshot
    bound = math.sqrt(2) * U_BF16
    problems = []
    streams = [torch.cuda.Stream() for _ in range(world)]
    quants = [
        QuantSpec.none(),
        QuantSpec.fp8(0.05),
        QuantSpec.nvfp4(448 * 6 / 8.0, SFLayout.SWIZZLED_128x4),
    ]
    cap = 256
    for hidden, top_k in ((7168, 8), (2880, 1)):
        for quant in quants:
            spec = EpilogueSpec(
                hidden_size=hidden,
                top_k=top_k,
                routed_scaling_factor=2.5,
                weight_bias=0.5,
                quant=quant,
                max_tokens=cap,
            )
            group = _group(spec, world, cap)
            for tokens in (1, 3, 129, cap - 1, cap):
                inputs = [
                    make_inputs(
                        spec, tokens, rank=r, seed=tokens + hidden, device="cuda", skip_fraction=0.2
                    )
                    for r in range(world)
                ]
                outs = _call(kernel, group, streams, spec, inputs)
                problems += _problems(
                    spec,
                    outs,
                    inputs,
                    bound,
                    f"oneshot W={world} H={hidden} {quant.kind.value} T={tokens}",
                )
    # many calls at changing T through one set of buffers: slots rotate and are cleared behind
    spec = EpilogueSpec(hidden_size=4096, top_k=8, max_tokens=cap)
    group = _group(spec, world, cap)
    rng = random.Random(7)
    pool = {
        t: [make_inputs(spec, t, rank=r, seed=t, device="cuda") for r in range(world)]
        for t in (1, 2, 5, 64, 130, cap // 2, cap)
    }
    for call in range(600):
        tokens = rng.choice(list(pool))
        outs = _call(kernel, group, streams, spec, pool[tokens])
        if call % 50 == 0:
            problems += _problems(
                spec, outs, pool[tokens], bound, f"oneshot W={world} stress call {call} T={tokens}"
            )
    torch.cuda.synchronize()
    errors = [int(e) for e in group.errs[:, 0]]
    assert errors == [0] * world, f"kernel error words {errors}"
    assert not problems, "\n".join(problems[:20])


def test_oneshot_rank_one_call_ahead_keeps_its_published_partial():
    """The compiled one-shot, part by part (kernels/symm_testing hooks, EMULATED off: the GPU timer
    and fence are in): rank 1 finishes call A and publishes call B before rank 0 clears for A.
    Rank 0's clear must leave rank 1's B partial alone: both ranks finish B within the timeout.
    Mutant killed: the one-shot (also) clearing the slot a faster peer is writing."""
    needs_gpu()
    from fusion_bridge.kernels.symm import protocol as P
    from fusion_bridge.testing.symm_oneshot_rig import call_records, launch_with_hooks
    from fusion_bridge.spec import EpilogueSpec
    from fusion_bridge.oracle.synthetic import make_inputs

    spec = EpilogueSpec(hidden_size=2880, top_k=4, max_tokens=8)
    group = _group(spec, 2, 8, timeout_s=0.5)
    calls = []
    for seed in (1, 2):
        inputs = [make_inputs(spec, 5, rank=r, seed=seed, device="cuda") for r in range(2)]
        inputs = [i._replace(residual=inputs[0].residual, gamma=inputs[0].gamma) for i in inputs]
        outs = [
            tuple(torch.full_like(inputs[0].residual, float("nan")) for _ in range(2))
            + (torch.empty(0, dtype=torch.uint8, device="cuda"),) * 2
            for _ in range(2)
        ]
        calls.append((inputs, outs))

    def part(call, rank, phases):
        inputs, outs = calls[call]
        launch_with_hooks(
            group.layers[rank], *call_records(inputs[rank], outs[rank]), phases=phases
        )

    publish, clear, reduce, epoch = P.PUBLISH | P.FINALIZE, P.CLEAR, P.REDUCE | P.NORM, P.EPOCH
    order = [(0, 0, publish), (0, 1, publish), (0, 1, clear), (0, 1, reduce), (0, 1, epoch)]
    order += [(1, 1, publish)]  # rank 1 is one call ahead
    order += [(0, 0, clear), (0, 0, reduce), (0, 0, epoch)]
    order += [(1, 0, publish), (1, 0, clear), (1, 0, reduce), (1, 0, epoch)]
    order += [(1, 1, clear), (1, 1, reduce), (1, 1, epoch)]
    for call, rank, phases in order:
        part(call, rank, phases)
    torch.cuda.synchronize()
    assert [int(e) for e in group.errs[:, 0]] == [0, 0]
    problems = []
    for call, (inputs, outs) in enumerate(calls):
        problems += _problems(spec, outs, inputs, math.sqrt(2) * U_BF16, f"call {call}")
    assert not problems, "\n".join(problems)


def test_compiled_symmetric_memory_kernels_normalize_huge_rows():
    """The compiled one-shot's norm on rows scaled by 2e19, 1e25 and 1e36 (their fp32 sum of squares
    overflows): within one rounding of the float64 oracle, never an all-zero row (the
    interpreter
    version is in tests/oracle/test_overflow.py; the two-shot's in
    tests/kernels/test_symm_twoshot.py)."""
    needs_gpu()
    from fusion_bridge.kernels.symm import oneshot as symm_oneshot
    from fusion_bridge.spec import EpilogueSpec
    from fusion_bridge.oracle.synthetic import make_inputs
    from tests import oracle64

    kernel = symm_oneshot
    spec = EpilogueSpec(hidden_size=2880, top_k=4, weight_bias=0.5, max_tokens=8)
    world, tokens = 2, 4
    inputs = [make_inputs(spec, tokens, rank=r, seed=6, device="cuda") for r in range(world)]
    residual = inputs[0].residual.clone()
    for row, scale in zip((1, 2, 3), (2e19, 1e25, 1e36)):
        residual[row] = (residual[row].float() * scale).to(torch.bfloat16)
    inputs = [i._replace(residual=residual, gamma=inputs[0].gamma) for i in inputs]
    group = _group(spec, world, 8)
    outs = _call(kernel, group, [torch.cuda.Stream() for _ in range(world)], spec, inputs)
    torch.cuda.synchronize()
    assert [int(e) for e in group.errs[:, 0]] == [0] * world
    cpu = [
        i._replace(**{f: getattr(i, f).cpu() for f in i._fields if getattr(i, f) is not None})
        for i in inputs
    ]
    residual_exact, norm_exact = oracle64.epilogue64_from(spec, cpu)
    for residual_out, norm_out, _, _ in outs:
        norm_out = norm_out.cpu()
        assert (norm_out[1:].abs().sum(1) > 0).all()
        # a GPU rounds once too, but FMA contraction may move the fp32 value: 2^-20 slack as on CPU
        oracle64.check_rounded_once(residual_out.cpu()[1:], residual_exact[1:], 2.0**-20)
        oracle64.check_rounded_once(norm_out[1:], norm_exact[1:], 2.0**-20)


@pytest.mark.parametrize("quant", ["fp8", "nvfp4"])
def test_a_nan_residual_row_stays_nan_in_the_compiled_quantized_outputs(quant):
    """Issue 41 on a GPU: a residual row of NaN on both emulated ranks; every rank's quantized row
    is NaN as quant_ref writes it (fp8 NaN codes, NVFP4 NaN block scales), through the GPU's own
    conversions."""
    needs_gpu()
    from fusion_bridge.kernels.symm import oneshot as symm_oneshot
    from fusion_bridge.oracle.synthetic import make_inputs
    from fusion_bridge.spec import EpilogueSpec, QuantSpec
    from tests.helpers import quant_problems

    q = QuantSpec.fp8(0.05) if quant == "fp8" else QuantSpec.nvfp4(448 * 6 / 8.0)
    spec = EpilogueSpec(hidden_size=7168, top_k=8, quant=q, max_tokens=16)
    group = _group(spec, 2, 16)
    inputs = [make_inputs(spec, 5, rank=r, seed=41, device="cuda") for r in range(2)]
    for inp in inputs:
        inp.residual[2] = float("nan")
    outs = _call(symm_oneshot, group, [torch.cuda.Stream() for _ in range(2)], spec, inputs)
    torch.cuda.synchronize()
    problems = [quant_problems(q, out[1], out[2], out[3], nan_rows=[2]) for out in outs]
    assert not any(problems), problems
