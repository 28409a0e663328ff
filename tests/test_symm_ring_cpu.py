"""The ring two-shot kernel (`kernels/symm_ring.py`) on CPU: its very kernel body under
TRITON_INTERPRET=1, with the W ranks' buffers as rows of one tensor and one launch per (stage,
chunk, rank, program) in the pipeline's order (kernels/symm_testing.py), so every wait finds what
the earlier launches wrote. Small chunks (4-8 tokens) and narrow column tiles make T = 1, one chunk,
chunks that do not divide T, a ring turned several times within one call, chunks that W does not
divide, and several column tiles per row reachable at interpreter speed. The system-scope
signalling, the timer and the end-of-call ticket are GPU-only (tests/test_gpu_symm_ring_*.py)."""

import math

import pytest
import torch

from fusion_bridge.epilogue_tensors import quant_buffers
from fusion_bridge.kernels.symm_protocol import ERR_ABORTED, ERR_TIMEOUT
from fusion_bridge.kernels.symm_ring import RingShape
from fusion_bridge.kernels.symm_testing import EmulatedRing
from fusion_bridge.kernels.symm_ring_device import SLOTS
from fusion_bridge.numerics import rel_err
from fusion_bridge.spec import EpilogueSpec, QuantSpec, SFLayout
from fusion_bridge.strategies.base import UNIT_ROUNDOFF, kernel_quant_args
from fusion_bridge.synthetic import make_inputs

from tests.oracle64 import epilogue64_from, finalize64, quantize  # float64, imports nothing of ours

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter emulation; the GPU tests cover a GPU"
)
U = UNIT_ROUNDOFF[torch.bfloat16]
UNIT = 1 << 20  # what one chunk's releases add to its slot's counter (symm_ring_device._UNIT)
QUANTS = {
    "none": QuantSpec.none(),
    "fp8": QuantSpec.fp8(0.02),
    "nvfp4_swizzled": QuantSpec.nvfp4(448 * 6 / 8.0, SFLayout.SWIZZLED_128x4),
    "nvfp4_linear": QuantSpec.nvfp4(448 * 6 / 8.0, SFLayout.LINEAR),
}


SHAPE = RingShape(f_rows=2, f_cols=64)  # narrow finalize tiles: several per row


def _run(emu, spec, inputs, programs=2, skip_rank=None, max_polls=3):
    """One call on every emulated rank; outputs poisoned (NaN / 0xFF) first."""
    tokens, hidden = inputs[0].residual.shape
    per_rank, outs = [], []
    for inp in inputs:
        ro = torch.full((tokens, hidden), float("nan"), dtype=spec.dtype)
        no = torch.full((tokens, hidden), float("nan"), dtype=spec.dtype)
        q, sf = quant_buffers(tokens, hidden, spec.quant.kind, spec.quant.sf_layout, "cpu")
        q = torch.empty(0, dtype=torch.uint8) if q is None else q.view(torch.uint8)
        sf = torch.empty(0, dtype=torch.uint8) if sf is None else sf
        q.fill_(0xFF)
        sf.fill_(0xFF)
        outs.append((ro, no, q, sf))
        per_rank.append(
            dict(
                gemm2_out=inp.gemm2_out,
                perm=inp.expanded_idx_to_permuted_idx,
                weights=inp.expert_weights,
                shared=inp.shared_output,
                residual=inp.residual,
                gamma=inp.gamma,
                residual_out=ro,
                norm_out=no,
                q=q,
                sf=sf,
            )  # fmt: skip
        )
    emu.call(
        per_rank, spec_scalars=(spec.routed_scaling_factor, spec.eps, spec.weight_bias),
        quant=kernel_quant_args(spec), shape=SHAPE, programs=programs, max_polls=max_polls,
        skip_rank=skip_rank,
    )  # fmt: skip
    return outs


def _inputs(spec, tokens, world, seed, **kw):
    return [
        make_inputs(spec, tokens, rank=r, seed=seed, device="cpu", skip_fraction=0.3, **kw)
        for r in range(world)
    ]


CASES = [  # tokens, hidden, top_k, world, chunk, programs
    (1, 96, 8, 2, 4, 2),  # T = 1: one partial chunk, rank 1 owns nothing
    (4, 96, 4, 2, 4, 3),  # exactly one chunk
    (7, 160, 1, 3, 4, 2),  # W does not divide the chunk; the last chunk partial
    (21, 96, 8, 4, 4, 2),  # 6 chunks: the 4-slot ring turns within the call
    (9, 64, 2, 8, 8, 3),  # W = 8, one owner row per chunk and rank
    (3, 2880, 8, 2, 4, 1),  # H not a power of two, many column tiles, one program
]


LONG = {(21, 4), (3, 2)}  # run without quantization only (interpreter time)


@pytest.mark.parametrize(
    "tokens,hidden,top_k,world,chunk,programs,quant",
    [c + (q,) for c in CASES for q in QUANTS if q == "none" or (c[0], c[3]) not in LONG],
)
def test_every_rank_gets_the_same_bits_and_the_oracle_within_three_roundings(
    tokens, hidden, top_k, world, chunk, programs, quant
):
    spec = EpilogueSpec(
        hidden_size=hidden, top_k=top_k, routed_scaling_factor=2.5, weight_bias=0.5,
        quant=QUANTS[quant], has_shared_output=(top_k != 2),
    )  # fmt: skip
    emu = EmulatedRing(world, chunk, hidden)
    inputs = _inputs(spec, tokens, world, seed=tokens * 31 + hidden + world)
    outs = _run(emu, spec, inputs, programs=programs)
    assert not emu.states[:, 2].any(), emu.states  # no wait failed
    for r in range(1, world):  # bitwise identical on every rank
        for mine, theirs in zip(outs[r], outs[0]):
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), f"rank {r}"
    residual_out, norm_out, q, sf = outs[0]
    x64, norm64 = epilogue64_from(spec, inputs)
    # the partial's rounding, residual_out's (the norm reads it) and norm_out's, in quadrature
    assert rel_err(residual_out, x64) <= math.sqrt(2) * U
    assert rel_err(norm_out, norm64) <= math.sqrt(3) * U
    # residual_out: ONE rounding of residual + the rank-ordered fp32 sum of the rounded partials
    parts = []
    for inp in inputs:
        p = finalize64(
            inp.gemm2_out, inp.expanded_idx_to_permuted_idx, inp.expert_weights,
            spec.routed_scaling_factor,
        )  # fmt: skip
        if inp.shared_output is not None:
            p = p + inp.shared_output.double()
        parts.append(p.to(spec.dtype).float())
    summed = parts[0]
    for p in parts[1:]:
        summed = summed + p
    expect = (inputs[0].residual.float() + summed).to(spec.dtype)
    assert (residual_out != expect).float().mean() <= 1e-3  # a near-tie partial may round apart
    ro = residual_out.double()  # the norm reads the rounded residual_out
    norm_of_ro = (
        ro
        / torch.sqrt(ro.pow(2).mean(-1, keepdim=True) + spec.eps)
        * (inputs[0].gamma.double() + 0.5)
    )
    assert rel_err(norm_out, norm_of_ro) <= U
    if quant == "fp8":  # quantization reads the kernel's own norm_out: bit-exact
        assert torch.equal(q, quantize(norm_out, "fp8", spec.quant.scale)[0].view(torch.uint8))
    if quant.startswith("nvfp4"):
        swizzled = spec.quant.sf_layout is SFLayout.SWIZZLED_128x4
        ref_q, ref_sf = quantize(norm_out, "nvfp4", spec.quant.global_scale, swizzled)
        assert torch.equal(q, ref_q.view(torch.uint8)) and torch.equal(sf, ref_sf.view(torch.uint8))
    # every slot element written in the call was read and put back to the sentinel
    assert emu.data_all_sentinel()
    chunks = -(-tokens // chunk)
    assert emu.states[:, 0].tolist() == [chunks] * world
    uses = [len(range(s, chunks, SLOTS)) for s in range(SLOTS)]
    assert emu.freed.tolist() == [[u * UNIT for u in uses]] * world


def test_calls_at_changing_t_and_program_counts_share_one_ring():
    """The chunk base carries over calls and a chunk's releases add one unit whatever the program
    count, so calls with different launch shapes can follow each other through one ring."""
    spec = EpilogueSpec(hidden_size=64, top_k=4, routed_scaling_factor=2.5)
    world, chunk = 3, 4
    emu = EmulatedRing(world, chunk, 64)
    total = 0
    for tokens, programs in ((9, 2), (2, 3), (17, 1), (1, 2), (6, 3)):
        inputs = _inputs(spec, tokens, world, seed=tokens)
        outs = _run(emu, spec, inputs, programs=programs)
        x64, norm64 = epilogue64_from(spec, inputs)
        assert not emu.states[:, 2].any(), (tokens, emu.states)
        assert rel_err(outs[1][1], norm64) <= math.sqrt(3) * U, tokens
        assert torch.equal(outs[0][0].view(torch.int16), outs[2][0].view(torch.int16)), tokens
        total += -(-tokens // chunk)
        assert emu.states[:, 0].tolist() == [total] * world
        assert emu.data_all_sentinel()


@pytest.mark.parametrize("world,skip", [(2, 1), (3, 0), (4, 2)])
def test_a_rank_that_never_arrives_gives_nan_and_names_it(world, skip):
    spec = EpilogueSpec(hidden_size=64, top_k=2, quant=QUANTS["nvfp4_swizzled"])
    emu = EmulatedRing(world, 8, 64)
    outs = _run(emu, spec, _inputs(spec, 6, world, seed=1), skip_rank=skip)
    for r in range(world):
        if r == skip:
            continue
        residual_out, norm_out, *_ = outs[r]
        assert torch.isnan(residual_out).all() and torch.isnan(norm_out).all(), r
        # the first rank to time out names the missing one and stops the others (abort word)
        err = int(emu.states[r, 2])
        assert err & (1 << skip) and err & (int(ERR_TIMEOUT) | int(ERR_ABORTED)), hex(err)
    first = [int(e) for e in emu.states[:, 2] if int(e) & int(ERR_TIMEOUT)]
    assert first and all(e == int(ERR_TIMEOUT) | (1 << skip) for e in first), first


def test_a_missing_rank_stops_the_ring_too():
    """T spans more chunks than slots: besides the data, the live ranks wait for the missing rank's
    release of the slot they are about to reuse, and that wait too ends in the error word."""
    spec = EpilogueSpec(hidden_size=64, top_k=2)
    emu = EmulatedRing(2, 4, 64)
    outs = _run(emu, spec, _inputs(spec, 4 * (SLOTS + 1), 2, seed=2), skip_rank=1)
    assert torch.isnan(outs[0][0][: 4 * SLOTS]).all()  # every chunk reduced waits for rank 1
    assert int(emu.states[0, 2]) == int(ERR_TIMEOUT) | 0b10


def test_an_abort_word_stops_the_call_with_nan():
    spec = EpilogueSpec(hidden_size=64, top_k=2)
    emu = EmulatedRing(2, 4, 64)
    word = int(ERR_ABORTED) | (1 << 20) | 0b1
    emu.aborts.fill_(word)
    outs = _run(emu, spec, _inputs(spec, 3, 2, seed=3))
    for residual_out, norm_out, *_ in outs:
        assert torch.isnan(residual_out).all() and torch.isnan(norm_out).all()
    # rank 0 reports rank 1's abort; rank 1 finds its own (a sibling program's) timeout in it
    assert int(emu.states[0, 2]) == word and int(emu.states[1, 2]) == int(ERR_TIMEOUT) | 0b1


def _exact_inputs(spec, world, tokens, partial_values, residual_value):
    """Rank r's partial is exactly partial_values[r] everywhere (K=1, weight 1, routed scaling 1,
    no shared output); the residual is residual_value."""
    out = []
    for r in range(world):
        inp = make_inputs(
            spec, tokens, rank=r, device="cpu", skip_fraction=0.0, weight_dtype=torch.float32
        )
        inp.expanded_idx_to_permuted_idx.copy_(torch.arange(tokens, dtype=torch.int32)[:, None])
        inp.expert_weights.fill_(1.0)
        inp.gemm2_out.fill_(partial_values[r])
        inp.residual.fill_(residual_value)
        out.append(inp)
    return out


def test_partials_are_summed_in_rank_order():
    """Partials 1, 2^-24, 2^-24 and residual 2^-8: in rank order the fp32 sum stays 1 and 1 + 2^-8
    is a bf16 tie that rounds to 1.0; any other order reaches 1 + 2^-23 first and rounds to
    1 + 2^-7. Every owner (T = 3: one row each) must give 1.0."""
    spec = EpilogueSpec(hidden_size=64, top_k=1, routed_scaling_factor=1.0, has_shared_output=False)
    emu = EmulatedRing(3, 4, 64)
    outs = _run(emu, spec, _exact_inputs(spec, 3, 3, [1.0, 2.0**-24, 2.0**-24], 2.0**-8))
    assert not emu.states[:, 2].any()
    for ro, *_ in outs:
        assert (ro == 1.0).all(), ro[:, 0]


def test_negative_zero_never_leaves_a_rank_as_the_sentinel():
    """A partial that rounds to -0.0 would read as "not arrived": it is published as +0.0, so the
    call completes, and residual_out (residual -0.0 plus +0.0) is +0.0 on every rank."""
    spec = EpilogueSpec(hidden_size=64, top_k=1, routed_scaling_factor=1.0, has_shared_output=False)
    emu = EmulatedRing(2, 4, 64)
    inputs = _exact_inputs(spec, 2, 2, [-1e-20, -1e-20], -0.0)
    for inp in inputs:
        inp.expert_weights.fill_(1e-21)  # the partial -1e-41 rounds to bf16 -0.0
    outs = _run(emu, spec, inputs)
    assert not emu.states[:, 2].any(), emu.states
    for ro, *_ in outs:
        assert (ro.view(torch.int16) == 0).all()


def test_a_skipped_slot_weight_is_never_used():
    """perm == -1 slots carry NaN weights: they are dropped, not multiplied in."""
    spec = EpilogueSpec(hidden_size=64, top_k=4, routed_scaling_factor=2.5)
    emu = EmulatedRing(2, 4, 64)
    inputs = _inputs(spec, 5, 2, seed=9, weight_dtype=torch.float32)
    for inp in inputs:
        perm, w = inp.expanded_idx_to_permuted_idx, inp.expert_weights
        perm[:, -1] = -1
        w[:, -1] = float("nan")
    outs = _run(emu, spec, inputs)
    x64, _ = epilogue64_from(spec, inputs)
    assert not torch.isnan(outs[0][0]).any() and rel_err(outs[0][0], x64) <= math.sqrt(2) * U


def test_a_row_whose_squares_overflow_is_normalized_not_zeroed():
    """|x| ~ 1e25: the fp32 sum of squares overflows; the norm must still be x / rms * gamma."""
    spec = EpilogueSpec(hidden_size=64, top_k=1, routed_scaling_factor=1.0, has_shared_output=False)
    emu = EmulatedRing(2, 4, 64)
    inputs = _exact_inputs(spec, 2, 2, [0.0, 0.0], 1e25)
    outs = _run(emu, spec, inputs)
    _, norm64 = epilogue64_from(spec, inputs)
    assert rel_err(outs[0][1], norm64) <= math.sqrt(3) * U


def test_the_ring_buffer_does_not_grow_with_t_and_stays_under_64_mb():
    from fusion_bridge.kernels import symm_protocol

    for world in range(2, 9):
        nbytes = symm_protocol.ring_buffer_bytes(world, 7168, 2)
        assert nbytes <= 64 << 20, (world, nbytes)
    # 4 slots of W * ceil(256 / W) reduce-scatter rows and as many all-gather rows, after the header
    assert symm_protocol.ring_buffer_bytes(3, 64, 2) == 256 + 4 * 2 * 3 * 86 * 64 * 2


def test_the_ring_launch_exposes_no_test_hooks():
    import inspect

    from fusion_bridge.kernels import symm_ring

    hooks = {"EMU", "EMU_STAGE", "EMU_PID", "emulated", "phases"}
    assert not hooks & set(inspect.signature(symm_ring.launch).parameters)
    assert not hooks & set(inspect.signature(symm_ring.call_args).parameters)
    params = inspect.signature(symm_ring._ring_kernel.fn).parameters
    assert params["EMU"].default is False and params["EMU_STAGE"].default == 0


def test_a_missing_partial_is_reported_by_the_reduce_itself():
    """T = 1 at W = 2: the only row belongs to rank 0, so only rank 0's reduce waits on the missing
    rank 1 (its gather then receives the NaN row in time): the reduce must write the error word."""
    spec = EpilogueSpec(hidden_size=64, top_k=2)
    emu = EmulatedRing(2, 4, 64)
    outs = _run(emu, spec, _inputs(spec, 1, 2, seed=4), skip_rank=1)
    assert torch.isnan(outs[0][0]).all() and torch.isnan(outs[0][1]).all()
    assert int(emu.states[0, 2]) == int(ERR_TIMEOUT) | 0b10, hex(int(emu.states[0, 2]))


def test_eps_is_applied_and_an_all_zero_row_stays_zero():
    """Rows of rms ~0.01-0.03, where eps = 1e-2 shrinks norm_out about 3x, and an all-zero row (0
    with eps, NaN without), NaN / inf weights in skipped slots. Mutant killed: the ring's launch
    passing another eps than the spec's."""
    from tests.helpers import small_rows_and_a_zero_row

    spec = EpilogueSpec(hidden_size=96, top_k=4, eps=1e-2, weight_bias=0.5)
    inputs = small_rows_and_a_zero_row(spec, 2, 5, seed=23)
    _, norm = epilogue64_from(spec, inputs)
    _, without_eps = epilogue64_from(EpilogueSpec(hidden_size=96, top_k=4, eps=1e-9), inputs)
    rows = [0, 2, 3, 4]
    assert rel_err(without_eps[rows], norm[rows]) > 0.5  # the case observes eps
    outs = _run(EmulatedRing(2, 4, 96), spec, inputs)
    for residual_out, norm_out, _, _ in outs:
        assert (residual_out[1] == 0).all() and (norm_out[1] == 0).all()
        assert rel_err(norm_out, norm) <= math.sqrt(3) * U
