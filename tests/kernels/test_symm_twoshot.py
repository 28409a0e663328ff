"""The two-shot (`kernels/symm/twoshot.py`) on CPU: its very kernels under
TRITON_INTERPRET=1, with W ranks' buffers laid out as on the GPU (`EmulatedTwoshot`) and
every rank's launches in one global order (`symm_testing_twoshot.twoshot_call`: per chunk the gate,
F, the arrived signal then wait, R, the reduced signal then wait, G, the release, each stage on
every rank before the next), so every wait finds what earlier launches wrote. Small chunks (4-8
tokens) and narrow finalize items make T = 1, one chunk, chunks that do not divide T, a ring
turned several times within one call and chunks that W does not divide reachable at interpreter
speed."""

import math

import pytest
import torch

from fusion_bridge.kernels.symm.protocol import (
    ERR_ABORTED,
    ERR_RANK_SHIFT,
    ERR_TIMEOUT,
    TWOSHOT_ARRIVED_BYTE,
    TWOSHOT_REDUCED_BYTE,
)
from fusion_bridge.kernels.symm.twoshot import TwoshotConfig, call_plan
from fusion_bridge.kernels.symm.twoshot_device import MAX_SLOTS, UNIT
from fusion_bridge.testing.symm_oneshot_rig import _interpreter_loop_bounds
from fusion_bridge.testing.symm_twoshot_rig import EmulatedTwoshot
from fusion_bridge.testing.symm_twoshot_rig import twoshot_call, twoshot_launches, twoshot_layer
from fusion_bridge.oracle.numerics import rel_err
from fusion_bridge.spec import EpilogueSpec, QuantSpec, SFLayout
from fusion_bridge.strategies.base import UNIT_ROUNDOFF, kernel_quant_args
from fusion_bridge.oracle.synthetic import make_inputs

from tests.oracle64 import epilogue64_from, quantize  # float64, imports nothing of ours

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter emulation; the GPU tests cover a GPU"
)
U = UNIT_ROUNDOFF[torch.bfloat16]
GUARD_ROWS = 16  # rows past T a wrong row count could reach (chunk + W at most, in these cases)
SLOTS = MAX_SLOTS  # EmulatedTwoshot's default: 4 slots (the production 2: test_calls_at_changing_t)
QUANTS = {
    "none": QuantSpec.none(),
    "fp8": QuantSpec.fp8(0.02),
    "nvfp4_swizzled": QuantSpec.nvfp4(448 * 6 / 8.0, SFLayout.SWIZZLED_128x4),
    "nvfp4_linear": QuantSpec.nvfp4(448 * 6 / 8.0, SFLayout.LINEAR),
}


def _inputs(spec, tokens, world, seed, **kw):
    return [
        make_inputs(spec, tokens, rank=r, seed=seed, device="cpu", skip_fraction=0.3, **kw)
        for r in range(world)
    ]


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


def _run(emu, spec, inputs, skip_rank=None, max_polls=3, f_cols=64, merged=False):
    """One call on every emulated rank; outputs poisoned (NaN / 0xFF) first. merged (W = 1):
    the production sequence, the syncs not split."""
    from fusion_bridge.epilogue_tensors import quant_buffers
    from fusion_bridge.testing.symm_oneshot_rig import call_records

    tokens, hidden = inputs[0].residual.shape
    scalars = (spec.routed_scaling_factor, spec.eps, spec.weight_bias)
    layers = [
        twoshot_layer(
            emu.ptrs[r],
            emu.states[r],
            emu.world,
            r,
            1,
            max_polls,
            hidden,
            scalars,
            kernel_quant_args(spec),
        )  # fmt: skip
        for r in range(emu.world)
    ]
    outs, guards = [], []
    for _ in inputs:
        q, sf = quant_buffers(tokens, hidden, spec.quant.kind, spec.quant.sf_layout, "cpu")
        # every output poisoned (NaN / 0xFF) and followed by poisoned rows (a whole 128-row tile
        # for swizzled scales), so a row launch that writes past T fails the check below instead
        # of corrupting the heap (a process abort that names nothing)
        swizzled = spec.quant.sf_layout is SFLayout.SWIZZLED_128x4
        got = [
            _guarded((tokens, hidden), spec.dtype),
            _guarded((tokens, hidden), spec.dtype),
            _guarded(() if q is None else q.shape, torch.uint8),
            _guarded(() if sf is None else sf.shape, torch.uint8, 128 if swizzled else GUARD_ROWS),
        ]
        outs.append(tuple(view for view, _ in got))
        guards.append(got)
    per_rank = [call_records(inp, out) for inp, out in zip(inputs, outs)]
    config = TwoshotConfig(chunk=emu.chunk, f_cols=f_cols, slots=emu.slots)
    if merged:
        _interpreter_loop_bounds()
        for _, _, fn in twoshot_launches(
            layers[0], per_rank[0], config, emulated=True, split=False
        ):
            fn()
    else:
        twoshot_call(layers, per_rank, config=config, emulated=True, skip_rank=skip_rank)
    for rank, got in enumerate(guards):
        for name, (view, full) in zip(("residual_out", "norm_out", "quant", "scale"), got):
            past = full[view.shape[0] :].reshape(-1).view(torch.uint8)
            assert (past == 0xFF).all(), f"rank {rank} wrote {name} past its {view.shape[0]} rows"
    return outs


def _guarded(shape, dtype, extra=None):
    """(a [shape] view, the poisoned buffer it starts) with `extra` poisoned rows after the view
    (GUARD_ROWS by default); shape () is an unused output: an empty tensor."""
    if not shape:
        empty = torch.empty(0, dtype=dtype)
        return empty, empty
    full = torch.empty((shape[0] + (extra or GUARD_ROWS), *shape[1:]), dtype=dtype)
    full.view(torch.uint8).fill_(0xFF)  # NaN for the activations
    return full[: shape[0]], full


CASES = [  # tokens, hidden, top_k, world, chunk
    (1, 96, 8, 2, 4),  # T = 1: one partial chunk, rank 1 owns nothing
    (4, 96, 4, 2, 4),  # exactly one chunk
    (7, 160, 1, 3, 4),  # W does not divide the chunk; the last chunk partial
    (21, 96, 8, 4, 4),  # 6 chunks: the 4-slot ring turns within the call
    (9, 64, 2, 8, 8),  # W = 8, one owner row per chunk and rank
    # H not a power of two, many finalize items per row (11 of 64 columns, a 1024-column row block
    # with its tail masked). Was H=2880 (GPT-OSS: 45 items, a 4096-column block): the same lines
    # and masks, at 3.5x the interpreter's time (the GPU tests run model widths).
    (3, 704, 8, 2, 4),
]
LONG = {(21, 4), (3, 2), (9, 8)}  # run without quantization only (interpreter time)


@pytest.mark.parametrize(
    "tokens,hidden,top_k,world,chunk,quant",
    [c + (q,) for c in CASES for q in QUANTS if q == "none" or (c[0], c[3]) not in LONG],
)
def test_every_rank_gets_the_same_bits_and_the_oracle_within_three_roundings(
    tokens, hidden, top_k, world, chunk, quant
):
    spec = EpilogueSpec(
        hidden_size=hidden, top_k=top_k, routed_scaling_factor=2.5, weight_bias=0.5,
        quant=QUANTS[quant], has_shared_output=(top_k != 2),
    )  # fmt: skip
    emu = EmulatedTwoshot(world, chunk, hidden)
    inputs = _inputs(spec, tokens, world, seed=tokens * 31 + hidden + world)
    outs = _run(emu, spec, inputs)
    assert not emu.states[:, 2].any(), emu.states  # no wait failed
    for r in range(1, world):  # bitwise identical on every rank
        for mine, theirs in zip(outs[r], outs[0]):
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), f"rank {r}"
    residual_out, norm_out, q, sf = outs[0]
    x64, norm64 = epilogue64_from(spec, inputs)
    assert rel_err(residual_out, x64) <= math.sqrt(2) * U
    assert rel_err(norm_out, norm64) <= math.sqrt(3) * U
    if quant == "fp8":  # quantization reads the kernel's own norm_out: bit-exact
        assert torch.equal(q, quantize(norm_out, "fp8", spec.quant.scale)[0].view(torch.uint8))
    if quant.startswith("nvfp4"):
        swizzled = quant == "nvfp4_swizzled"
        ref_q, ref_sf = quantize(norm_out, "nvfp4", spec.quant.global_scale, swizzled)
        assert torch.equal(q, ref_q.view(torch.uint8)) and torch.equal(sf, ref_sf.view(torch.uint8))
    # the base advanced by the call's chunks rounded up to whole turns of the ring (the next call
    # starts on slot 0); every sequence number, the skipped ones too, released exactly one unit
    # on every rank; each rank's flags of a slot show the last chunk that used it (sequence + 1)
    chunks = -(-tokens // chunk)
    turns = -(-chunks // SLOTS)
    assert emu.states[:, 0].tolist() == [turns * SLOTS] * world
    assert emu.freed.tolist() == [[turns * UNIT] * SLOTS] * world
    last = [max(range(s, chunks, SLOTS), default=-1) + 1 for s in range(SLOTS)]
    assert emu.flags(TWOSHOT_ARRIVED_BYTE).tolist() == [last] * world
    assert emu.flags(TWOSHOT_REDUCED_BYTE).tolist() == [last] * world


@pytest.mark.parametrize("merged", [False, True], ids=["split", "production"])
def test_world_of_one_reuses_the_slots(merged):
    """W = 1 (no G) over 6 chunks (the 4 slots reused), the syncs split and as the production
    sequence merges them (one gate for the first 4 chunks, V(c) releasing chunk c - 1 and gating
    chunk c + 3 right after R(c - 1), one final release)."""
    spec = EpilogueSpec(hidden_size=160, top_k=4, routed_scaling_factor=2.5)
    emu = EmulatedTwoshot(1, 4, 160)
    inputs = _inputs(spec, 21, 1, seed=3)
    outs = _run(emu, spec, inputs, merged=merged)
    x64, norm64 = epilogue64_from(spec, inputs)
    assert not emu.states[0, 2], hex(int(emu.states[0, 2]))
    assert rel_err(outs[0][0], x64) <= math.sqrt(2) * U
    assert rel_err(outs[0][1], norm64) <= math.sqrt(3) * U
    assert emu.states[0, 0] == 8  # 6 chunks, rounded up to two turns of the 4 slots
    assert emu.freed[0].tolist() == [2 * UNIT] * 4  # sequences 6 and 7 released unused
    assert emu.flags(TWOSHOT_ARRIVED_BYTE)[0].tolist() == [5, 6, 3, 4]  # sequence + 1


def test_calls_at_changing_t_share_one_ring():
    """Calls of T = 9, 2, 17, 1, 6 through 2 slots: the base carries over (rounded up to a turn
    of the ring at each call's end, so every call starts on slot 0), every call right."""
    spec = EpilogueSpec(hidden_size=64, top_k=4, routed_scaling_factor=2.5)
    world, chunk = 3, 4
    emu = EmulatedTwoshot(world, chunk, 64, slots=2)  # the production slot count
    total = 0
    for tokens in (9, 2, 17, 1, 6):
        inputs = _inputs(spec, tokens, world, seed=tokens)
        outs = _run(emu, spec, inputs)
        x64, norm64 = epilogue64_from(spec, inputs)
        assert not emu.states[:, 2].any(), (tokens, emu.states)
        assert rel_err(outs[1][1], norm64) <= math.sqrt(3) * U, tokens
        assert torch.equal(outs[0][0].view(torch.int16), outs[2][0].view(torch.int16)), tokens
        total += -(-tokens // chunk // 2) * 2
        assert emu.states[:, 0].tolist() == [total] * world
        assert emu.freed[:, :2].tolist() == [[total // 2 * UNIT] * 2] * world


@pytest.mark.parametrize("world,skip", [(2, 1), (3, 0), (4, 2)])
def test_a_rank_that_never_arrives_gives_nan_and_names_it(world, skip):
    hidden = 160
    spec = EpilogueSpec(hidden_size=hidden, top_k=2, quant=QUANTS["nvfp4_swizzled"])
    emu = EmulatedTwoshot(world, 8, hidden)
    outs = _run(emu, spec, _inputs(spec, 6, world, seed=1), skip_rank=skip)
    for r in range(world):
        if r == skip:
            continue
        residual_out, norm_out, *_ = outs[r]
        assert torch.isnan(residual_out).all() and torch.isnan(norm_out).all(), r
        err = int(emu.states[r, 2])
        assert err & (1 << skip) and err & (int(ERR_TIMEOUT) | int(ERR_ABORTED)), hex(err)
    first = [int(e) for e in emu.states[:, 2] if int(e) & int(ERR_TIMEOUT)]
    assert first and all(e == int(ERR_TIMEOUT) | (1 << skip) for e in first), first


def test_a_missing_rank_stops_the_ring_too():
    """T spans more chunks than slots: the live rank's gate, waiting for the missing rank's release
    of the slot it is about to reuse, too ends in the error word."""
    spec = EpilogueSpec(hidden_size=64, top_k=2)
    emu = EmulatedTwoshot(2, 4, 64)
    outs = _run(emu, spec, _inputs(spec, 4 * (SLOTS + 1), 2, seed=2), skip_rank=1)
    assert torch.isnan(outs[0][0][: 4 * SLOTS]).all()
    assert int(emu.states[0, 2]) == int(ERR_TIMEOUT) | 0b10


def test_the_late_rank_whose_waits_are_already_met_still_reports_the_abort():
    """Rank 0 calls alone and times out (the abort word on both ranks); rank 1's delayed call
    then finds every flag and release it waits for already there (rank 0 signalled and released
    every chunk before each wait), so no wait of its own fails: its rows are NaN, and its sync
    launches must still write the error word from the abort word, or its next call would not
    raise."""
    spec = EpilogueSpec(hidden_size=64, top_k=2)
    emu = EmulatedTwoshot(2, 4, 64)
    inputs = _inputs(spec, 8, 2, seed=3)
    _run(emu, spec, inputs, skip_rank=1)
    assert int(emu.states[0, 2]) == int(ERR_TIMEOUT) | 0b10
    assert not int(emu.states[1, 2])
    outs = _run(emu, spec, inputs, skip_rank=0)
    assert torch.isnan(outs[1][0]).all() and torch.isnan(outs[1][1]).all()
    err = int(emu.states[1, 2])
    assert err & int(ERR_ABORTED) and err & 0b10, hex(err)


def test_partials_are_summed_in_rank_order():
    """Partials 1, 2^-24, 2^-24 and residual 2^-8: in rank order the fp32 sum stays 1 and 1 + 2^-8
    is a bf16 tie that rounds to 1.0; any other order reaches 1 + 2^-23 first and rounds to
    1 + 2^-7."""
    spec = EpilogueSpec(hidden_size=64, top_k=1, routed_scaling_factor=1.0, has_shared_output=False)
    emu = EmulatedTwoshot(3, 4, 64)
    outs = _run(emu, spec, _exact_inputs(spec, 3, 3, [1.0, 2.0**-24, 2.0**-24], 2.0**-8))
    assert not emu.states[:, 2].any()
    for ro, *_ in outs:
        assert (ro == 1.0).all(), ro[:, 0]


def test_the_plan_covers_every_row_once():
    """call_plan's grids: finalize items for every owner row and column block, owned + other rows
    = the chunk's rows, at W = 1 no other rows."""
    for tokens, world, chunk in ((1, 2, 4), (7, 3, 4), (1000, 8, 256), (5, 1, 2)):
        config = TwoshotConfig(chunk=chunk, f_cols=64)
        for rank in range(world):
            plans = call_plan(tokens, world, rank, 100, config)
            assert len(plans) == -(-tokens // chunk)
            for p in plans:
                n_c = min(chunk, tokens - p.index * chunk)
                assert p.own_rows == len(range(rank, n_c, world))
                assert p.own_rows + p.other_rows == n_c
                assert p.f_items == world * -(-n_c // world) * 2


@pytest.mark.parametrize(
    "field,value",
    [("chunk", 0), ("slots", 1), ("slots", 5)],
)
def test_a_bad_twoshot_shape_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"{field}: expected .* got"):
        TwoshotConfig(**{field: value})


def _sync(emu, rank, c, timeout=3, **flags):
    """One sync launch of rank `rank` at chunk c (`symm_twoshot_kernels._sync_kernel`)."""
    from fusion_bridge.kernels.symm.protocol import TwoshotSlots
    from fusion_bridge.kernels.symm.twoshot_kernels import Pipeline, SyncSteps, _sync_kernel

    _interpreter_loop_bounds()  # the gate loops over launch args (range(gate_lo, gate_lo + gate_n))
    steps = SyncSteps(**(dict(SIGNAL=0, WAIT=0, RELEASE=False, ADVANCE=False, GATE=False) | flags))
    gate = (c, 1) if steps.GATE else (0, 0)
    args = (emu.ptrs[rank], emu.states[rank], c, c, *gate, 8, rank, timeout)
    args += (TwoshotSlots(emu.hidden, emu.chunk),)
    pipe = Pipeline(WORLD=emu.world, SLOTS=emu.slots, L2=0, USE_PDL=False, EMU=True)
    _sync_kernel[(1,)](*args, PIPE=pipe, STEPS=steps, NAN_BITS=0x7FC0)


def test_the_gate_waits_for_every_rank_to_release_the_slot():
    """The gate alone: chunk 4 of a call at base 0 reuses slot 0, so it needs one unit on slot 0's
    counter of every rank. Rank 1's counter short of it: the gate ends in the error word naming
    rank 1; at one unit: no error."""
    emu = EmulatedTwoshot(2, 4, 64)
    emu.freed[0, 0] = UNIT
    _sync(emu, 0, 4, GATE=True)
    assert int(emu.states[0, 2]) == int(ERR_TIMEOUT) | 0b10, hex(int(emu.states[0, 2]))
    emu = EmulatedTwoshot(2, 4, 64)
    emu.freed[:, 0] = UNIT
    _sync(emu, 0, 4, GATE=True)
    assert int(emu.states[0, 2]) == 0 and int(emu.aborts[1]) == 0


@pytest.mark.parametrize("flag,byte", [(1, TWOSHOT_ARRIVED_BYTE), (2, TWOSHOT_REDUCED_BYTE)])
def test_a_flag_wait_needs_every_rank_at_this_chunk(flag, byte):
    """The arrival / reduced wait of chunk 5 at base 2 (slot 3) needs every rank's flag of slot 3
    at 8 (the sequence number 7 + 1): a rank at 4 (its previous use of the slot, chunk 3) is
    named in the error word; the signal writes 8 on its own rank only; every rank at 8: no
    error. The waiting rank's later row launches then see the abort word."""
    emu = EmulatedTwoshot(3, 4, 64)
    emu.states[:, 0] = 2
    emu.flags(byte)[:, 3] = 4
    _sync(emu, 1, 5, SIGNAL=flag, WAIT=flag)
    assert emu.flags(byte)[:, 3].tolist() == [4, 8, 4]
    assert int(emu.states[1, 2]) == int(ERR_TIMEOUT) | 0b101, hex(int(emu.states[1, 2]))
    assert (emu.aborts != 0).all()
    emu = EmulatedTwoshot(3, 4, 64)
    emu.states[:, 0] = 2
    emu.flags(byte)[:, 3] = 8
    _sync(emu, 2, 5, WAIT=flag)
    assert int(emu.states[2, 2]) == 0 and not emu.aborts.any()


def test_a_flag_wait_stops_at_once_when_a_peer_has_aborted():
    """Rank 1 aborted (its abort word, copied to every rank, already set): rank 0's arrival wait
    must stop at once, not wait out its whole timeout (60 s by default on a GPU) for a flag that
    will not come. Under the interpreter the timeout is a poll count, so the time is the measure:
    the aborted wait, given 16 times the polls, must end sooner than a plain wait that runs out 64
    polls (at once: a few milliseconds against the run-out wait's hundreds; waiting it out: about
    16 times longer). Both end in the error word: the timeout, or the peer's abort."""
    import time

    _interpreter_loop_bounds()  # the failed wait poisons the partials: a loop over a launch arg
    emu = EmulatedTwoshot(2, 4, 64)
    start = time.perf_counter()
    _sync(emu, 0, 1, timeout=64, SIGNAL=1, WAIT=1)
    ran_out = time.perf_counter() - start
    assert int(emu.states[0, 2]) == int(ERR_TIMEOUT) | 0b10, hex(int(emu.states[0, 2]))
    emu = EmulatedTwoshot(2, 4, 64)
    word = int(ERR_ABORTED) | (1 << ERR_RANK_SHIFT) | 0b01  # rank 1 timed out waiting for rank 0
    emu.aborts[:] = word
    start = time.perf_counter()
    _sync(emu, 0, 1, timeout=64 * 16, SIGNAL=1, WAIT=1)
    aborted = time.perf_counter() - start
    assert int(emu.states[0, 2]) == word, hex(int(emu.states[0, 2]))
    assert aborted < ran_out, (
        f"the aborted wait took {aborted:.3f} s, a 64-poll one {ran_out:.3f} s"
    )


def test_the_twoshot_launch_exposes_no_test_hooks():
    import inspect

    from fusion_bridge.kernels.symm import twoshot as symm_twoshot

    hooks = {"emulated", "launch_order", "EMU", "phases"}
    for verb in ("__init__", "__call__", "bound", "config_for"):
        method = getattr(symm_twoshot.TwoshotLauncher, verb)
        assert not hooks & set(inspect.signature(method).parameters), verb


def test_a_skipped_slot_weight_is_never_used():
    """perm == -1 slots carry NaN weights: they are dropped, not multiplied in."""
    spec = EpilogueSpec(hidden_size=64, top_k=4, routed_scaling_factor=2.5)
    emu = EmulatedTwoshot(2, 4, 64)
    inputs = _inputs(spec, 5, 2, seed=9, weight_dtype=torch.float32)
    for inp in inputs:
        perm, w = inp.expanded_idx_to_permuted_idx, inp.expert_weights
        perm[:, -1] = -1
        w[:, -1] = float("nan")
    outs = _run(emu, spec, inputs)
    x64, _ = epilogue64_from(spec, inputs)
    assert not torch.isnan(outs[0][0]).any() and rel_err(outs[0][0], x64) <= math.sqrt(2) * U


def test_a_row_whose_squares_overflow_is_normalized_not_zeroed():
    """|x| up to 3e30: the fp32 sum of squares overflows; the norm must still be x / rms * gamma."""
    spec = EpilogueSpec(
        hidden_size=160, top_k=1, routed_scaling_factor=1.0, has_shared_output=False
    )
    emu = EmulatedTwoshot(2, 4, 160)
    inputs = _exact_inputs(spec, 2, 2, [0.0, 0.0], 1e25)
    for inp in inputs:
        inp.residual[:, 64:128] = 3e30
        inp.residual[:, 128:] = -1e20
    outs = _run(emu, spec, inputs)
    _, norm64 = epilogue64_from(spec, inputs)
    for _, norm_out, *_ in outs:
        assert not torch.isnan(norm_out).any() and (norm_out != 0).all()
        assert rel_err(norm_out, norm64) <= math.sqrt(3) * U


def test_eps_is_applied_and_an_all_zero_row_stays_zero():
    """Rows of rms ~0.01-0.03, where eps = 1e-2 shrinks norm_out about 3x, and an all-zero row (0
    with eps, NaN without), NaN / inf weights in skipped slots. Mutant killed: the launch passing
    another eps than the spec's."""
    from tests.helpers import small_rows_and_a_zero_row

    spec = EpilogueSpec(hidden_size=96, top_k=4, eps=1e-2, weight_bias=0.5)
    inputs = small_rows_and_a_zero_row(spec, 2, 5, seed=23)
    _, norm = epilogue64_from(spec, inputs)
    _, without_eps = epilogue64_from(EpilogueSpec(hidden_size=96, top_k=4, eps=1e-9), inputs)
    rows = [0, 2, 3, 4]
    assert rel_err(without_eps[rows], norm[rows]) > 0.5  # the case observes eps
    outs = _run(EmulatedTwoshot(2, 4, 96), spec, inputs)
    for residual_out, norm_out, _, _ in outs:
        assert (residual_out[1] == 0).all() and (norm_out[1] == 0).all()
        assert rel_err(norm_out, norm) <= math.sqrt(3) * U


def test_a_workspace_refuses_a_second_slot_layout():
    """Its release counters count uses per slot, and another chunk size's slots overlap these:
    a call laid out otherwise than the workspace's first raises, naming both, before it launches
    anything (not a gate that times out or passes early); the same layout with other fields runs."""
    spec = EpilogueSpec(hidden_size=64, top_k=2)
    emu = EmulatedTwoshot(1, 4, 64, slots=2)
    inputs = [make_inputs(spec, 5, device="cpu", skip_fraction=0.0)]
    outs = _run(emu, spec, inputs)  # chunk 4, 2 slots: the workspace's layout from now on
    assert not torch.isnan(outs[0][1]).any()
    scalars = (spec.routed_scaling_factor, spec.eps, spec.weight_bias)
    layer = twoshot_layer(
        emu.ptrs[0], emu.states[0], 1, 0, 1, 3, 64, scalars, kernel_quant_args(spec)
    )
    from fusion_bridge.testing.symm_oneshot_rig import call_records

    records = call_records(inputs[0], outs[0])
    for other in (TwoshotConfig(chunk=4, slots=3), TwoshotConfig(chunk=8, slots=2)):
        with pytest.raises(ValueError, match=r"must be \(4, 2\).*got \((4, 3|8, 2)\)"):
            twoshot_launches(layer, records, other, emulated=True)
    assert twoshot_launches(
        layer, records, TwoshotConfig(chunk=4, slots=2, f_cols=32), emulated=True
    )
