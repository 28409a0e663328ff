"""`symm_fused_oneshot` on CPU: the production kernel body under TRITON_INTERPRET=1 with W ranks
emulated in one process (kernels/symm_testing: publish, clear, reduce + norm and the epoch advance
run part by part on every rank; only the GPU timer and fence are left out), its capability checks on
Environment values, and the symmetric-memory API it calls (drift)."""

import dataclasses
import inspect
import math

import pytest
import torch
import triton
import triton.language as tl

from fusion_bridge.environment import Environment
from fusion_bridge.kernels.symm import protocol as P
from fusion_bridge.kernels.quant import row_block
from fusion_bridge.kernels.quant_codes import QUANT_FP8, QUANT_NONE, QUANT_NVFP4, QuantArgs
from fusion_bridge.kernels.rounding import round_to
from fusion_bridge.kernels.tp1.configs import TP1_PDL, tp1_config
from fusion_bridge.kernels.symm.protocol import ONESHOT
from fusion_bridge.kernels.symm.oneshot import OneshotConfig, default_config
from fusion_bridge.kernels.symm.protocol import ERR_ABORTED, ERR_TIMEOUT, SENTINEL_BITS
from fusion_bridge.testing.symm_oneshot_rig import call_records, emulated_group, launch_with_hooks
from fusion_bridge.oracle.numerics import rel_err
from fusion_bridge.oracle.quant_ref import quantize_fp8, quantize_nvfp4, sf_shape
from fusion_bridge.spec import EpilogueSpec, QuantSpec, SFLayout, Stage
from fusion_bridge.strategies import symm_workspace as sw
from fusion_bridge.strategies.base import UNIT_ROUNDOFF
from fusion_bridge.strategies.symm_fused_oneshot import SymmFusedOneshotStrategy, describe_error
from fusion_bridge.oracle.synthetic import make_inputs
from tests.helpers import garbage_weights_where_skipped, small_rows_and_a_zero_row

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GOOD_ENV = Environment(
    device_type="cuda", sm=90, gpu_name="H200", world_size=2, triton_version="3.6.0"
)
SCALE = {QUANT_NONE: 1.0, QUANT_FP8: 0.02, QUANT_NVFP4: 448 * 6 / 8.0}
# the emulation runs the production kernel body part by part under the interpreter; on a GPU
# machine the compiled kernel is tested by test_symm_oneshot_emulated_on_one_gpu.py and
# test_symm_oneshot_two_gpus.py
emulation = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter emulation; the GPU tests cover a GPU"
)


def poisoned(shape, dtype):
    t = torch.empty(shape, dtype=dtype, device=DEVICE)
    t.view(torch.uint8).fill_(0xFF)  # NaN for float dtypes
    return t


def oracle64(per_rank, spec):
    """float64: partials [W, T, H], residual_out, norm_out of the exact math (no rounding at
    all)."""
    partials = []
    for inp in per_rank:
        perm, w = inp.expanded_idx_to_permuted_idx.long(), inp.expert_weights.double()
        g = inp.gemm2_out.double()
        acc = torch.zeros(perm.shape[0], g.shape[1], dtype=torch.float64, device=g.device)
        for t in range(perm.shape[0]):
            for k in range(perm.shape[1]):
                if perm[t, k] >= 0:
                    acc[t] += w[t, k] * g[perm[t, k]]
        acc *= spec.routed_scaling_factor
        if inp.shared_output is not None:
            acc += inp.shared_output.double()
        partials.append(acc)
    x = per_rank[0].residual.double() + sum(partials)
    norm = (
        x
        / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + spec.eps)
        * (per_rank[0].gamma.double() + spec.weight_bias)
    )
    return torch.stack(partials), x, norm


def outputs(spec, tokens, quant, layout):
    hidden = spec.hidden_size
    q_shape = {QUANT_NONE: (0,), QUANT_FP8: (tokens, hidden), QUANT_NVFP4: (tokens, hidden // 2)}
    return (
        poisoned((tokens, hidden), spec.dtype),
        poisoned((tokens, hidden), spec.dtype),
        poisoned(q_shape[quant], torch.uint8),
        poisoned(sf_shape(tokens, hidden, layout) if quant == QUANT_NVFP4 else (0,), torch.uint8),
    )


class Group:
    """W emulated ranks of the one-shot kernel (kernels/symm_testing) and one call's results."""

    def __init__(self, spec, world, cap, quant=QUANT_NONE, layout=SFLayout.LINEAR, max_polls=3):
        self.spec, self.world, self.quant, self.layout = spec, world, quant, layout
        swizzled = layout is SFLayout.SWIZZLED_128x4
        self.g = emulated_group(
            spec,
            world,
            cap,
            timeout=max_polls,
            quant=QuantArgs(quant, SCALE[quant], swizzled),
        )

    def call(self, tokens, config=None, seed=0, skip_rank=None, parts=None, programs=None):
        self.inputs = [
            make_inputs(self.spec, tokens, rank=r, seed=seed, device=DEVICE, skip_fraction=0.3)
            for r in range(self.world)
        ]
        # one TP group: every rank holds the same residual and gamma
        # NaN / inf weights in the skipped slots (allowed there; mutant killed: a skipped slot's
        # weight multiplied in instead of dropped)
        self.inputs = [
            garbage_weights_where_skipped(inp)._replace(
                residual=self.inputs[0].residual, gamma=self.inputs[0].gamma
            )
            for inp in self.inputs
        ]
        self.outs = [outputs(self.spec, tokens, self.quant, self.layout) for _ in range(self.world)]
        self.g.call(self.inputs, self.outs, parts, skip_rank, programs, config)
        return self.outs

    def slot(self, rank, slot):
        return self.g.slot(rank, slot, self.spec.dtype)

    def error(self, rank):
        """The error word in the host word and in device state (the kernel writes both)."""
        word = int(self.g.errs[rank, 0])
        assert word == int(self.g.states[rank, P.STATE_ERROR])
        return word


# tokens, hidden, top_k, world, block1, block2 (block2 >= H: whole rows; else each program of a row
# reads the whole row and stores its chunk)
CASES = [
    (1, 96, 8, 2, 64, 64),
    (3, 160, 1, 2, 64, 1024),
    (5, 96, 8, 3, 64, 64),
    (4, 256, 2, 2, 128, 64),
    (2, 320, 8, 2, 64, 192),
    (0, 96, 8, 2, 64, 64),
]


@emulation
@pytest.mark.parametrize("tokens,hidden,top_k,world,block1,block2", CASES)
@pytest.mark.parametrize(
    "quant,layout",
    [
        (QUANT_NONE, SFLayout.LINEAR),
        (QUANT_FP8, SFLayout.LINEAR),
        (QUANT_NVFP4, SFLayout.SWIZZLED_128x4),
        (QUANT_NVFP4, SFLayout.LINEAR),
    ],
)
def test_emulated_ranks_match_the_float64_oracle(
    tokens, hidden, top_k, world, block1, block2, quant, layout
):
    spec = EpilogueSpec(
        hidden_size=hidden,
        top_k=top_k,
        routed_scaling_factor=2.5,
        weight_bias=0.5,
        has_shared_output=(top_k != 2),
    )
    grp = Group(spec, world, max(tokens, 1), quant, layout)
    outs = grp.call(
        tokens, OneshotConfig(block1, block2, 4), seed=tokens * 13 + hidden + world, programs=3
    )
    assert [grp.error(r) for r in range(world)] == [0] * world
    if tokens == 0:
        assert not grp.g.states.any()  # T == 0 launches nothing: the epoch stays
        return
    # every rank's epoch advanced once and recorded this slot's rows
    assert grp.g.states[:, P.STATE_SLOT].tolist() == [1] * world
    assert grp.g.states[:, P.STATE_ROWS].tolist() == [tokens] * world
    partials, x, norm = oracle64(grp.inputs, spec)
    u = UNIT_ROUNDOFF[spec.dtype]
    # the partial is rounded once to bf16 (fp32 accumulation adds ~1e-7): norm-wise at most u; every
    # slot was written on every rank (no sentinel left), and a read of a skipped slot's NaN row
    # would make it NaN
    slots = grp.slot(0, 0)[:, :tokens]
    for r in range(world):
        assert torch.equal(grp.slot(r, 0)[:, :tokens].view(torch.int16), slots.view(torch.int16))
    assert not (slots.view(torch.int16) == SENTINEL_BITS).any()
    assert torch.isfinite(slots).all()
    assert rel_err(slots, partials) <= u
    residual_out, norm_out, q, sf = outs[0]
    # residual_out, norm_out: the partial's rounding + the output's, independent, in quadrature
    for got, ref in ((residual_out, x), (norm_out, norm)):
        assert torch.isfinite(got).all()
        assert rel_err(got, ref) <= math.sqrt(2) * u
    # residual_out is exactly one RNE rounding of the rank-ordered fp32 sum of the rounded partials
    summed = slots[0].float()
    for r in range(1, world):
        summed = summed + slots[r].float()
    assert torch.equal(residual_out, (grp.inputs[0].residual.float() + summed).to(spec.dtype))
    # every rank's outputs are bitwise identical
    for r in range(1, world):
        for a, b in zip(outs[0], outs[r]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # quantization reads the kernel's own rounded norm_out: bit-exact against the reference, padding
    # included
    if quant == QUANT_FP8:
        assert torch.equal(q, quantize_fp8(norm_out, SCALE[quant]).view(torch.uint8))
    if quant == QUANT_NVFP4:
        ref_q, ref_sf = quantize_nvfp4(norm_out, SCALE[quant], layout)
        assert torch.equal(q, ref_q)
        assert torch.equal(sf, ref_sf)


@emulation
def test_model_width_single_token():
    """H=7168 (DeepSeek-V3), T=1, K=8, split into the default launch's column chunks (each program
    of the row reads the whole row for its sum of squares and stores its chunk)."""
    spec = EpilogueSpec(hidden_size=7168, top_k=8, routed_scaling_factor=2.5)
    config = default_config(16, 7168)
    assert config.block2 < 7168  # the row is split
    grp = Group(spec, 2, 1, QUANT_NVFP4, SFLayout.SWIZZLED_128x4)
    residual_out, norm_out, q, sf = grp.call(1, config)[0]
    partials, x, norm = oracle64(grp.inputs, spec)
    u = UNIT_ROUNDOFF[spec.dtype]
    assert rel_err(norm_out, norm) <= math.sqrt(2) * u
    assert rel_err(residual_out, x) <= math.sqrt(2) * u
    ref_q, ref_sf = quantize_nvfp4(norm_out, SCALE[QUANT_NVFP4], SFLayout.SWIZZLED_128x4)
    assert torch.equal(q, ref_q) and torch.equal(sf, ref_sf)


@emulation
def test_chunked_and_whole_row_norms_are_bitwise_equal():
    """The row's sum of squares comes from the whole row either way, so launch variants (and hence
    ranks, which all launch the same variant) agree bit for bit."""
    spec = EpilogueSpec(hidden_size=160, top_k=4)
    a = Group(spec, 2, 3).call(3, OneshotConfig(64, 64, 4), seed=5)[0]
    b = Group(spec, 2, 3).call(3, OneshotConfig(64, row_block(160), 4), seed=5)[0]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_default_config_spreads_small_t_and_keeps_whole_rows_at_large_t():
    assert default_config(1, 7168) == (1024, 8192, 8)  # 7 publish programs, one writes the row
    assert default_config(16, 7168) == (1024, 896, 8)  # 112 publish items, 8 programs per row
    assert default_config(64, 7168) == (8192, 3584, 8)  # 2 programs per row
    assert default_config(256, 7168) == (8192, 7168, 8)
    # world size 1 (no SM count: whole rows): 16 warps per 8192 columns at every T (measured, see
    # whole_row_warps), no prefetch; programmatic dependent launch as TP1_PDL says (the exchange
    # kernel's configs never ask for it)
    assert tp1_config(1, 7168) == (8192, 16, 0, TP1_PDL)
    assert tp1_config(1024, 7168) == (8192, 16, 0, TP1_PDL)
    assert tp1_config(16, 4096) == (4096, 8, 0, TP1_PDL)
    for tokens in (1, 3, 16, 64, 129, 256):
        for hidden in (7168, 4096, 2880, 96):
            b1, b2 = default_config(tokens, hidden)[:2]
            assert b1 in (1024, row_block(hidden)) and b2 % 64 == 0 and b2 <= row_block(hidden)


@emulation
def test_negative_zero_payload_is_published_as_positive_zero():
    """A partial that rounds to -0.0 would read as "not arrived": it is published as +0.0, which
    changes no sum. fp16: weight 1e-4 times -1e-4 is -1e-8 in fp32 (nonzero, so the accumulator
    really is negative) and rounds to fp16 -0.0 (below half the smallest subnormal, 6e-8).
    Mutant killed: the -0.0 -> +0.0 mapping removed (then the slot holds the sentinel)."""
    spec = EpilogueSpec(
        hidden_size=64,
        top_k=1,
        dtype=torch.float16,
        routed_scaling_factor=1.0,
        has_shared_output=False,
    )
    inputs = [make_inputs(spec, 2, rank=r, device=DEVICE, skip_fraction=0.0) for r in range(2)]
    for inp in inputs:
        inp.gemm2_out.fill_(-1e-4)
        inp.expert_weights.fill_(1e-4)
        inp.residual.fill_(1.0)
        inp.gamma.fill_(1.0)
    partial = inputs[0].gemm2_out[0, 0].float() * inputs[0].expert_weights[0, 0].float()
    assert partial < 0 and partial.half().view(torch.int16) == SENTINEL_BITS  # really -0.0
    inputs = [inp._replace(residual=inputs[0].residual, gamma=inputs[0].gamma) for inp in inputs]
    grp = Group(spec, 2, 2, max_polls=3)
    outs = [outputs(spec, 2, QUANT_NONE, SFLayout.LINEAR) for _ in range(2)]
    grp.g.call(inputs, outs, (P.PUBLISH | P.FINALIZE,))
    for r in range(2):
        assert (grp.slot(r, 0).view(torch.int16)[:, :2] == 0).all()  # +0.0, never the sentinel
    grp.g.call(inputs, outs, (P.CLEAR, P.REDUCE | P.NORM, P.EPOCH))
    assert [grp.error(r) for r in range(2)] == [0, 0]  # nobody waited for a sentinel
    for residual_out, norm_out, _, _ in outs:
        assert (residual_out == 1.0).all() and (norm_out == 1.0).all()


def _exact_inputs(spec, world, tokens, partial_values, residual_value):
    """Inputs whose rank-r partial is exactly partial_values[r] in every element (K=1, weight 1,
    routed scaling 1, no shared output) and whose residual is residual_value."""
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
        out.append(inp)
    out[0].residual.fill_(residual_value)
    return [inp._replace(residual=out[0].residual, gamma=out[0].gamma) for inp in out]


@emulation
def test_partials_are_summed_in_rank_order():
    """Partials 1, 2^-24, 2^-24 and residual 2^-8: in rank order the fp32 sum stays 1 and 1 + 2^-8
    is a bf16 tie that rounds to 1.0; any other order reaches 1 + 2^-23 first and rounds to
    1 + 2^-7. Every rank must give 1.0. Mutant killed: the partials summed in reverse rank order."""
    spec = EpilogueSpec(hidden_size=64, top_k=1, routed_scaling_factor=1.0, has_shared_output=False)
    grp = Group(spec, 3, 2)
    inputs = _exact_inputs(spec, 3, 2, [1.0, 2.0**-24, 2.0**-24], 2.0**-8)
    outs = [outputs(spec, 2, QUANT_NONE, SFLayout.LINEAR) for _ in range(3)]
    grp.g.call(inputs, outs, programs=2)
    assert [grp.error(r) for r in range(3)] == [0] * 3
    for residual_out, _, _, _ in outs:
        assert (residual_out == 1.0).all(), residual_out[:, 0]


@emulation
def test_eps_is_applied_and_an_all_zero_row_stays_zero():
    """Rows of rms ~0.01-0.03, where eps = 1e-2 shrinks norm_out about 3x, and an all-zero row (0
    with eps, NaN without). Mutants killed: the norm ignoring eps (in the building block, or the
    one-shot launch passing another eps)."""
    spec = EpilogueSpec(hidden_size=96, top_k=4, eps=1e-2, weight_bias=0.5)
    inputs = small_rows_and_a_zero_row(spec, 2, 4, seed=21, device=DEVICE)
    _, x, norm = oracle64(inputs, spec)
    _, _, without_eps = oracle64(inputs, dataclasses.replace(spec, eps=1e-9))
    assert rel_err(without_eps[[0, 2, 3]], norm[[0, 2, 3]]) > 0.5  # the case observes eps
    grp = Group(spec, 2, 4)
    outs = [outputs(spec, 4, QUANT_NONE, SFLayout.LINEAR) for _ in range(2)]
    grp.g.call(inputs, outs, config=OneshotConfig(64, 64, 4), programs=2)
    assert [grp.error(r) for r in range(2)] == [0, 0]
    for residual_out, norm_out, _, _ in outs:
        assert (residual_out[1] == 0).all() and (norm_out[1] == 0).all()
        assert rel_err(norm_out, norm) <= math.sqrt(2) * UNIT_ROUNDOFF[spec.dtype]


@emulation
def test_a_clear_never_touches_what_a_rank_one_call_ahead_published():
    """Rank 1 finishes call A and publishes call B (into every rank's next slot) before rank 0 has
    even cleared for A: the protocol allows a rank to run one call ahead. Rank 0's clear must leave
    rank 1's B partial alone, so both ranks finish B without a timeout, with the oracle's values.
    Mutant killed: the one-shot (also) clearing the next call's slot, a no-op when ranks run in
    step."""
    spec = EpilogueSpec(hidden_size=96, top_k=4)
    grp = Group(spec, 2, 3, max_polls=3)
    calls = []
    for seed in (1, 2):
        inputs = [
            garbage_weights_where_skipped(make_inputs(spec, 3, rank=r, seed=seed, device=DEVICE))
            for r in range(2)
        ]
        inputs = [i._replace(residual=inputs[0].residual, gamma=inputs[0].gamma) for i in inputs]
        calls.append((inputs, [outputs(spec, 3, QUANT_NONE, SFLayout.LINEAR) for _ in range(2)]))

    def part(call, rank, phases):
        inputs, outs = calls[call]
        launch_with_hooks(
            grp.g.layers[rank],
            *call_records(inputs[rank], outs[rank]),
            config=OneshotConfig(64, 64, 4),
            phases=phases,
            emulated=True,
            programs=2,
        )

    publish, clear, reduce, epoch = P.PUBLISH | P.FINALIZE, P.CLEAR, P.REDUCE | P.NORM, P.EPOCH
    part(0, 0, publish)
    part(0, 1, publish)
    for phases in (clear, reduce, epoch, publish):  # rank 1: the rest of A, then B's publish
        part(0 if phases != publish else 1, 1, phases)
    for call, phases in [(0, clear), (0, reduce), (0, epoch)] + [(1, p) for p in (publish, clear)]:
        part(call, 0, phases)
    for phases in (reduce, epoch):
        part(1, 0, phases)
    for phases in (clear, reduce, epoch):
        part(1, 1, phases)
    assert [grp.error(r) for r in range(2)] == [0, 0]
    assert grp.g.states[:, P.STATE_SLOT].tolist() == [2, 2]
    for inputs, outs in calls:
        _, x, norm = oracle64(inputs, spec)
        for residual_out, norm_out, _, _ in outs:
            assert rel_err(residual_out, x) <= math.sqrt(2) * UNIT_ROUNDOFF[spec.dtype]
            assert rel_err(norm_out, norm) <= math.sqrt(2) * UNIT_ROUNDOFF[spec.dtype]


@emulation
def test_each_call_clears_exactly_the_previous_calls_slot_and_rows():
    """Call 1 (T=3) writes slot 0; call 2 (T=2) writes slot 1 and clears slot 0 (the 3 rows call 1
    recorded in device state); call 3 (T=1) writes slot 2 and clears slot 1. Nothing written is left
    behind, and nothing else is touched: the rows past T stay the sentinel throughout."""
    spec = EpilogueSpec(hidden_size=96, top_k=8)
    grp = Group(spec, 3, 4)

    def sentinel(rank, slot):
        return grp.slot(rank, slot).view(torch.int16) == SENTINEL_BITS

    for call, (tokens, written, cleared) in enumerate([(3, 0, None), (2, 1, 0), (1, 2, 1)]):
        grp.call(tokens, OneshotConfig(64, 64, 4), seed=call, programs=2)
        assert grp.g.states[:, P.STATE_SLOT].tolist() == [(call + 1) % 3] * 3
        for r in range(3):
            assert not sentinel(r, written)[:, :tokens].any()  # every source's rows arrived
            assert sentinel(r, written)[:, tokens:].all()
            if cleared is not None:
                assert sentinel(r, cleared).all()


@emulation
@pytest.mark.parametrize(
    "quant,layout,tokens,programs",
    [
        (QUANT_NONE, SFLayout.LINEAR, 3, 2),
        (QUANT_NVFP4, SFLayout.SWIZZLED_128x4, 3, 2),
        (QUANT_NONE, SFLayout.LINEAR, 1, 1),  # one wait: the word is the first timeout's own
    ],
)
def test_a_rank_that_never_publishes_times_out_with_nan_and_names_it(
    quant, layout, tokens, programs
):
    """Rank 1 of 3 skips the call: the bounded poll ends, every output is NaN; rank 0 times out
    naming rank 1 (and only rank 1) and aborts the group, so rank 2 reports rank 0's abort."""
    spec = EpilogueSpec(hidden_size=160, top_k=2)
    grp = Group(spec, 3, 3, quant, layout)
    config = OneshotConfig(64, 64 if programs > 1 else 256, 4)
    outs = grp.call(tokens, config, seed=9, skip_rank=1, programs=programs)
    assert grp.error(0) == ERR_TIMEOUT | 0b10, hex(grp.error(0))
    assert grp.error(2) == ERR_ABORTED | (0 << P.ERR_RANK_SHIFT) | 0b10, hex(grp.error(2))
    for r in (0, 2):
        assert torch.isnan(outs[r][0]).all() and torch.isnan(outs[r][1]).all()
        assert int(grp.g.abort_word(r)) == ERR_ABORTED | 0b10  # later calls stop at once
    assert "timed out waiting for rank(s) [1]" in describe_error(grp.error(0), rank=0)


@emulation
def test_an_abort_word_stops_the_call_with_nan_even_when_the_data_is_there():
    spec = EpilogueSpec(hidden_size=96, top_k=2)
    grp = Group(spec, 2, 2)
    word = ERR_ABORTED | (0 << P.ERR_RANK_SHIFT) | 0b10
    for r in range(2):
        grp.g.abort_word(r).fill_(word)
    outs = grp.call(2, OneshotConfig(64, 64, 4))
    for residual_out, norm_out, *_ in outs:
        assert torch.isnan(residual_out).all() and torch.isnan(norm_out).all()
    # rank 1 reports rank 0's abort; rank 0 finds its own (earlier) timeout in it
    assert grp.error(1) == word and grp.error(0) == ERR_TIMEOUT | 0b10
    assert "rank 1 stopped because rank 0 timed out" in describe_error(word, rank=1)


# ---- capability checks (pure: Environment values, injected probe and process environment) ----
def codes(spec, env, probe=lambda: None):
    return {r.code for r in sw.reasons(spec, env, "symm_fused_oneshot", probe=probe)}


def test_supported_on_h200_tp2():
    spec = EpilogueSpec(hidden_size=7168, top_k=8)
    assert codes(spec, GOOD_ENV) == set()
    for world in (2, 4, 8):
        assert codes(spec, GOOD_ENV.replace(world_size=world)) == set()


def test_missing_symmetric_memory_is_a_coded_reason():
    spec = EpilogueSpec(hidden_size=7168, top_k=8)
    reasons = sw.reasons(spec, GOOD_ENV, "symm_fused_oneshot", probe=lambda: "no module named x")
    assert [r.code for r in reasons] == ["symm_mem_unavailable"]
    assert "no module named x" in reasons[0].message


def test_every_reason_is_collected():
    spec = EpilogueSpec(hidden_size=20000, top_k=8)
    env = Environment(device_type="cpu", world_size=1, single_node=False, triton_interpret=True)
    got = codes(spec, env, probe=lambda: "absent")
    assert got == {
        "needs_cuda",
        "triton_missing",
        "multi_node_group",
        "triton_interpreter",
        "symm_mem_unavailable",
        "world_size_unsupported",
        "hidden_too_large",
    }
    assert codes(EpilogueSpec(hidden_size=7168, top_k=8), GOOD_ENV.replace(sm=80)) == {"sm_too_low"}
    assert codes(EpilogueSpec(hidden_size=7168, top_k=8), GOOD_ENV.replace(world_size=16)) == {
        "world_size_unsupported"
    }


def test_strategy_declarations():
    spec = EpilogueSpec(hidden_size=7168, top_k=8, quant=QuantSpec.nvfp4(100.0), max_tokens=8192)
    cls = SymmFusedOneshotStrategy
    assert cls.self_tested
    (step,) = cls.steps(spec, GOOD_ENV)
    assert step.stages == (
        Stage.FINALIZE,
        Stage.SHARED_ADD,
        Stage.ALL_REDUCE,
        Stage.RESIDUAL_NORM,
        Stage.QUANT,
    )
    assert cls.error_bound(spec, GOOD_ENV) == pytest.approx(math.sqrt(3) * 2.0**-8)
    assert (
        cls.max_tokens_per_call(spec, GOOD_ENV) == ONESHOT.max_cap_tokens
    )  # larger T overflows elsewhere
    assert (
        cls.max_tokens_per_call(EpilogueSpec(hidden_size=7168, top_k=8, max_tokens=64), GOOD_ENV)
        == 64
    )
    assert "variant" in inspect.signature(cls.run).parameters
    # the buffer: 3 rotating slots x W sources x cap tokens x H, plus a 256-byte header (abort word)
    assert sw.buffer_bytes(spec, 2) == 3 * 2 * 2048 * 7168 * 2 + 256


def test_error_words_name_the_missing_rank():
    msg = describe_error(int(ERR_TIMEOUT) | 0b10, rank=0)
    assert "rank 0 timed out" in msg and "[1]" in msg and "rebuild the bridge" in msg.lower()
    msg = describe_error(int(ERR_ABORTED) | (0 << 20) | 0b10, rank=1)
    assert "rank 1 stopped because rank 0 timed out" in msg and "[1]" in msg
    # rank 0 missing (bit 0), alone and with others; mutant killed: the mask read from bit 1 up
    assert "timed out waiting for rank(s) [0]," in describe_error(int(ERR_TIMEOUT) | 0b1, rank=1)
    msg = describe_error(int(ERR_TIMEOUT) | 0b1001, rank=2)
    assert "timed out waiting for rank(s) [0, 3]," in msg
    msg = describe_error(int(ERR_ABORTED) | (2 << 20) | 0b1, rank=1)
    assert "rank 1 stopped because rank 2 timed out waiting for rank(s) [0] " in msg


# ---- API drift: what we call in torch's private symmetric-memory module ----
def test_symmetric_memory_api_drift():
    symm_mem = pytest.importorskip("torch.distributed._symmetric_memory")
    assert sw.probe_symm_mem() is None
    assert {"dtype", "device"} <= set(inspect.signature(symm_mem.empty).parameters)
    assert list(inspect.signature(symm_mem.rendezvous).parameters)[:2] == ["tensor", "group"]
    for attr in sw.HANDLE_API:
        assert hasattr(symm_mem._SymmetricMemory, attr)


@triton.jit
def _round_kernel(x_ptr, y_ptr):
    i = tl.arange(0, 4)
    tl.store(y_ptr + i, round_to(tl.load(x_ptr + i), tl.bfloat16))


def test_rounding_keeps_the_gpus_canonical_nan():
    """The GPU's arithmetic NaN is 0x7FFFFFFF; integer RNE rounding would carry it into the sign bit
    (-0.0, measured as a non-NaN norm_out after a timeout). The rounding keeps it NaN."""
    x = torch.tensor(
        [0x7FFFFFFF, 0x7FC00000, 0x3F800000, -0x80000000], dtype=torch.int32, device=DEVICE
    )
    y = torch.empty(4, dtype=torch.bfloat16, device=DEVICE)
    _round_kernel[(1,)](x.view(torch.float32), y)
    assert (
        torch.isnan(y[:2]).all()
        and y[2].item() == 1.0
        and y.view(torch.int16)[3].item() == SENTINEL_BITS
    )


def test_launch_config_variants_for_tune():
    """The exchange kernel's launch configs are variants `tune` measures: declared by the strategy
    (the twoshot subclass declares its own: test_symm_twoshot_cpu), each a valid config (64-column
    multiples within the row block), "default" is the per-T rule, an unknown name is refused."""
    from fusion_bridge.kernels.symm.oneshot_configs import CONFIG_VARIANTS, variant_config
    from fusion_bridge.strategies import symm_fused_oneshot as so
    from fusion_bridge.strategies.symm_fused_twoshot import SymmFusedTwoshotStrategy

    spec = EpilogueSpec(hidden_size=7168, top_k=8)
    env = Environment(device_type="cuda", sm=90, world_size=2, triton_version="3.6.0")
    assert so.CONFIG_VARIANTS == CONFIG_VARIANTS
    assert so.SymmFusedOneshotStrategy.variants(spec, env) == ("default",) + CONFIG_VARIANTS
    assert "pub512" not in SymmFusedTwoshotStrategy.variants(spec, env)
    for tokens in (1, 16, 64, 256):
        assert variant_config("default", tokens, 7168, 132, 2) is None
        configs = {v: variant_config(v, tokens, 7168, 132, 2) for v in CONFIG_VARIANTS}
        assert configs["rows"][:2] == (8192, 8192)
        assert configs["pub512"][:2] == (512, 8192)
        assert configs["pub1024"][:2] == (1024, default_config(tokens, 7168, 132).block2)
        assert all(s.block1 % 64 == 0 and s.block2 % 64 == 0 for s in configs.values())
    with pytest.raises(ValueError, match="unknown launch variant 'wide'"):
        variant_config("wide", 1, 7168, 132, 2)
