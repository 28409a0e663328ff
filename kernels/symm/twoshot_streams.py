"""The two-shot's streams (`symm_twoshot`): a call's finalize launches on side streams, every
other launch on the rows stream, tied by CUDA events (graph capture sees a closed fork / join)."""

from __future__ import annotations

import threading

import torch

_SIDE = threading.local()


def _side_stream(device, index: int = 0, high_priority: bool = False) -> torch.cuda.Stream:
    """This thread's side stream `index` of a device and priority (-100: the highest the device
    offers), taken once from torch's stream pool. The pool hands streams out round-robin, so
    another thread or library may get the same CUDA stream: that only orders their work after
    ours. Two calls on one workspace must not be in flight at once in any case (one call at a
    time per workspace, in the same order on every rank: the chunk base is read and advanced on
    the device)."""
    streams = _SIDE.__dict__.setdefault("streams", {})
    key = (device, index, high_priority)
    if key not in streams:
        streams[key] = torch.cuda.Stream(device=device, priority=-100 if high_priority else 0)
    return streams[key]


def two_streams(device, seq, prio, f_streams=1):
    """F on side streams (chunk c on side stream c % f_streams), everything else on the rows stream
    (the caller's, or with `prio` a high-priority stream forked from it: the block scheduler then
    gives a ready R / G its SMs before the next finalize's; CUDA graphs keep the priority per
    kernel node): F(c) waits for the event of the launch that gated its slot (the first gate Q,
    V(c - 1) or X(c - 1)), X(c) for F(c)'s. With two F streams F(c + 1) needs nothing of F(c), so
    its programs fill the SMs F(c)'s last ones leave. seq: `symm_twoshot._sequence`'s launches."""
    main = torch.cuda.current_stream(device)
    sides = [_side_stream(device, i) for i in range(f_streams)]
    rows = _side_stream(device, high_priority=True) if prio else main
    for side in sides:
        side.wait_stream(main)
    if prio:
        rows.wait_stream(main)
    gates, f_done = {}, {}
    for stage, c, fn, gated in seq:
        if stage == "F":
            side = sides[c % f_streams]
            with torch.cuda.stream(side):
                side.wait_event(gates.pop(c))
                fn()
                f_done[c] = torch.cuda.Event()
                f_done[c].record(side)
            continue
        with torch.cuda.stream(rows):
            if stage == "X":  # X(c) signals that F(c)'s rows are written
                rows.wait_event(f_done.pop(c))
            fn()
            if gated:
                ev = torch.cuda.Event()
                ev.record(rows)
                gates.update(dict.fromkeys(gated, ev))
    if prio:  # the caller's stream joins the rows stream (it waited for every F already)
        main.wait_stream(rows)
