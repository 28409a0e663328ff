"""One call at a time per bridge: a second thread's call while one runs is refused.

A bridge's calls are collectives: every rank of the group makes them in the same order, and each
pairs with its peers' call of the same number. Two threads calling one bridge at once make their
calls in whatever order the threads run, which differs between ranks, so calls pair with the peers'
*other* calls: plausible, wrong outputs. Nothing in a call can tell which call a peer is on
without a collective (debug mode makes that one), but a rank can tell that two of its own calls
overlap: `one_call_at_a_time` wraps `FusionBridge.finalize_epilogue` and refuses the second with
ConcurrentCallError.

The test is a flag with no lock: one token in a list, taken with `list.pop()` and given back with
`append()` in a `finally`, each of them atomic in CPython (under the GIL, and by the list's own lock
in a free-threaded build), so of two threads that arrive together exactly one gets it. A refused
call never touched the group; on one rank that is all. With peers, they may have made the call
this rank refused, so this rank's next call would pair with their next one: the bridge refuses
every later call (`FusionBridge._break`, the failure protocol's broken state: rebuild on every
rank).

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
    module docstring). The wrapper has the method's own parameters (a forwarding of *args and
    **kwargs costs more than the flag), so it serves that one method. Under torch.compile's
    tracing it passes the call through: tracing runs no call (the compiled graph's custom op
    makes the eager call later, through here), and a traced token would be a list mutation that
    the compiled code replays."""

    @functools.wraps(method)
    def finalize_epilogue(
        bridge, gemm2_out, expanded_idx_to_permuted_idx, expert_weights, shared_output, residual,
        gamma,
    ):  # fmt: skip
        if torch.compiler.is_dynamo_compiling():
            return method(
                bridge, gemm2_out, expanded_idx_to_permuted_idx, expert_weights, shared_output,
                residual, gamma,
            )  # fmt: skip
        held = bridge.__dict__
        tokens = held.get("_call_tokens") or held.setdefault("_call_tokens", [True])
        try:
            token = tokens.pop()
        except IndexError:
            raise _refused(bridge) from None
        try:
            return method(
                bridge, gemm2_out, expanded_idx_to_permuted_idx, expert_weights, shared_output,
                residual, gamma,
            )  # fmt: skip
        finally:
            tokens.append(token)

    return finalize_epilogue


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
