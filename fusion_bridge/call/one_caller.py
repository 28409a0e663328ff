"""One call at a time per process group: a call from a second thread while one runs is refused.

A bridge's calls are collectives: every rank of the group makes them in the same order, and each
pairs with its peers' call of the same number. Two threads calling bridges of one process group at
once (one bridge, or two layers' bridges on the same group) make their collectives in whatever
order the threads run, which differs between ranks, so calls pair with the peers' *other* calls:
plausible, wrong outputs. Nothing in a call can tell which call a peer is on without a collective
(debug mode makes that one), but a rank can tell that two of its own calls on one group overlap:
`enter` takes the group's slot for the calling thread and refuses a second thread's call with
ConcurrentCallError while another thread holds it.

The slot is one entry of a dict keyed by the process group (the default group under both of its
names; a single-process bridge by itself, as it has no peers), holding the calling thread's id, set
with `dict.setdefault` (atomic in CPython, under the GIL and in a free-threaded build) and removed
by `leave`. It holds the thread's id rather than a token object, so an interrupt that lands between
taking the slot and using it cannot lose it: `leave` (and the failure path) find it by the id.

A refused call never touched the group; on one rank that is all. With peers, they may have made the
call this rank refused, or ordered the two threads' calls the other way, so every bridge on the
group refuses every later call (the failure protocol's broken state: rebuild on every rank), and
the call that was running when the refusal came raises too instead of returning what its
collective paired with (bridge.py). That leaves one window: a rank whose second thread arrives
only after the first thread's call returned sees no overlap, while a peer, which ordered them the
other way, did; the README states the contract: call the bridges of one process group from one
thread, or in the same order on every rank.
"""

from __future__ import annotations

import threading

_SLOTS: dict = {}  # group key -> id of the thread whose call holds the group
_get_ident = threading.get_ident


class ConcurrentCallError(RuntimeError):
    """finalize_epilogue was called while another thread's call on the same process group ran."""


def group_key(group, world_size: int, bridge) -> object:
    """What identifies the process group in the slot table: the bridge itself on one process
    (no peers, nothing to keep in step), the default group under both its names."""
    if world_size == 1:
        return ("bridge", id(bridge))
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return "world"
    return ("group", id(group))


def enter(bridge) -> None:
    """Take the bridge's process group for this thread's call, or raise ConcurrentCallError
    (after breaking the group on this rank when it has peers: see the module docstring)."""
    me = _get_ident()
    if _SLOTS.setdefault(bridge._group_key, me) != me:
        raise refused(bridge)


def holds(bridge) -> bool:
    """Whether this thread holds the bridge's process group (its call is under way)."""
    return _SLOTS.get(bridge._group_key) == threading.get_ident()


def leave(bridge) -> None:
    """Give the group back if this thread holds it (idempotent). Reads the table first: under
    torch.compile's tracing no call holds a group, and the thread id is never asked for."""
    key = bridge._group_key
    owner = _SLOTS.get(key)
    if owner is not None and owner == _get_ident():
        _SLOTS.pop(key, None)


def refused(bridge) -> ConcurrentCallError:
    """The refusal of this thread's call, and on several ranks the group broken on this rank."""
    error = ConcurrentCallError(
        f"finalize_epilogue: thread {threading.current_thread().name!r} called this FusionBridge "
        "while another thread's call of it was running, or of another FusionBridge on the same "
        "process group. One process group takes one call at a time: its calls are collectives that "
        "every rank makes in the same order, and calls from two threads pair with the other ranks' "
        "calls in different orders (wrong outputs, no error). Call the bridges of one process "
        "group from one thread, or serialize their calls in the same order on every rank."
    )
    if bridge.env.world_size > 1:
        bridge._break(error, "while another thread's call on this process group ran (refused)")
    return error
