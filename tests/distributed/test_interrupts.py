"""Issue 54 item 2 and item 3 over real gloo groups of 2 ranks on CPU: an interrupt anywhere in a
call before its collective keeps the group in step, and calls of two bridges sharing a process group
from two threads are refused, never paired silently.

  every line   rank 1 raises KeyboardInterrupt at each line event (and each function entry) of its
               call, one call per point, from the call's first statement up to its collective
               (sys.settrace raises in the traced frame: the same place a signal handler's
               exception lands); rank 0 calls with valid inputs. Rank 0 gets NaN (or, in debug
               mode, the agreed GroupInputError), rank 1 its KeyboardInterrupt, and the next call
               is correct on both: no point leaves without taking part, none loses the call token
  storm        SIGALRM every few hundred microseconds on rank 1, its handler raising
               KeyboardInterrupt (at most once per call) wherever a bridge call is under way,
               outside torch.distributed's own frames: 0 wrong values on either rank (a rank that
               breaks its bridge ends the run; its peer's call fails at the group's timeout:
               loud, bounded)
  crossed      two bridges on one group; rank 0's second thread calls bridge 1 while its main
               thread calls bridge 2, rank 1 the other way round: each rank refuses one call, and
               the call it let through raises instead of returning the value its collective paired
               with (the peer's other bridge)

Each rank function catches what it expects and returns it; the parent asserts per rank against the
float64 oracle (tests/distributed/test_rank_disagreement.py has the helpers).
"""

from __future__ import annotations

import sys
import threading

import pytest

from fusion_bridge.cli.launch import run_distributed
from fusion_bridge.strategies.base import CallStage
from tests.distributed.test_rank_disagreement import (
    RUN_TIMEOUT_S,
    _build,
    _call as _call_catching_exceptions,
    _finish,
    _good,
    _group,
)

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object")
_CURRENT: list = [None]  # the injector the wrapped collectives report to


def _call(bridge, inputs, exact=None):
    """tests.distributed.test_rank_disagreement's summary of one call, KeyboardInterrupt too."""
    try:
        return _call_catching_exceptions(bridge, inputs, exact)
    except BaseException as exc:  # noqa: BLE001 - returned to the parent
        return {"kind": type(exc).__name__, "msg": str(exc)}


class _Injector:
    """Raise KeyboardInterrupt at the `target`-th place (a line of any fusion_bridge frame, or the
    entry of any function such a frame calls; a place a loop reaches again counts once) of the
    traced call, counting from its first statement
    up to its last collective (`collectives`: how many the call makes, 1, or 2 in debug mode),
    skipping the events inside a collective: from its mark (`Strategy.collective()`, debug mode's
    progress "in") to its return. With target None, only count the events."""

    def __init__(self, bridge, target, collectives):
        self.bridge, self.target, self.collectives = bridge, target, collectives
        self.events, self.fired, self.started, self.inside = 0, False, 0, False
        self.entry = None  # finalize_epilogue's own frame: its entry is before the call
        self.seen: set = set()

    def wrap(self, dist):
        """Make this the injector the (once) wrapped collectives report to."""
        _CURRENT[0] = self
        if getattr(dist, "_injector_wrapped", False):
            return
        dist._injector_wrapped = True
        for name in COLLECTIVES:
            real = getattr(dist, name)

            def wrapped(*args, _real=real, **kwargs):
                injector = _CURRENT[0]
                injector.started += 1
                injector.inside = True
                try:
                    return _real(*args, **kwargs)
                finally:
                    injector.inside = False

            setattr(dist, name, wrapped)

    def _counting(self):
        if self.inside or self.fired or self.started >= self.collectives:
            return False
        # from the strategy's collective mark (or debug mode's) on, a failure is "inside": the
        # rank cannot tell whether torch's wrapper had begun the collective, and breaks the group
        bridge = self.bridge
        marked = any(s.call_stage is CallStage.IN_COLLECTIVE for s in bridge._instances.values())
        agreement = bridge._agreement
        return not marked and not (agreement is not None and agreement.progress[0] == "in")

    def _hit(self, frame, event):
        if not self._counting():
            return
        place = (frame.f_code.co_filename, frame.f_lineno, event)
        if place in self.seen:  # a line a loop runs again: one injection per place
            return
        self.seen.add(place)
        if self.events == self.target:
            self.fired = True
            where = f"{frame.f_code.co_name} line {frame.f_lineno}"
            raise KeyboardInterrupt(f"injected at event {self.target} ({where})")
        self.events += 1

    def global_trace(self, frame, event, arg):
        ours = "fusion_bridge" in frame.f_code.co_filename
        caller = frame.f_back is not None and "fusion_bridge" in frame.f_back.f_code.co_filename
        if frame.f_code.co_name == "finalize_epilogue" and self.entry is None and ours:
            self.entry = frame  # its entry event is before the call's first statement
            return self.local_trace
        if event == "call" and (ours or caller):
            self._hit(frame, event)
        return self.local_trace if ours else None

    def local_trace(self, frame, event, arg):
        if event == "line" and not (frame is self.entry and _is_try_line(frame)):
            self._hit(frame, event)
        return self.local_trace


def _is_try_line(frame):
    """A `try:` line: its line event has no instruction that could take an interrupt (CPython
    checks for signals at calls, function entries and backward jumps only); in the entry frame
    it is the line before the call's protection begins."""
    import linecache

    return linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip().startswith("try:")


def _traced_call(bridge, inputs, exact, injector):
    sys.settrace(injector.global_trace)
    try:
        return _call(bridge, inputs, exact)
    finally:
        sys.settrace(None)


def _every_line(rank, world_size, debug):
    import torch.distributed as dist

    group = _group(world_size)
    collectives = 2 if debug else 1
    out = {"points": 0, "bad": []}
    with _build(group, debug=debug) as bridge:
        # rank 1 counts the events of one whole call (traced, not interrupted) and tells rank 0
        inputs, exact = _good(world_size, rank, 4, seed=1)
        counter = _Injector(bridge, None, collectives)
        counter.wrap(dist)
        first = _traced_call(bridge, inputs, exact, counter) if rank == 1 else None
        if rank == 0:
            first = _call(bridge, inputs, exact)
        if first["kind"] != "ok":
            out["bad"].append(("counting call", first))
        points = [counter.events]
        dist.broadcast_object_list(points, src=1, group=group)
        out["points"] = points[0]
        for point in range(points[0]):
            inputs, exact = _good(world_size, rank, 3 + point % 3, seed=10 + point)
            if rank == 1:
                injector = _Injector(bridge, point, collectives)
                injector.wrap(dist)
                r = _traced_call(bridge, inputs, exact, injector)
                ok = r["kind"] == "KeyboardInterrupt" and injector.fired
            else:
                r = _call(bridge, inputs, exact)
                nan = r["kind"] == "ok" and r["res_all_nan"] and r["norm_all_nan"]
                ok = nan or (debug and r["kind"] == "GroupInputError")
            if not ok:
                out["bad"].append((point, "interrupted call", r))
            good, good_exact = _good(world_size, rank, 5, seed=1000 + point)
            after = _call(bridge, good, good_exact)
            if after["kind"] != "ok" or after["norm_err"] > 1e-2:
                out["bad"].append((point, "next call", after))
                break  # out of step: stop before the peer waits again
    _finish(group)
    return out


@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
def test_an_interrupt_at_any_line_before_the_collective_keeps_the_group_in_step(debug):
    results = run_distributed(_every_line, 2, debug, backend="gloo", timeout_s=RUN_TIMEOUT_S)
    for rank, r in enumerate(results):
        assert r["points"] > 20, r  # the call's lines were seen
        assert not r["bad"], (rank, r["bad"][:3])


# ---------------------------------------------------------------- a storm of real signals
def _inside_a_call(frame, entry_code):
    """Whether a bridge call is under way at `frame` (past its entry, not at it) and not inside
    torch.distributed (a signal that arrives during a collective is the case the README's
    reliability section states: the rank breaks its bridge)."""
    f, inside = frame, False
    while f is not None:
        if "torch/distributed" in f.f_code.co_filename:
            return False
        if f.f_code is entry_code and not (f is frame and f.f_lineno == entry_code.co_firstlineno):
            inside = True
        f = f.f_back
    return inside


def _storm(rank, world_size, calls):
    import signal

    from fusion_bridge import FusionBridge

    group = _group(world_size)  # its timeout bounds a peer's wait after a break
    out = {"ok": 0, "nan": 0, "raised": 0, "wrong": [], "interrupts": 0, "last": None}
    entry = FusionBridge.finalize_epilogue.__code__
    interrupted = {"call": -1}

    def handler(signum, frame):  # at most one interrupt per call, anywhere in it
        if interrupted["call"] != out["i"] and _inside_a_call(frame, entry):
            interrupted["call"] = out["i"]
            out["interrupts"] += 1
            raise KeyboardInterrupt("storm")

    with _build(group) as bridge:
        if rank == 1:
            signal.signal(signal.SIGALRM, handler)
            signal.setitimer(signal.ITIMER_REAL, 0.0002, 0.00037)
        try:
            for i in range(calls):
                out["i"] = i
                inputs, exact = _good(world_size, rank, 2 + i % 4, seed=i)
                r = _call(bridge, inputs, exact)
                out["last"] = r
                if r["kind"] != "ok":
                    out["raised"] += 1
                    if "unusable" in r.get("msg", ""):
                        break  # broken on this rank: the peer learns it at the group's timeout
                elif r["res_all_nan"] and r["norm_all_nan"]:
                    out["nan"] += 1
                elif r["norm_err"] <= 1e-2 and r["res_err"] <= 1e-2:
                    out["ok"] += 1
                else:
                    out["wrong"].append((i, r["norm_err"]))
        finally:
            if rank == 1:
                signal.setitimer(signal.ITIMER_REAL, 0, 0)
    return out


def test_a_signal_storm_on_one_rank_gives_no_wrong_value_on_any_rank():
    results = run_distributed(_storm, 2, 120, backend="gloo", timeout_s=RUN_TIMEOUT_S)
    for rank, r in enumerate(results):
        assert not r["wrong"], (rank, r)
    assert results[1]["interrupts"] > 0, results[1]  # the storm reached calls
    assert results[0]["nan"] > 0, results[0]  # and the peer got NaN where rank 1 took part


# ---------------------------------------------------------------- two bridges, two threads
def _crossed(rank, world_size):
    from fusion_bridge.registry import register
    from tests.strategy_fixture import PausingSeparate

    register(PausingSeparate.name, "tests.strategy_fixture:PausingSeparate")
    group = _group(world_size)
    out = {}
    with (
        _build(group, strategy=PausingSeparate.name) as one,
        _build(group, strategy=PausingSeparate.name) as two,
    ):
        held_bridge, main_bridge = (one, two) if rank == 0 else (two, one)
        held, held_exact = _good(world_size, rank, 4, seed=200 + (rank == 1))
        PausingSeparate.reset(hold=True)
        running = {}
        thread = threading.Thread(
            target=lambda: running.update(r=_call(held_bridge, held, held_exact)), name="second"
        )
        thread.start()
        assert PausingSeparate.entered.wait(60)
        other, other_exact = _good(world_size, rank, 4, seed=200 + (rank == 0))
        out["refused"] = _call(main_bridge, other, other_exact)
        PausingSeparate.release.set()
        thread.join(60)
        out["held"] = running["r"]
        PausingSeparate.reset(hold=False)
        later, later_exact = _good(world_size, rank, 4, seed=300)
        out["later"] = [_call(b, later, later_exact) for b in (one, two)]
    _finish(group)
    return out


def test_two_bridges_on_one_group_called_from_two_threads_never_pair_silently():
    results = run_distributed(_crossed, 2, backend="gloo", timeout_s=RUN_TIMEOUT_S)
    for rank, r in enumerate(results):
        assert r["refused"]["kind"] == "ConcurrentCallError", (rank, r["refused"])
        assert "another FusionBridge on the same process group" in r["refused"]["msg"]
        held = r["held"]  # its all-reduce paired with the peer's other bridge
        assert held["kind"] == "EpilogueInputError", (rank, held)
        assert "ConcurrentCallError" in held["msg"], held["msg"]
        for later in r["later"]:
            assert later["kind"] == "EpilogueInputError" and "unusable" in later["msg"], later


# ---------------------------------------------------------------- a broken bridge stays out
def _broken_rank_interrupted_everywhere(rank, world_size):
    """Both ranks make one good call; then rank 1's bridge is broken (as a failure inside a
    collective leaves it) and every later call of it is interrupted at each place in turn: none may
    make a collective (its peer is not in that call: a NaN payload would pair with whatever the
    peer does next, a call of another size among them)."""
    import torch.distributed as dist

    group = _group(world_size)
    out = {"calls": 0, "collectives": 0, "kinds": set()}
    with _build(group) as bridge:
        inputs, exact = _good(world_size, rank, 3, seed=1)
        out["first"] = _call(bridge, inputs, exact)["kind"]
        if rank == 1:
            bridge._break(RuntimeError("a failure inside the collective"), "in this test")
            later, _ = _good(world_size, rank, 4, seed=2)
            target = 0
            while True:
                injector = _Injector(bridge, target, collectives=1)
                injector.wrap(dist)
                r = _traced_call(bridge, later, None, injector)
                out["calls"] += 1
                out["collectives"] += injector.started
                out["kinds"].add(r["kind"])
                if not injector.fired:
                    break
                target += 1
    _finish(group)
    return out


def test_a_broken_bridge_never_takes_part_wherever_the_interrupt_lands():
    results = run_distributed(
        _broken_rank_interrupted_everywhere, 2, backend="gloo", timeout_s=RUN_TIMEOUT_S
    )
    assert results[0]["first"] == results[1]["first"] == "ok", results
    r = results[1]
    assert r["calls"] > 3, r  # the refused call's places were each interrupted in turn
    assert r["collectives"] == 0, r
    assert r["kinds"] <= {"KeyboardInterrupt", "EpilogueInputError"}, r
