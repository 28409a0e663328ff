"""fusion_bridge.ranks.agreement and rank_check_in over real gloo process groups on CPU: check-in
with a timeout, settings agreement, debug-mode per-call agreement. Every rank function returns what
it caught, so the parent asserts per rank; every collective runs on a subgroup with a short timeout,
and every group run has a hard timeout, so a regression fails fast instead of hanging CI."""

import re
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from fusion_bridge.spec import EpilogueSpec, QuantSpec
from fusion_bridge.ranks.agreement import agree_on_settings, differing_fields, plan_settings
from fusion_bridge.ranks.call_agreement import GroupInputError, agree_call
from fusion_bridge.ranks.check_in import DEFAULT_BUILD_TIMEOUT_S, build_timeout_s, check_in
from fusion_bridge.cli.launch import run_distributed
from fusion_bridge.call.validation import EpilogueInputError

GROUP_TIMEOUT = timedelta(seconds=20)  # collectives of the test groups fail after this, never hang
RUN_TIMEOUT_S = 120  # the whole multi-process run, killed after this

SPEC = EpilogueSpec(hidden_size=256, top_k=4)


def _short_group(world_size):
    """A gloo subgroup of every rank with a short collective timeout (the default group's is 30
    min)."""
    return torch.distributed.new_group(
        list(range(world_size)), timeout=GROUP_TIMEOUT, backend="gloo"
    )


def _finish(group):
    """Keep rank 0, which hosts the store, alive until every rank is done with it."""
    torch.distributed.barrier(group=group)


def _caught(fn, *args, **kwargs):
    """('ok', result) or (exception type name, message, extra attributes)."""
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception as exc:  # returned to the parent, which asserts on it
        return (
            type(exc).__name__,
            str(exc),
            getattr(exc, "missing_ranks", None)
            or getattr(exc, "fields", None)
            or getattr(exc, "failed", None),
            isinstance(exc, EpilogueInputError),
        )


# ---------------------------------------------------------------- settings
def _settings(spec=SPEC, **changes):
    """What the bridge agrees on at build, as plain values."""
    s = {
        "spec": spec.to_dict(),
        "requested_strategy": "auto",
        "debug": False,
        "self_test": True,
        "shadow": {"strategy": None, "every": 100},
        "tuning": "auto",
    }
    s.update(changes)
    return s


def _plan(choice, overflow):
    return plan_settings(
        SimpleNamespace(
            bounds=(1, 2, 4),
            choice=choice,
            variants=("default",) * 3,
            overflow=overflow,
            overflow_variant="default",
        )
    )


# (differing fields, settings of rank 0, settings of the odd rank, a value text the message must
# show)
SETTINGS_CASES = [
    (
        {"spec.dtype"},
        _settings(),
        _settings(EpilogueSpec(256, 4, dtype=torch.float16)),
        "'fp16' on rank",
    ),
    (
        {"spec.routed_scaling_factor"},
        _settings(),
        _settings(EpilogueSpec(256, 4, routed_scaling_factor=2.5)),
        "2.5 on rank",
    ),
    ({"spec.hidden_size"}, _settings(), _settings(EpilogueSpec(512, 4)), "512 on rank"),
    ({"spec.eps"}, _settings(), _settings(EpilogueSpec(256, 4, eps=1e-5)), "1e-05 on rank"),
    (
        {"spec.quant.kind", "spec.quant.scale"},
        _settings(),
        _settings(EpilogueSpec(256, 4, quant=QuantSpec.fp8(0.5))),
        "'fp8' on rank",
    ),
    (
        {"requested_strategy"},
        _settings(),
        _settings(requested_strategy="separate"),
        "'separate' on rank",
    ),
    ({"debug"}, _settings(), _settings(debug=True), "True on rank"),
    ({"self_test"}, _settings(), _settings(self_test=False), "False on rank"),
    (
        {"shadow.strategy"},
        _settings(),
        _settings(shadow={"strategy": "reference", "every": 100}),
        "'reference' on rank",
    ),
    ({"shadow.every"}, _settings(), _settings(shadow={"strategy": None, "every": 7}), "7 on rank"),
    ({"tuning"}, _settings(), _settings(tuning="off"), "'off' on rank"),
    (
        {"route_by_bucket.T<=4", "overflow"},
        _plan(("separate",) * 3, "separate"),
        _plan(("separate", "separate", "local_fused_nccl"), None),
        "'local_fused_nccl:default' on rank",
    ),
]


def _agree_on_settings_cases(rank, world_size, odd_rank):
    group = _short_group(world_size)
    out = [
        _caught(agree_on_settings, _settings(), group)
    ]  # all equal: returns every rank's settings
    for _, same, odd, _ in SETTINGS_CASES:
        out.append(
            _caught(
                agree_on_settings,
                odd if rank == odd_rank else same,
                group,
                what="the plan" if "overflow" in same else "settings",
            )
        )
    _finish(group)
    return out


@pytest.mark.parametrize("world_size,odd_rank", [(2, 1), (4, 2)])
def test_each_differing_setting_is_named_with_every_ranks_value_on_every_rank(world_size, odd_rank):
    results = run_distributed(
        _agree_on_settings_cases, world_size, odd_rank, backend="gloo", timeout_s=RUN_TIMEOUT_S
    )
    others = ", ".join(str(r) for r in range(world_size) if r != odd_rank)
    for rank, out in enumerate(results):
        assert out[0] == ("ok", [_settings()] * world_size), (rank, out[0])
        for (fields, _, _, value_text), got in zip(SETTINGS_CASES, out[1:]):
            kind, message, differing, _ = got
            assert kind == "RankAgreementError", (rank, fields, got)
            assert set(differing) == fields, (rank, got)
            assert f"the {world_size} ranks of the group disagree on" in message
            for field in fields:
                assert f"  {field}: " in message, (rank, field, message)
            assert f"{value_text} {odd_rank}" in message, (rank, message)  # the odd rank's value
            assert f"on rank{'s' if world_size > 2 else ''} {others}" in message, (rank, message)
        assert [m[1] for m in out[1:]] == [m[1] for m in results[0][1:]], (
            "same message on every rank"
        )


# ---------------------------------------------------------------- check-in
def _check_in_with_a_late_rank(rank, world_size):
    """Rank 1 misses rank 0's check-in, then arrives alone; then both build, twice."""
    store = torch.distributed.distributed_c10d._get_default_store()
    group = _short_group(world_size)
    out = {}
    if rank == 0:
        start = time.monotonic()
        out["first"] = _caught(check_in, group, timeout_s=3, label="layer 0")
        out["first_s"] = time.monotonic() - start
        store.set("test/rank0_gave_up", "1")
        store.wait(["test/rank1_gave_up"], timedelta(seconds=60))
    else:
        store.wait(["test/rank0_gave_up"], timedelta(seconds=60))
        out["first"] = _caught(
            check_in, group, timeout_s=2, label="layer 0"
        )  # rank 0's key was withdrawn
        store.set("test/rank1_gave_up", "1")
    out["retry"] = _caught(check_in, group, timeout_s=30, label="layer 0")
    out["next"] = _caught(check_in, group, timeout_s=30, label="layer 1")
    out["world"] = _caught(
        check_in, None, timeout_s=30, label="default group"
    )  # the default group's store
    _finish(group)
    return out


def test_a_rank_that_never_checks_in_gives_a_clear_error_within_the_timeout():
    r0, r1 = run_distributed(_check_in_with_a_late_rank, 2, backend="gloo", timeout_s=RUN_TIMEOUT_S)
    kind, message, missing, _ = r0["first"]
    assert kind == "RankAgreementError" and missing == (1,), r0
    assert "layer 0: rank 0 of the 2-rank group waited 3 s for rank(s) 1 to check in" in message
    assert "FUSION_BRIDGE_BUILD_TIMEOUT_S" in message
    assert 2.5 < r0["first_s"] < 10, r0["first_s"]
    kind, message, missing, _ = r1["first"]
    assert kind == "RankAgreementError" and not missing, r1  # rank 0 came, then gave up
    assert (
        "rank 1 of the 2-rank group waited 2 s for the other ranks; rank(s) 0 had checked in but "
        "gave up waiting before this rank arrived"
    ) in message
    for out in (r0, r1):  # failed check-ins do not count: both ranks retry build 0, then go on to 1
        assert (out["retry"], out["next"], out["world"]) == (("ok", 0), ("ok", 1), ("ok", 0)), out


def _check_in_missing_two(rank, world_size):
    everyone = _short_group(world_size)
    group = torch.distributed.new_group([1, 2, 3], timeout=GROUP_TIMEOUT, backend="gloo")
    out = [_caught(check_in, None, timeout_s=30)]
    if rank == 2:  # group rank 1 of the subgroup [1, 2, 3], whose other members never check in
        out.append(_caught(check_in, group, timeout_s=2, label="layer 3"))
    _finish(everyone)
    return out


def test_missing_ranks_are_named_at_world_size_4_with_global_ranks_for_a_subgroup():
    results = run_distributed(_check_in_missing_two, 4, backend="gloo", timeout_s=RUN_TIMEOUT_S)
    assert results[0] == results[1] == results[3] == [("ok", 0)] and results[2][0] == ("ok", 0)
    kind, message, missing, _ = results[2][1]
    assert kind == "RankAgreementError" and missing == (0, 2), results[2]
    assert (
        "layer 3: rank 1 (global ranks 2) of the 3-rank group waited 2 s for rank(s) 0, 2 "
        "(global ranks 1, 3) to check in"
    ) in message


def test_build_timeout_comes_from_the_argument_then_the_environment(monkeypatch):
    monkeypatch.delenv("FUSION_BRIDGE_BUILD_TIMEOUT_S", raising=False)
    assert build_timeout_s() == DEFAULT_BUILD_TIMEOUT_S == 600.0
    monkeypatch.setenv("FUSION_BRIDGE_BUILD_TIMEOUT_S", "45")
    assert build_timeout_s() == 45.0 and build_timeout_s(7) == 7.0
    monkeypatch.setenv("FUSION_BRIDGE_BUILD_TIMEOUT_S", "soon")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "FUSION_BRIDGE_BUILD_TIMEOUT_S must be a number of seconds in [0.001, 86400] in "
            "ASCII digits, got 'soon'"
        ),
    ):
        build_timeout_s()
    # whole milliseconds, at least 1 (a timeout that rounds to 0 would mean "wait forever"), and a
    # ceiling far below what timedelta or an int32 of milliseconds holds
    assert build_timeout_s(0.0004 + 0.0006) == 0.001 and build_timeout_s(1.0001) == 1.001
    for raw in ("0.0004", "1e14", "-1", "0", "nan", "inf", ""):
        monkeypatch.setenv("FUSION_BRIDGE_BUILD_TIMEOUT_S", raw)
        if raw:
            with pytest.raises(ValueError, match="FUSION_BRIDGE_BUILD_TIMEOUT_S must be"):
                build_timeout_s()
        else:  # blank: the default
            assert build_timeout_s() == DEFAULT_BUILD_TIMEOUT_S
    for bad in (0, -1, 0.0004, 1e14, float("inf"), float("nan"), True, "5"):
        with pytest.raises(
            ValueError,
            match=re.escape("build_timeout_s must be a number of seconds in [0.001, 86400]"),
        ):
            build_timeout_s(bad)


# ---------------------------------------------------------------- per call, debug mode
REASON = "finalize_epilogue: residual.shape must be [5, 256], got [4, 256]"


def _agree_call_cases(rank, world_size, failing):
    group = _short_group(world_size)
    bad, last = rank in failing, world_size - 1
    out = [
        _caught(agree_call, not bad, 5, REASON if bad else None, group, torch.device("cpu")),
        _caught(agree_call, True, 3 + (rank == world_size - 1), None, group),  # unequal T
        _caught(agree_call, True, 0 if rank == 0 else 6, None, group),  # T=0 on one rank
        _caught(
            agree_call,
            not bad,
            -1 if bad else 5,
            "index map is not a tensor" if bad else None,
            group,
        ),
        _caught(agree_call, True, 5, None, group),  # still in step
        _caught(agree_call, True, 0, None, group),  # T=0 everywhere
        # the same call number, the last rank's residual differs (e.g. fed another prompt)
        _caught(agree_call, True, 5, None, group, call=7, fingerprint=(1 + (rank == last), 2)),
        # the last rank is one call ahead, with the same inputs
        _caught(agree_call, True, 5, None, group, call=8 + (rank == last), fingerprint=(1, 2)),
    ]
    _finish(group)
    return out


@pytest.mark.parametrize("world_size,failing", [(2, (1,)), (4, (1, 3))])
def test_debug_agreement_raises_the_same_clear_error_on_every_rank(world_size, failing):
    results = run_distributed(
        _agree_call_cases, world_size, failing, backend="gloo", timeout_s=RUN_TIMEOUT_S
    )
    who = (
        f"rank{'s' if len(failing) > 1 else ''} {', '.join(map(str, failing))} of the "
        f"{world_size}-rank group"
    )
    for rank, (one_bad, uneven, zero, unknown, good, idle, inputs, ahead) in enumerate(results):
        kind, message, failed, is_input_error = one_bad
        assert kind == "GroupInputError" and is_input_error and set(failed) == set(failing), (
            rank,
            one_bad,
        )
        assert (
            f"{who} failed the call's checks" in message
            and f"rank {failing[-1]}: {REASON}" in message
        )
        assert "token count" not in message, message
        kind, message, failed, is_input_error = uneven
        assert kind == "GroupInputError" and is_input_error and failed == {}, (rank, uneven)
        assert "T must be identical on every rank of the group, got 3 on rank 0" in message
        assert f"4 on rank {world_size - 1}" in message
        assert zero[0] == "GroupInputError" and "got 0 on rank 0, 6 on rank 1" in zero[1], (
            rank,
            zero,
        )
        assert unknown[0] == "GroupInputError" and "index map is not a tensor" in unknown[1], (
            rank,
            unknown,
        )
        assert "token count" not in unknown[1], (
            unknown
        )  # an unreadable T is not reported as a mismatch
        assert (good, idle) == (("ok", 5), ("ok", 0)), rank
        # debug mode says what differs: the inputs on the same call, or the call numbers
        assert inputs[0] == "GroupInputError", (rank, inputs)
        assert (
            "on the same call (bridge 0 call 7) but with different replicated inputs" in inputs[1]
        )
        assert f"the residual differs on rank {world_size - 1} from rank 0" in inputs[1]
        assert "index map differs" not in inputs[1] and "different calls" not in inputs[1]
        assert ahead[0] == "GroupInputError", (rank, ahead)
        assert "on different calls: bridge 0 call 8 on rank 0" in ahead[1]
        assert f"bridge 0 call 9 on rank {world_size - 1}" in ahead[1]
        assert "differs" not in ahead[1], ahead[1]
    for case in range(4):
        assert len({r[case][1] for r in results}) == 1, "the same message on every rank"


# ---------------------------------------------------------------- pure pieces, one process
def test_differing_fields_compares_leaves():
    base = {"a": {"x": 1.0, "nan": float("nan")}, "flag": True, "list": ["p", "q"]}
    assert (
        differing_fields([base, dict(base, a={"x": 1, "nan": float("nan")})]) == {}
    )  # 1 == 1.0, nan == nan
    assert differing_fields([base, dict(base, flag=1)]) == {"flag": [True, 1]}  # True is not 1
    assert differing_fields([base, dict(base, list=["p", "r"])]) == {"list[1]": ["q", "r"]}
    assert differing_fields([base, {k: v for k, v in base.items() if k != "flag"}]) == {
        "flag": [True, "<absent>"]
    }
    assert differing_fields([base, dict(base, a={"x": "1.0", "nan": float("nan")})]) == {
        "a.x": [1.0, "1.0"]
    }


def test_plan_settings_names_each_bucket_with_its_variant():
    plan = SimpleNamespace(
        bounds=(1, 2),
        choice=("separate", "local_fused_flashinfer"),
        variants=("default", "twoshot"),
        overflow="separate",
        overflow_variant="default",
    )
    assert plan_settings(plan) == {
        "route_by_bucket": {"T<=1": "separate:default", "T<=2": "local_fused_flashinfer:twoshot"},
        "overflow": "separate:default",
    }


def test_plan_settings_carry_the_eager_routes_when_the_plan_has_them():
    """Mutant killed: eager routes left out of the plan agreement (ranks with different eager times
    would run different collectives outside CUDA graphs without any error)."""
    plan = SimpleNamespace(
        bounds=(1, 2),
        choice=("separate", "separate"),
        variants=("default", "default"),
        overflow=None,
        overflow_variant="default",
        eager_choice=("local_fused_nccl", "separate"),
        eager_variants=("default", "default"),
    )
    assert plan_settings(plan)["eager_route_by_bucket"] == {
        "T<=1": "local_fused_nccl:default",
        "T<=2": "separate:default",
    }


def _eager_times_and_prepare_on_one_rank(rank, world_size):
    """Two builds on 2 gloo ranks: (1) the same graph times but eager times that pick another eager
    route on each rank; (2) a strategy whose prepare() fails on rank 1 only."""
    from fusion_bridge import FusionBridge
    from fusion_bridge.registry import register
    from tests.strategy_fixture import PrepareFailsOnRankOne

    group = _short_group(world_size)
    spec = EpilogueSpec(hidden_size=64, top_k=2, max_tokens=2)
    register("two_variants", "tests.strategy_fixture:TwoVariants")
    register("prepare_fails_on_rank_one", "tests.strategy_fixture:PrepareFailsOnRankOne")
    args = dict(tuning="off", self_test=False, build_timeout_s=30, device=torch.device("cpu"))
    graph = {"two_variants": {"a": {1: 10.0, 2: 10.0}, "b": {1: 20.0, 2: 20.0}}}
    fast, slow = (5.0, 50.0) if rank == 0 else (50.0, 5.0)
    eager = {"two_variants": {"a": {1: fast, 2: fast}, "b": {1: slow, 2: slow}}}
    out = {
        "eager": _caught(
            lambda: FusionBridge(spec, group, measured_us=graph, eager_us=eager, **args).close()
        )
    }
    closed_before = PrepareFailsOnRankOne.closed
    with FusionBridge(spec, group, **args) as bridge:
        status = {s.name: s for s in bridge.statuses}["prepare_fails_on_rank_one"]
        out["prepared"] = bridge.prepared
        out["codes"] = [r.code for r in status.reasons]
        out["closed"] = PrepareFailsOnRankOne.closed - closed_before  # during the build
    _finish(group)
    return out


def test_rank_disagreements_in_eager_routes_and_prepare_are_caught_on_both_ranks():
    """Mutants killed: (1) eager routes left out of the plan agreement: ranks whose eager times pick
    different eager routes must raise, naming the field, not build silently; (2) an instance that
    the agreement turned off staying prepared on the rank where it succeeded: both ranks must list
    the same prepared strategies, and the turned-off instance is closed there."""
    r0, r1 = run_distributed(
        _eager_times_and_prepare_on_one_rank, 2, backend="gloo", timeout_s=RUN_TIMEOUT_S
    )
    for out in (r0, r1):
        kind, message, fields, _ = out["eager"]
        assert kind == "RankAgreementError", out["eager"]
        assert "disagree on the plan" in message and "eager_route_by_bucket.T<=1" in message
        assert fields["eager_route_by_bucket.T<=1"] == ["two_variants:a", "two_variants:b"]
    assert r0["prepared"] == r1["prepared"] and "prepare_fails_on_rank_one" not in r0["prepared"]
    assert "separate" in r0["prepared"]
    assert r0["codes"] == ["unavailable_on_another_rank"] and r1["codes"] == ["prepare_failed"]
    assert r0["closed"] == 1 and r1["closed"] == 1  # each rank closed the instance it built


def test_a_single_process_needs_no_collective():
    assert not torch.distributed.is_initialized()
    assert check_in(None, timeout_s=1) == 0
    assert agree_on_settings(_settings(), None) == [_settings()]
    assert agree_call(True, 7, None, None) == 7
    with pytest.raises(
        GroupInputError, match="rank 0 of the 1-rank group failed the call's checks: rank 0: boom"
    ):
        agree_call(False, 7, "boom", None)
