"""The two-shot symmetric-memory kernel (`kernels/symm_twoshot.py`) on CPU: its production kernel
body under TRITON_INTERPRET=1 (kernels/symm_testing), W ranks' buffers in host memory laid out as on
the GPU, one part of a call per launch (clear, push, reduce, gather, epoch; each on every rank), so
every wait finds what the earlier launches wrote. Only the GPU timer and fence are left out."""

import dataclasses
import math

import pytest
import torch

from fusion_bridge.kernels import symm_protocol as P
from fusion_bridge.kernels.quant_codes import QUANT_FP8, QUANT_NONE, QUANT_NVFP4, QuantArgs
from fusion_bridge.kernels.symm_protocol import ERR_ABORTED, ERR_TIMEOUT, SENTINEL_BITS
from fusion_bridge.kernels.symm_testing import emulated_group
from fusion_bridge.numerics import rel_err
from fusion_bridge.quant_ref import sf_shape
from fusion_bridge.spec import EpilogueSpec, SFLayout
from fusion_bridge.strategies.base import UNIT_ROUNDOFF
from fusion_bridge.strategies.symm_fused_oneshot import describe_error
from fusion_bridge.synthetic import make_inputs
from tests.helpers import garbage_weights_where_skipped, small_rows_and_a_zero_row

from tests.oracle64 import epilogue64_from, finalize64, quantize  # float64, imports nothing of ours

DEVICE = "cpu"
# The emulation is for the interpreter; on a GPU machine the compiled kernel itself is tested by
# test_gpu_symm_one_device.py and test_gpu_symm_twoshot.py.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter emulation; the GPU tests cover a GPU"
)
SCALE = {QUANT_NONE: 1.0, QUANT_FP8: 0.02, QUANT_NVFP4: 448 * 6 / 8.0}


def poisoned(shape, dtype):
    t = torch.empty(shape, dtype=dtype, device=DEVICE)
    t.view(torch.uint8).fill_(0xFF)  # NaN for float dtypes
    return t


class Emulated:
    """W ranks (kernels/symm_testing.EmulatedGroup); `call` runs one epilogue call part by part."""

    def __init__(self, spec, world, cap, quant=QUANT_NONE, layout=SFLayout.LINEAR, programs=3):
        self.spec, self.world, self.cap, self.quant, self.layout, self.programs = (
            spec,
            world,
            cap,
            quant,
            layout,
            programs,
        )
        self.group = emulated_group(
            "twoshot",
            spec,
            world,
            cap,
            quant=QuantArgs(quant, SCALE[quant], layout is SFLayout.SWIZZLED_128x4),
        )
        self.states = self.group.states

    def data(self):
        """Every rank's slots as int16 [W, elements]."""
        return torch.stack([self.group.data(r, torch.int16) for r in range(self.world)])

    def error(self, rank):
        word = int(self.group.errs[rank, 0])
        assert word == int(self.states[rank, P.STATE_ERROR])  # host word and device state agree
        return word

    def call(self, tokens, seed=0, skip_rank=None, inputs=None):
        spec, hidden = self.spec, self.spec.hidden_size
        if inputs is None:
            inputs = [
                make_inputs(spec, tokens, rank=r, seed=seed, device=DEVICE, skip_fraction=0.3)
                for r in range(self.world)
            ]
            # one TP group: every rank holds the same residual and gamma
            # NaN / inf weights in the skipped slots (allowed there; mutant killed: a skipped
            # slot's weight multiplied in instead of dropped)
            inputs = [
                garbage_weights_where_skipped(inp)._replace(
                    residual=inputs[0].residual, gamma=inputs[0].gamma
                )
                for inp in inputs
            ]
        self.inputs = inputs
        q_shape = {
            QUANT_NONE: (0,),
            QUANT_FP8: (tokens, hidden),
            QUANT_NVFP4: (tokens, hidden // 2),
        }
        self.outs = [
            (
                poisoned((tokens, hidden), spec.dtype),
                poisoned((tokens, hidden), spec.dtype),
                poisoned(q_shape[self.quant], torch.uint8),
                poisoned(
                    sf_shape(tokens, hidden, self.layout) if self.quant == QUANT_NVFP4 else (0,),
                    torch.uint8,
                ),
            )
            for _ in range(self.world)
        ]
        self.group.call(self.inputs, self.outs, skip_rank=skip_rank, programs=self.programs)
        return self.outs


def rounded_partials(inputs, spec):
    """Each rank's partial, computed in float64 and rounded once (the kernel accumulates in fp32:
    its
    rounding agrees except where the fp32 sum sits within 1e-7 of a tie)."""
    parts = []
    for inp in inputs:
        acc = finalize64(
            inp.gemm2_out,
            inp.expanded_idx_to_permuted_idx,
            inp.expert_weights,
            spec.routed_scaling_factor,
        )
        if inp.shared_output is not None:
            acc = acc + inp.shared_output.double()
        parts.append(acc.to(spec.dtype))
    return parts


CASES = [  # tokens, hidden, top_k, world, programs
    (1, 96, 8, 2, 1),
    (2, 160, 1, 2, 3),
    (13, 96, 8, 2, 3),
    (7, 320, 4, 3, 2),
    (9, 64, 2, 4, 2),
    (3, 96, 8, 4, 1),
    (5, 2880, 8, 2, 2),
]


@pytest.mark.parametrize("tokens,hidden,top_k,world,programs", CASES)
@pytest.mark.parametrize(
    "quant,layout",
    [
        (QUANT_NONE, SFLayout.LINEAR),
        (QUANT_FP8, SFLayout.LINEAR),
        (QUANT_NVFP4, SFLayout.SWIZZLED_128x4),
        (QUANT_NVFP4, SFLayout.LINEAR),
    ],
)
def test_every_rank_gets_the_same_bits_and_the_oracle_within_three_roundings(
    tokens, hidden, top_k, world, programs, quant, layout
):
    spec = EpilogueSpec(
        hidden_size=hidden,
        top_k=top_k,
        routed_scaling_factor=2.5,
        weight_bias=0.5,
        has_shared_output=(top_k != 2),
    )
    emu = Emulated(spec, world, cap=tokens + 2, quant=quant, layout=layout, programs=programs)
    outs = emu.call(tokens, seed=tokens * 31 + hidden + world)
    assert [emu.error(r) for r in range(world)] == [0] * world  # no wait failed
    # the last ticket of every rank advanced the epoch and recorded this slot's rows
    assert emu.states[:, P.STATE_SLOT].tolist() == [1] * world
    assert emu.states[:, P.STATE_ROWS].tolist() == [tokens] * world
    # bitwise identical on every rank (rows reduced by their owner, the rest gathered from it)
    for r in range(1, world):
        for mine, theirs in zip(outs[r], outs[0]):
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), (
                f"rank {r} differs"
            )
    residual_out, norm_out, q, sf = outs[0]
    x64, norm64 = epilogue64_from(spec, emu.inputs)
    u = UNIT_ROUNDOFF[spec.dtype]
    # the partial's rounding, residual_out's (the norm reads it) and norm_out's, in quadrature
    assert rel_err(residual_out, x64) <= math.sqrt(2) * u
    assert rel_err(norm_out, norm64) <= math.sqrt(3) * u
    # residual_out is one RNE rounding of the residual plus the rank-ordered fp32 sum of the rounded
    # partials
    parts = rounded_partials(emu.inputs, spec)
    summed = parts[0].float()
    for p in parts[1:]:
        summed = summed + p.float()
    expect = (emu.inputs[0].residual.float() + summed).to(spec.dtype)
    assert (
        residual_out != expect
    ).float().mean() <= 1e-3  # a near-tie partial may round the other way
    # the norm reads the rounded residual_out
    ro = residual_out.double()
    norm_of_ro = (
        ro
        / torch.sqrt(ro.pow(2).mean(-1, keepdim=True) + spec.eps)
        * (emu.inputs[0].gamma.double() + 0.5)
    )
    assert rel_err(norm_out, norm_of_ro) <= u
    # quantization reads the kernel's own rounded norm_out: bit-exact, padding included
    if quant == QUANT_FP8:
        assert torch.equal(q, quantize(norm_out, "fp8", SCALE[quant])[0].view(torch.uint8))
    if quant == QUANT_NVFP4:
        ref_q, ref_sf = quantize(norm_out, "nvfp4", SCALE[quant], layout is SFLayout.SWIZZLED_128x4)
        assert torch.equal(q, ref_q.view(torch.uint8)) and torch.equal(sf, ref_sf.view(torch.uint8))


def test_successive_calls_rotate_slots_and_clear_exactly_what_was_written():
    """Call 1 (T=7) in slot 0; call 2 (T=4) in slot 1 clears slot 0 as it goes (the 7 rows call 1
    recorded in device state); call 3 (T=1) in slot 2 clears slot 1: then slots 0 and 1 are all
    sentinel again, so nothing written was left behind."""
    spec = EpilogueSpec(hidden_size=96, top_k=4)
    emu = Emulated(spec, world=3, cap=8, programs=2)
    slot_len = P.slot_elems("twoshot", 3, 8, 96)
    first = emu.call(7, seed=1)
    assert (emu.data()[:, :slot_len] != SENTINEL_BITS).any()  # something was written
    assert (emu.data()[:, slot_len:] == SENTINEL_BITS).all()  # only into slot 0
    second = emu.call(4, seed=2)
    x64, norm64 = epilogue64_from(spec, emu.inputs)
    assert rel_err(second[1][1], norm64) <= math.sqrt(3) * UNIT_ROUNDOFF[spec.dtype]
    assert torch.equal(second[0][0], second[2][0]) and first[0][0].shape[0] == 7
    assert (emu.data()[:, :slot_len] == SENTINEL_BITS).all()  # slot 0 cleared
    assert (emu.data()[:, slot_len : 2 * slot_len] != SENTINEL_BITS).any()
    emu.call(1, seed=3)  # slot 2; clears slot 1
    assert (emu.data()[:, : 2 * slot_len] == SENTINEL_BITS).all()
    assert emu.states[:, P.STATE_SLOT].tolist() == [0, 0, 0]
    assert emu.states[0, P.STATE_ROWS :].tolist()[:3] == [7, 4, 1]


@pytest.mark.parametrize("world,skip", [(2, 1), (3, 0), (4, 2)])
def test_a_rank_that_never_arrives_gives_nan_and_names_it(world, skip):
    """The first rank whose wait runs out names the missing rank and aborts the group; every other
    rank reports that abort (naming the same missing rank) or, in its own later waits, the same."""
    spec = EpilogueSpec(hidden_size=64, top_k=2)
    emu = Emulated(spec, world, cap=8, quant=QUANT_NVFP4, layout=SFLayout.SWIZZLED_128x4)
    outs = emu.call(6, skip_rank=skip)
    first = min(r for r in range(world) if r != skip)  # ranks run in order: it waits first
    assert emu.error(first) == ERR_TIMEOUT | (1 << skip), hex(emu.error(first))
    for r in range(world):
        if r == skip:
            continue
        residual_out, norm_out, *_ = outs[r]
        assert torch.isnan(residual_out).all() and torch.isnan(norm_out).all()
        if r != first:
            aborted = ERR_ABORTED | (first << P.ERR_RANK_SHIFT) | (1 << skip)
            assert emu.error(r) == aborted, (r, hex(emu.error(r)))
    msg = describe_error(emu.error(first), rank=first, who="symm_fused_twoshot")
    assert f"timed out waiting for rank(s) [{skip}]" in msg


def test_an_abort_word_stops_the_call_with_nan():
    spec = EpilogueSpec(hidden_size=64, top_k=2)
    emu = Emulated(spec, 2, cap=4)
    word = ERR_ABORTED | (1 << P.ERR_RANK_SHIFT) | 0b1
    for r in range(2):
        emu.group.abort_word(r).fill_(word)
    outs = emu.call(3)
    for residual_out, norm_out, *_ in outs:
        assert torch.isnan(residual_out).all() and torch.isnan(norm_out).all()
    # rank 0 reports rank 1's abort; rank 1 finds its own (a sibling program's) timeout in it
    assert emu.error(0) == word and emu.error(1) == ERR_TIMEOUT | 0b1


def _exact_inputs(spec, world, tokens, partial_values, residual_value):
    """Inputs whose rank-r partial is exactly partial_values[r] in every element (K=1, weight 1,
    routed
    scaling 1, no shared output) and whose residual is residual_value."""
    out = []
    for r in range(world):
        inp = make_inputs(
            spec, tokens, rank=r, device=DEVICE, skip_fraction=0.0, weight_dtype=torch.float32
        )
        inp.expanded_idx_to_permuted_idx.copy_(
            torch.arange(tokens, dtype=torch.int32).view(tokens, 1)
        )
        inp.expert_weights.fill_(1.0)
        inp.gemm2_out.fill_(partial_values[r])
        inp.residual.fill_(residual_value)
        out.append(inp)
    return out


def _run_call(emu, spec, inputs, tokens):
    """One call of `inputs` (no shared output, no quant): each rank's (residual_out, norm_out)."""
    outs = emu.call(tokens, inputs=inputs)
    return [(ro, no) for ro, no, _, _ in outs]


def test_partials_are_summed_in_rank_order():
    """Partials 1, 2^-24, 2^-24 and residual 2^-8: in rank order the fp32 sum stays 1 and 1 + 2^-8
    is a bf16
    tie that rounds to 1.0; any other order reaches 1 + 2^-23 first and rounds to 1 + 2^-7. Every
    owner
    (T = 3: one row each) must give 1.0."""
    spec = EpilogueSpec(hidden_size=64, top_k=1, routed_scaling_factor=1.0, has_shared_output=False)
    emu = Emulated(spec, 3, cap=3)
    outs = _run_call(emu, spec, _exact_inputs(spec, 3, 3, [1.0, 2.0**-24, 2.0**-24], 2.0**-8), 3)
    assert [emu.error(r) for r in range(3)] == [0] * 3
    for ro, _ in outs:
        assert (ro == 1.0).all(), ro[:, 0]


def test_negative_zero_never_leaves_a_rank_as_the_sentinel():
    """A partial that rounds to -0.0 (a tiny negative value) would read as "not arrived": it is
    published
    as +0.0, so the call completes, and residual_out (residual -0.0 plus +0.0) is +0.0 on every
    rank."""
    spec = EpilogueSpec(hidden_size=64, top_k=1, routed_scaling_factor=1.0, has_shared_output=False)
    emu = Emulated(spec, 2, cap=2)
    inputs = _exact_inputs(spec, 2, 2, [-1e-20, -1e-20], -0.0)
    for inp in inputs:
        inp.expert_weights.fill_(1e-21)  # the partial -1e-41 rounds to bf16 -0.0
    outs = _run_call(emu, spec, inputs, 2)
    assert [emu.error(r) for r in range(2)] == [0, 0]  # nobody waited for a "missing" -0.0
    for ro, _ in outs:
        assert (ro.view(torch.int16) == 0).all()  # +0.0 everywhere, identical on both ranks


def test_eps_is_applied_and_an_all_zero_row_stays_zero():
    """Rows of rms ~0.01-0.03, where eps = 1e-2 shrinks norm_out about 3x, and an all-zero row (0
    with eps, NaN without). Mutants killed: the norm ignoring eps (in the building block, or the
    two-shot launch passing another eps)."""
    spec = EpilogueSpec(hidden_size=96, top_k=4, eps=1e-2, weight_bias=0.5)
    inputs = small_rows_and_a_zero_row(spec, 3, 5, seed=22, device=DEVICE)
    _, norm = epilogue64_from(spec, inputs)
    _, without_eps = epilogue64_from(dataclasses.replace(spec, eps=1e-9), inputs)
    rows = [0, 2, 3, 4]
    assert rel_err(without_eps[rows], norm[rows]) > 0.5  # the case observes eps
    emu = Emulated(spec, 3, cap=5, programs=2)
    outs = emu.call(5, inputs=inputs)
    assert [emu.error(r) for r in range(3)] == [0] * 3
    for residual_out, norm_out, _, _ in outs:
        assert (residual_out[1] == 0).all() and (norm_out[1] == 0).all()
        assert rel_err(norm_out, norm) <= math.sqrt(3) * UNIT_ROUNDOFF[spec.dtype]
