"""Test and benchmark entry points of the staged pipeline (`symm_staged`): one rank's launches of
a call, the syncs split into their signal and wait halves, and a call of W emulated ranks in one
global order (CPU interpreter or one GPU). Like `symm_testing`, reached by no production module."""

from __future__ import annotations

from typing import Optional, Sequence

from . import symm_protocol as P
from .symm_testing import _interpreter_loop_bounds

_STAGE_ORDER = {s: i for i, s in enumerate(("Q", "F", "A", "WA", "R", "D", "WD", "G", "P"))}


def staged_launches(
    layer: P.SymmLayer,
    tensors: dict,
    shape=None,
    emulated: bool = False,
    split: bool = True,
    region: int = 0,
) -> list:
    """One rank's launches of one staged call, not made: [(stage letter, chunk, callable)] in the
    rank's order; split: every sync as its halves (per chunk: Q gate, F finalize, A / WA signal /
    wait arrived, R reduce, D / WD signal / wait reduced, G gather, P release), else the
    production sequence (`symm_staged._sequence`). emulated: the interpreter's poll-count
    timer. region: as `symm_staged.launch` takes it."""
    from . import symm_staged

    shape = shape or symm_staged.DEFAULT_SHAPE
    calls = symm_staged._call_launches(layer, shape, tensors, emulated, region)
    return [(stage, c, fn) for stage, c, fn, _ in symm_staged._sequence(calls, split=split)]


def staged_call(
    layers: Sequence[P.SymmLayer],
    per_rank: Sequence[dict],
    shape=None,
    emulated: bool = False,
    skip_rank: Optional[int] = None,
    region: int = 0,
) -> None:
    """One call of the staged pipeline on W emulated ranks (CPU interpreter or one GPU): every
    rank's launches in ONE global order on the current stream, chunk by chunk and stage by stage
    (every rank's signals before any rank's wait), so every wait is for a launch made before it
    and no spinning launch holds SMs that an earlier one of a peer needs. per_rank[r]: rank r's
    tensors as symm_staged.launch takes them; skip_rank makes none of its launches."""
    queue = []
    for rank, (layer, tensors) in enumerate(zip(layers, per_rank)):
        if rank != skip_rank:
            for stage, c, fn in staged_launches(layer, tensors, shape, emulated, True, region):
                queue.append(((c, _STAGE_ORDER[stage], rank), fn))
    if emulated:
        _interpreter_loop_bounds()
    for _, fn in sorted(queue, key=lambda item: item[0]):
        fn()
