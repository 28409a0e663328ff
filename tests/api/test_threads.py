"""A bridge takes one call at a time: a second thread's call while one is running is refused with
ConcurrentCallError (call/one_caller.py), here on one rank with real threads; on two gloo ranks,
where the refusal also marks the bridge broken: tests/distributed/test_failure_paths.py. The running
call is held inside its strategy by `PausingSeparate` (tests/strategy_fixture.py), so the overlap
is certain, not a race the test hopes to win."""

import threading

import pytest

from fusion_bridge import ConcurrentCallError, EpilogueInputError, EpilogueSpec, FusionBridge
from fusion_bridge.oracle.synthetic import make_inputs
from fusion_bridge.registry import register, unregister
from tests import oracle64
from tests.strategy_fixture import PausingSeparate

SPEC = EpilogueSpec(hidden_size=64, top_k=2)
TOL = 1e-2  # normwise, bf16 outputs: separate errs by ~1e-3; a wrong call by ~1 (issue 11)


@pytest.fixture
def pausing():
    register(PausingSeparate.name, "tests.strategy_fixture:PausingSeparate")
    PausingSeparate.reset(hold=False)
    try:
        yield
    finally:
        PausingSeparate.reset(hold=False)
        unregister(PausingSeparate.name)


def _in_thread(fn, name):
    """Run fn() in a thread called `name`; returns (thread, results): results gets fn's value or
    the exception it raised."""
    results = {}

    def target():
        try:
            results["value"] = fn()
        except Exception as exc:  # read by the test
            results["error"] = exc

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread, results


def _norm_err(out, inp):
    _, norm = oracle64.epilogue64_from(SPEC, [inp])
    return oracle64.normwise_rel_err(out.norm_out, norm)


def test_a_call_from_a_second_thread_while_one_runs_is_refused(pausing):
    with FusionBridge(SPEC, strategy=PausingSeparate.name, self_test=False, tuning="off") as bridge:
        first, second = make_inputs(SPEC, 3, seed=1), make_inputs(SPEC, 5, seed=2)
        PausingSeparate.reset(hold=True)
        thread, running = _in_thread(lambda: bridge.finalize_epilogue(*first), "caller-a")
        assert PausingSeparate.entered.wait(60)
        with pytest.raises(ConcurrentCallError) as refused:
            bridge(*second)  # __call__ too
        message = str(refused.value)
        assert "thread 'MainThread' called this FusionBridge while another thread's call" in message
        assert "Call the bridges of one process group from one thread" in message
        PausingSeparate.release.set()
        thread.join(60)
        assert "error" not in running, running
        assert _norm_err(running["value"], first) <= TOL  # the running call is untouched
        # one rank: nothing was out of step, the bridge stays usable, from any thread; a call that
        # raises gives the bridge back too
        PausingSeparate.reset(hold=False)
        with pytest.raises(EpilogueInputError, match="gamma.dtype"):
            bridge(*second._replace(gamma=second.gamma.float()))
        thread, later = _in_thread(lambda: bridge(*second), "caller-b")
        thread.join(60)
        assert "error" not in later, later
        assert _norm_err(later["value"], second) <= TOL
        assert _norm_err(bridge(*first), first) <= TOL
        assert bridge.calls == 4  # the refused call was never counted
