"""The check-in before any collective of a build: every rank of the group arrives, within a timeout,
through the process group's store (set/wait: no collective, so it cannot hang). A rank that does not
arrive in time turns into one RankAgreementError (rank_agreement.py) on every rank that waited."""

from __future__ import annotations

import math
import threading
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from fusion_bridge import env_vars
from fusion_bridge.ranks.process_group import group_name, group_store, ranks_text, world_size
from fusion_bridge.ranks.agreement import RankAgreementError

BUILD_TIMEOUT_ENV = "FUSION_BRIDGE_BUILD_TIMEOUT_S"
# Ten minutes: bridges are built while the model loads, and ranks reach their first build far apart
# (shards read from network storage at different speeds, cold page caches, kernels JIT-compiled on
# one rank and found in the cache on another). A healthy start must never trip it; a rank that is
# truly gone is still reported well before gloo's default 30-minute collective timeout.
DEFAULT_BUILD_TIMEOUT_S = 600.0


def build_timeout_s(timeout_s: Optional[float] = None) -> float:
    """The check-in timeout in seconds, a whole number of milliseconds: `timeout_s` if given, else
    $FUSION_BRIDGE_BUILD_TIMEOUT_S, else DEFAULT_BUILD_TIMEOUT_S (ten minutes, see there why).
    Raises ValueError naming the argument or the variable outside [0.001 s, one day]
    (env_vars.timeout_ms says why those limits)."""
    if timeout_s is None:
        timeout_s = env_vars.read(BUILD_TIMEOUT_ENV)
        return DEFAULT_BUILD_TIMEOUT_S if timeout_s is None else timeout_s
    return env_vars.timeout_ms(timeout_s, "build_timeout_s") / 1000


def _store_timeout(store, timeout_s: float) -> timedelta:
    """What to hand the store's wait: a FileStore counts whole seconds (a shorter timeout would
    become 0, which it reads as "forever"), so round up to at least one second there."""
    inner = store
    while hasattr(inner, "underlying_store"):  # PrefixStore around the real store
        inner = inner.underlying_store
    if type(inner).__name__ == "FileStore":
        return timedelta(seconds=max(1, math.ceil(timeout_s)))
    return timedelta(milliseconds=max(1, round(timeout_s * 1000)))


_builds: dict[str, int] = {}  # group name -> number of check-ins that succeeded on this rank
_builds_lock = threading.Lock()


def check_in(
    group=None, *, timeout_s: Optional[float] = None, label: str = "FusionBridge build"
) -> int:
    """Wait until every rank of `group` has checked in for this build; no collective runs.

    Call it on every rank before the first collective of a build. Each rank sets its key in the
    group's store, then waits (up to `timeout_s`, default: build_timeout_s()) for every other rank's
    key. Keys are namespaced by the group's name and a per-group build counter, so each build (one
    per layer, in the same order on every rank) checks in separately. The counter advances only when
    a check-in succeeds, and a rank that gives up withdraws its key, so a late rank cannot mistake a
    stale check-in for a live peer: it waits, then fails too.

    Returns the build index (0, 1, ...) on success. A single process, or a group of one, returns 0
    at once. Raises RankAgreementError naming `label`, the group size, this rank and the ranks that
    did not arrive, within the timeout.
    """
    timeout_s = build_timeout_s(timeout_s)
    world = world_size(group)
    if world == 1:
        return 0
    rank, name, store = dist.get_rank(group), group_name(group), group_store(group)
    with _builds_lock:
        build = _builds.get(name, 0)
    prefix = f"fusion_bridge/check_in/{name}/{build}/"
    keys = [f"{prefix}{r}" for r in range(world)]
    gave_up = [f"{prefix}gave_up/{r}" for r in range(world)]
    if store.check([gave_up[rank]]):  # this rank gave up on this build before and now retries
        store.delete_key(gave_up[rank])
    store.set(keys[rank], label)
    try:
        store.wait(keys, _store_timeout(store, timeout_s))
    except RuntimeError as exc:  # DistStoreError on timeout (a RuntimeError subclass)
        try:
            # a rank that arrived but gave up first withdrew its key: it is not missing, but this
            # build cannot go on without it either
            absent = [r for r in range(world) if not store.check([keys[r]])]
            left = [r for r in absent if store.check([gave_up[r]])]
            missing = [r for r in absent if r not in left]
        except RuntimeError as store_exc:
            raise RankAgreementError(
                f"{label}: rank {ranks_text([rank], group)} of the {world}-rank group lost the "
                "group's "
                f"store while waiting for the other ranks to check in ({type(store_exc).__name__}: "
                f"{str(store_exc).splitlines()[0]}); the process that hosts it (rank 0 of the "
                "default "
                "group, or the launcher under torchrun) has probably exited or crashed."
            ) from exc
        if absent:
            try:
                store.set(gave_up[rank], "1")
                store.delete_key(keys[rank])
            except RuntimeError:  # a store without delete: the late rank then proceeds alone
                pass
            waited = (
                f"for rank(s) {ranks_text(missing, group)} to check in, in vain"
                if missing
                else "for the other ranks"
            )
            if left:
                waited += (
                    f"; rank(s) {ranks_text(left, group)} had checked in but gave up waiting "
                    "before this rank arrived"
                )
            raise RankAgreementError(
                f"{label}: rank {ranks_text([rank], group)} of the {world}-rank group waited "
                f"{timeout_s:g} s {waited} (build {build} of group {name!r}). Every rank must "
                "build its bridges, in the same order; is a rank stuck, crashed or on another code "
                f"path? If ranks legitimately start this far apart, raise {BUILD_TIMEOUT_ENV}.",
                missing_ranks=tuple(missing),
            ) from exc
    with _builds_lock:
        _builds[name] = build + 1
    return build
