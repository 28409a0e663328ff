"""The two-shot's slot protocol under random interleavings of the ranks' launches (CPU
interpreter, W emulated ranks, 2 slots, several calls with changing T): whatever order the
launches of different ranks (and a rank's finalize launches against its row launches) run in,
within what the protocol's waits allow, every output is bitwise the one of the canonical global
order. Before each launch that releases a slot, the releasing rank's whole region of that slot is
overwritten with NaN bits, a superset of what the row launches' L2 drop may leave there: a slot
released too early, or a gate that lets a writer in too early, shows as a mismatch or NaN.

Each rank's launches are the production ones (`symm_twoshot._call_launches`: the same kernels and
arguments), in the production order of a two-stream call (`symm_twoshot._sequence`): the gate Q,
then per chunk the release-and-gate V(c), the next chunk's finalize F(c + 1) on its side stream,
X(c), R(c), Y(c), G(c), and Z. A sync launch
that waits (X, Y) is split into its signalling half and its waiting half, as the one-program
launch runs them in that order, and a waiting half runs only when its wait would already pass
(the interpreter cannot run two launches at once, so a wait must never spin). The test decides
when a wait would pass from the same counters and flags the kernels write, so it checks what the
launches release and signal and when, not the kernels' own wait conditions (a gate too weak in
the kernel is not caught here; tests/kernels/test_symm_twoshot.py checks the waits).
"""

from __future__ import annotations

import random

import pytest
import torch

from fusion_bridge.kernels.symm import protocol as P
from fusion_bridge.kernels.symm import twoshot as symm_twoshot
from fusion_bridge.kernels.symm.twoshot import TwoshotConfig
from fusion_bridge.kernels.symm.twoshot_kernels import FLAG_ARRIVED
from fusion_bridge.testing.symm_oneshot_rig import _interpreter_loop_bounds, call_records
from fusion_bridge.testing.symm_twoshot_rig import EmulatedTwoshot, twoshot_call, twoshot_layer
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.strategies.base import kernel_quant_args
from fusion_bridge.oracle.synthetic import make_inputs

HIDDEN, CHUNK, SLOTS = 64, 4, 2
SPEC = EpilogueSpec(hidden_size=HIDDEN, top_k=2, routed_scaling_factor=2.5)
NAN_BITS = 0x7FC1


def _layers(emu):
    scalars = (SPEC.routed_scaling_factor, SPEC.eps, SPEC.weight_bias)
    return [
        twoshot_layer(
            emu.ptrs[r], emu.states[r], emu.world, r, 1, 3, HIDDEN, scalars, kernel_quant_args(SPEC)
        )
        for r in range(emu.world)
    ]


def _poisoned_outputs(inputs):
    tokens = inputs[0].residual.shape[0]
    none = torch.empty(0, dtype=torch.uint8)
    nan = lambda: torch.full((tokens, HIDDEN), float("nan"), dtype=SPEC.dtype)
    return [(nan(), nan(), none, none) for _ in inputs]


def _slot_region(emu, slot: int) -> slice:
    """int16 elements of one rank's buffer that `slot` spans (its reduce and gather rows)."""
    rows = 2 * emu.world * -(-emu.chunk // emu.world)
    start = P.HEADER_BYTES // 2 + slot * rows * emu.hidden
    return slice(start, start + rows * emu.hidden)


class _Rank:
    """One rank's launches of one call, in `symm_twoshot._sequence`'s order: its rows stream (every
    launch but the finalize; a sync launch that waits split in two) and its finalize launches."""

    def __init__(self, emu, layer, records, config):
        calls = symm_twoshot._call_launches(layer, config, *records, emulated=True)
        self.emu, self.n, self.base = emu, len(calls.plans), int(emu.states[layer.rank][0])
        real_sync = calls.sync
        calls.sync = lambda c, signal=0, wait=0, release=None, advance=False, gate=(0, 0): (
            c,
            signal,
            wait,
            release,
            advance,
            gate,
        )  # the sequence's sync launches as what they do, split below
        self.rows, self.finalize = [], {}
        for stage, c, launch, gated in symm_twoshot._sequence(calls, split=False):
            if stage == "F":
                self.finalize[c] = launch
                continue
            # X(c) waits for F(c)'s event (symm_twoshot_streams.two_streams)
            needs_f = c if stage == "X" else None
            if not isinstance(launch, tuple):
                self.rows.append(dict(launch=launch, needs_f=needs_f, gated=gated))
                continue
            c, signal, wait, release, advance, gate = launch
            waits = wait != 0 or gate[1] > 0
            if signal or release is not None or (advance and not waits):
                first_half = real_sync(
                    c, signal=signal, release=release, advance=not waits and advance
                )
                self.rows.append(
                    dict(launch=first_half, needs_f=needs_f, gated=[], release=release)
                )
                needs_f = None
            if waits:
                second_half = real_sync(c, wait=wait, gate=gate, advance=advance)
                self.rows.append(
                    dict(
                        launch=second_half, needs_f=needs_f, gated=gated, wait=(wait, c), gate=gate
                    )
                )
        self.pos, self.gated, self.finalized = 0, set(), set()

    def _slot_free(self, chunk: int) -> bool:
        """Every rank released the slot's earlier uses (the gate's condition)."""
        seq = self.base + chunk
        need = (seq // SLOTS) * P.TWOSHOT_UNIT
        return all(int(f) >= need for f in self.emu.freed[:, seq % SLOTS])

    def _flags_up(self, flag: int, chunk: int) -> bool:
        byte = P.TWOSHOT_ARRIVED_BYTE if flag == FLAG_ARRIVED else P.TWOSHOT_REDUCED_BYTE
        seq = self.base + chunk
        return all(int(f) >= seq + 1 for f in self.emu.flags(byte)[:, seq % SLOTS])

    def next_row_ready(self) -> bool:
        if self.pos == len(self.rows):
            return False
        row = self.rows[self.pos]
        if row["needs_f"] is not None and row["needs_f"] not in self.finalized:
            return False
        flag, c = row.get("wait", (0, 0))
        lo, count = row.get("gate", (0, 0))
        gates_pass = all(self._slot_free(g) for g in range(lo, lo + count))
        return (flag == 0 or self._flags_up(flag, c)) and gates_pass

    def released_slot(self):
        """The slot the next row launch releases (None: it releases none)."""
        chunk = self.rows[self.pos].get("release")
        return None if chunk is None else (self.base + chunk) % SLOTS


def _random_order_call(emu, layers, inputs, rng, config):
    outs = _poisoned_outputs(inputs)
    ranks = [
        _Rank(emu, layer, call_records(i, o), config) for layer, i, o in zip(layers, inputs, outs)
    ]
    while True:
        ready = [(r, None) for r, k in enumerate(ranks) if k.next_row_ready()]
        ready += [
            (r, c)
            for r, k in enumerate(ranks)
            for c in k.finalize
            if c in k.gated and c not in k.finalized
        ]
        if not ready:
            stuck = [(r, k.pos) for r, k in enumerate(ranks) if k.pos < len(k.rows)]
            assert not stuck, f"no launch can run: every rank waits ({stuck})"
            return outs
        r, c = rng.choice(ready)
        rank = ranks[r]
        if c is not None:
            rank.finalize[c]()
            rank.finalized.add(c)
            continue
        slot = rank.released_slot()
        if slot is not None:  # what the row launches' L2 drop may leave, and more
            emu.bufs[r, _slot_region(emu, slot)] = NAN_BITS
        row = rank.rows[rank.pos]
        row["launch"]()
        rank.pos += 1
        rank.gated.update(row["gated"])


@pytest.mark.parametrize(
    "world,seed,token_counts",
    [(2, 1, (9, 2, 17, 1, 6)), (3, 2, (13, 3, 5)), (4, 3, (1, 1, 8, 13))],
    ids=["W2", "W3", "W4"],
)
def test_any_launch_order_the_waits_allow_gives_the_canonical_bits(world, seed, token_counts):
    config = TwoshotConfig(chunk=CHUNK, f_cols=64, slots=SLOTS)
    _interpreter_loop_bounds()
    one = lambda t, r: make_inputs(SPEC, t, rank=r, seed=t + 7, device="cpu", skip_fraction=0.3)
    calls = [[one(t, r) for r in range(world)] for t in token_counts]
    canonical_emu, random_emu = (EmulatedTwoshot(world, CHUNK, HIDDEN, SLOTS) for _ in range(2))
    canonical_layers, random_layers = _layers(canonical_emu), _layers(random_emu)
    rng = random.Random(seed)
    problems = []
    for k, inputs in enumerate(calls):
        want = _poisoned_outputs(inputs)
        per_rank = [call_records(i, o) for i, o in zip(inputs, want)]
        twoshot_call(canonical_layers, per_rank, config=config, emulated=True)
        got = _random_order_call(random_emu, random_layers, inputs, rng, config)
        for r in range(world):
            for i, name in enumerate(("residual_out", "norm_out")):
                if not torch.equal(want[r][i].view(torch.int16), got[r][i].view(torch.int16)):
                    problems.append(f"call {k} (T={token_counts[k]}) rank {r}: {name}")
    assert not random_emu.states[:, 2].any(), "a wait gave up (abort)"
    assert not problems, problems
