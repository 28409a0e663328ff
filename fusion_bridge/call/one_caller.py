"""One call at a time per bridge: a second thread's call while one runs is refused.

A bridge's calls are collectives: every rank of the group makes them in the same order, and each
pairs with its peers' call of the same number. Two threads calling one bridge at once make their
calls in whatever order the threads run, which differs between ranks, so calls pair with the peers'
*other* calls: plausible, wrong outputs. Nothing in a call can tell which call a peer is on
without a collective (debug mode makes that one), but a rank can tell that two of its own calls
overlap: `one_call_at_a_time` wraps `FusionBridge.finalize_epilogue` and refuses the second with
ConcurrentCallError.

The test is a flag with no lock: one token in a list, taken with `list.pop()` and given back with
`append()` in a `finally`, each one atomic in CPython (the GIL, or the list's own lock in a free-
threaded build), so of two threads that arrive together exactly one gets it. A refused call never
touched the group; on one rank that is all. With peers, they may have made the call this rank
refused, so this rank's next call would pair with their next one: the bridge refuses every later
call (`FusionBridge._break`, the failure protocol's broken state: rebuild on every rank).

It does not see two threads that call one after the other in different orders on different ranks
(nothing overlaps on a rank); the README states the contract: call each bridge from one thread, or
in the same order on every rank.
"""

from __future__ import annotations

import functools
import threading

import torch


class ConcurrentCallError(RuntimeError):
    """finalize_epilogue was called while another call of the same bridge was running."""


def one_call_at_a_time(method):
    """Wrap FusionBridge.finalize_epilogue: refuse a call that overlaps a running one (see the
    module docstring). Tracing under torch.compile runs no call (the custom op runs the eager call
    later), so it passes through."""

    @functools.wraps(method)
    def call(bridge, *args, **kwargs):
        if torch.compiler.is_compiling():
            return method(bridge, *args, **kwargs)
        tokens = bridge.__dict__.setdefault("_call_tokens", [True])
        try:
            token = tokens.pop()
        except IndexError:
            raise _refused(bridge) from None
        try:
            return method(bridge, *args, **kwargs)
        finally:
            tokens.append(token)

    return call


def _refused(bridge) -> ConcurrentCallError:
    error = ConcurrentCallError(
        f"finalize_epilogue: thread {threading.current_thread().name!r} called this FusionBridge "
        "while another thread's call of it was running. A bridge takes one call at a time: its "
        "calls are collectives that every rank makes in the same order, and calls from two "
        "threads pair with the other ranks' calls in different orders (wrong outputs, no error). "
        "Call each bridge from one thread, or serialize its calls in the same order on every rank."
    )
    if bridge.env.world_size > 1:
        bridge._break(error, "while another thread's call of this bridge ran (refused)")
    return error
