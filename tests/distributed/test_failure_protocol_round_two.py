"""Issue 42 over real gloo groups on CPU: any failure keeps the group in step, round two.

One spawned 2-rank group runs every item's cases (tests/distributed/round_two_cases.py; spawns are
the expensive part here, so the module fixture spawns once and each test asserts one item); rank 1
fails in every case. The items:
  1. every BaseException class (KeyboardInterrupt, from a real SIGALRM handler too, CancelledError,
     SystemExit, a custom one) before the collective, on `separate` and `local_fused_nccl`;
  2. shadow mode: a failure after the route's collective, and in the shadow before its own;
  3. [T, ...] inputs that tie or scatter on T: no guess, every input's T named, the group refused;
  4. a closed bridge's call takes part (debug mode: every rank learns it is closed);
  5. taking part needs nothing that just failed (a lasting allocation failure, the debug
     fingerprint), and debug mode names the rank that is behind;
  6. settings checked before the first collective or at read (string and numpy bucket keys, a
     planning failure on one rank, tuning tables with out-of-limit values);
  7. the Hugging Face patch: a content hash of the weights, and debug mode with the patch;
  8. negative views refused, naming the argument;
  9. misleading errors: each names the variable or argument;
and, last, the cases where a peer waits out a short collective timeout (an interrupt entering the
all-reduce, a tie whose peer calls on). The oracle is tests/oracle64.py over every rank's partials.
"""

from __future__ import annotations

import pytest
import torch

from fusion_bridge.cli.launch import run_distributed
from fusion_bridge.environment import Environment
from fusion_bridge.oracle.synthetic import make_inputs
from fusion_bridge.spec import EpilogueSpec
from tests.distributed.round_two_cases import TIES, every_item
from tests.distributed.test_rank_disagreement import (
    RUN_TIMEOUT_S,
    SPEC,
    _assert_correct,
    _assert_nan,
)
from tests.helpers import once_per_run

ERRING = 1


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return once_per_run(  # one spawned group per run: xdist workers share it
        tmp_path_factory,
        "round_two",
        lambda _: run_distributed(every_item, 2, backend="gloo", timeout_s=RUN_TIMEOUT_S),
    )


def _per_rank(ranks, item):
    return [r[item] for r in ranks]


def test_1_every_exception_class_before_the_collective_takes_part_then_reraises(ranks):
    for rank, cases in enumerate(_per_rank(ranks, "item1")):
        assert len(cases) == 11, cases
        for c in cases:
            strategy, cls, point = c["case"]
            where = (rank, strategy, cls, point)
            failing = c["failing"]
            if rank == ERRING:
                expected = "KeyboardInterrupt" if point == "sigalrm" else cls
                assert failing["kind"] == expected, (where, failing)
                assert any("took part in call" in n for n in failing["notes"]), (where, failing)
                assert failing["unchanged"], where
            else:
                _assert_nan(failing, where)
            _assert_correct(c["after"], (where, "the next call"))


def test_2_shadow_mode_stays_in_step_after_a_failure_after_the_collective(ranks):
    per_rank = _per_rank(ranks, "item2")
    for rank, cases in enumerate(per_rank):
        for c in cases:
            shadow, point = where = c["case"]
            if point == "counters":
                continue
            if point is not None and rank == ERRING:
                expected = "after (injected)" if point.startswith("after") else "shadow (injected)"
                assert c["failing"]["kind"] == "RuntimeError", (rank, where, c["failing"])
                assert expected in c["failing"]["msg"], (rank, where, c["failing"])
                assert any("took part" in n for n in c["failing"]["notes"]), (rank, where)
            else:  # the route's collective ran on every rank: the peers' values are right
                _assert_correct(c["failing"], (rank, where))
            _assert_correct(c["after"], (rank, where, "the next call"))
    counters = [[c["shadow"] for c in cases if c["case"][1] == "counters"] for cases in per_rank]
    for shadow_index in range(2):  # sampled on the same calls on every rank
        assert counters[0][shadow_index]["calls"] == counters[1][shadow_index]["calls"] == 6


def test_3_tied_t_takes_part_in_nothing_names_every_input_and_refuses_the_group(ranks):
    cases = ranks[ERRING]["item3"]
    assert [c["case"] for c in cases] == list(TIES)
    for c in cases:
        first, how = c["first"], c["case"]
        assert first["kind"] == "EpilogueInputError", (how, first)
        assert (
            "the token count T of the [T, ...] inputs must be given by more than half"
            in (first["msg"])
        ), (how, first["msg"])
        # every [T, ...] input is named with its rows, the correct ones too
        for name in ("expanded_idx_to_permuted_idx", "expert_weights", "residual"):
            assert f"{name} " in first["msg"], (how, first["msg"])
        assert "rebuild every FusionBridge" in first["msg"], (how, first["msg"])
        assert first["seconds"] < 5, (how, "must not wait in a collective", first["seconds"])
        assert first["unchanged"], how
        for later in ("later_a", "later_b"):  # B shares the group: refused too, at once
            r = c[later]
            assert r["kind"] == "EpilogueInputError" and "unusable" in r["msg"], (how, later, r)
            assert r["seconds"] < 2, (how, later, r["seconds"])
    waits = _per_rank(ranks, "waits")
    assert waits[ERRING]["tie"]["kind"] == "EpilogueInputError", waits[ERRING]["tie"]
    # the peer that called on waits out the short timeout and then raises: never a value
    assert waits[0]["tie"]["kind"] not in ("ok",), waits[0]["tie"]
    for rank in range(2):
        assert waits[rank]["tie_later"]["kind"] == "EpilogueInputError", waits[rank]["tie_later"]


def test_4_a_closed_bridge_takes_part_so_the_next_bridge_pairs_right(ranks):
    for rank, runs in enumerate(_per_rank(ranks, "item4")):
        for run in runs:
            a1, b1, a2, b2 = run["calls"]
            where = (rank, "debug" if run["debug"] else "eager")
            for r in (a1, b1, b2):
                _assert_correct(r, where)
            if run["debug"]:  # every rank learns that rank 1 closed A
                assert a2["kind"] == "GroupInputError", (where, a2)
                assert "this FusionBridge was closed" in a2["msg"], (where, a2)
                assert a2["failed"] and list(a2["failed"]) == [ERRING], (where, a2)
            elif rank == ERRING:
                assert a2["kind"] == "BridgeClosedError", (where, a2)
                assert "this FusionBridge was closed" in a2["msg"], (where, a2)
            else:
                _assert_nan(a2, where)


def test_5_taking_part_needs_nothing_that_just_failed(ranks):
    per_rank = _per_rank(ranks, "item5")
    for rank, out in enumerate(per_rank):
        if rank == ERRING:
            assert out["oom"]["kind"] == "OutOfMemoryError", out["oom"]
        else:
            _assert_nan(out["oom"], (rank, "lasting allocation failure"))
        _assert_correct(out["oom_after"], (rank, "after the allocation failure"))
        # debug mode: the fingerprint's failure is this rank's reason, agreed by every rank
        r = out["debug_oom"]
        assert r["kind"] == "GroupInputError" and "fingerprint OOM" in r["msg"], (rank, r)
        for after in out["debug_after"]:
            _assert_correct(after, (rank, "debug mode after the fingerprint failure"))
        skipped = out["skipped"]
        _assert_correct(skipped[0], rank)
        assert all(c["kind"] == "GroupInputError" for c in skipped[1:]), (rank, skipped)
        # from the call after the skip on, every rank names the rank that is behind
        assert "rank 0 is one call behind rank 1" in skipped[2]["msg"], skipped[2]["msg"]


def test_6_settings_are_checked_before_the_first_collective_or_at_read(ranks):
    per_rank = _per_rank(ranks, "item6")
    plans = [out["string_keys"].get("plan") for out in per_rank]
    for rank, out in enumerate(per_rank):
        keys = out["string_keys"]
        assert "call" in keys, (rank, keys)  # built on every rank, same plan
        _assert_correct(keys["call"], (rank, "string and numpy bucket keys"))
        planning = out["planning"]
        assert planning["kind"] == "RankAgreementError", (rank, planning)
        assert "planning_failed" in planning["msg"] and "planner (injected)" in planning["msg"]
        for case, why in (
            ("spread_400_digits", "spread.fraction is"),
            ("spread_0.999", "spread.fraction is 0.999"),
            ("time_1e-3_us", "not a number of microseconds in [0.5"),
        ):
            r = out[case]
            assert r["kind"] == "ok" and not r["table"] and r["margin"] is None, (rank, case, r)
            if rank == 0:  # rank 0 reads the table; the warning names the file and the reason
                assert any("ignored" in w and why in w for w in r["warnings"]), (case, r)
    assert plans[0] == plans[1] and plans[0]["source"] == "measured", plans


def test_7_the_patch_compares_weights_by_content_and_works_in_debug_mode(ranks):
    per_rank = _per_rank(ranks, "item7")
    if "skipped" in per_rank[0]:
        pytest.skip(per_rank[0]["skipped"])
    for rank, out in enumerate(per_rank):
        for case, name in (("experts_swapped", "gate_up_proj"), ("rows_swapped", "down_proj")):
            r = out[case]
            assert r["kind"] == "ValueError", (rank, case, r)
            assert "every rank of the group must hold the same model" in r["msg"], (rank, r)
            assert f"; rank {ERRING} differs from rank 0 in " in r["msg"], (rank, r["msg"])
            assert f"layers.1.mlp.experts.{name}" in r["msg"], (rank, r["msg"])
        assert out["same_nan"]["kind"] == "patched", (rank, out["same_nan"])
        assert out["debug"]["forward"] == "ok", (rank, out["debug"])
    assert per_rank[0]["debug"]["logits"] == per_rank[1]["debug"]["logits"]


def test_8_negative_views_are_refused_naming_the_argument(ranks):
    for rank, cases in enumerate(_per_rank(ranks, "item8")):
        for c in cases:
            strategy, name = where = c["case"]
            if rank == ERRING:
                r = c["failing"]
                assert r["kind"] == "EpilogueInputError", (where, r)
                assert f"{name} must be a tensor whose memory holds its values" in r["msg"], r
                assert "a negative view" in r["msg"] and r["unchanged"], (where, r)
            else:
                _assert_nan(c["failing"], (rank, where))
            _assert_correct(c["after"], (rank, where, "the next call"))


def test_9_each_misleading_error_names_the_variable_or_argument(ranks):
    for rank, out in enumerate(_per_rank(ranks, "item9")):
        for case, (kind, text) in {
            "FUSION_BRIDGE_SHADOW=reference:0": ("EnvVarError", "FUSION_BRIDGE_SHADOW must be"),
            "FUSION_BRIDGE_SHADOW=nosuch": ("EnvVarError", "FUSION_BRIDGE_SHADOW must be"),
            "FUSION_BRIDGE_SHADOW=reference:1_0": ("EnvVarError", "FUSION_BRIDGE_SHADOW must be"),
            "timeout 1_000": ("EnvVarError", "FUSION_BRIDGE_BUILD_TIMEOUT_S must be"),
            "timeout arabic-indic digits": ("EnvVarError", "FUSION_BRIDGE_BUILD_TIMEOUT_S must"),
            "timeout vertical tab": ("EnvVarError", "FUSION_BRIDGE_BUILD_TIMEOUT_S must be"),
            "lowercase name": ("EnvVarError", "did you mean FUSION_BRIDGE_DEBUG?"),
            "dashes": ("EnvVarError", "did you mean FUSION_BRIDGE_DEBUG?"),
            "build_timeout_s=10**400": ("ValueError", "build_timeout_s must be a number"),
            "shadow='reference:often'": ("ValueError", "FusionBridge: shadow must be"),
        }.items():
            r = out[case]
            assert r["kind"] == kind and text in r["msg"], (rank, case, r)
        assert out["build_timeout_s=np.int64(30)"]["kind"] == "built", out
        assert out["cache_dir"], (rank, "~ in FUSION_BRIDGE_CACHE_DIR must be expanded")


def test_an_interrupt_entering_the_all_reduce_breaks_the_group_on_every_rank(ranks):
    waits = _per_rank(ranks, "waits")
    erring, peer = waits[ERRING], waits[0]
    assert erring["entering"]["kind"] == "KeyboardInterrupt", erring["entering"]
    assert any("unusable" in n for n in erring["entering"]["notes"]), erring["entering"]
    assert peer["entering"]["kind"] != "ok", ("the peer must raise, not return", peer["entering"])
    for r in (erring["entering_later"], peer["entering_later"]):
        assert r["kind"] == "EpilogueInputError" and "unusable" in r["msg"], r
        assert r["seconds"] < 2, r


# ---------------------------------------------------------------- in one process, no spawn
def _fingerprint_function():
    try:
        from fusion_bridge.call.debug_call import replicated_fingerprint
    except ImportError:  # the code as issue 42 found it
        from fusion_bridge.call.failure import replicated_fingerprint
    return replicated_fingerprint


def test_5_the_debug_fingerprint_needs_no_copy_the_size_of_the_input(monkeypatch):
    from torch.profiler import ProfilerActivity, profile

    from fusion_bridge.call import checksum

    fingerprint = _fingerprint_function()
    # a small chunk, so a small residual spans many (the real chunk is DIGEST_CHUNK bytes)
    monkeypatch.setattr(checksum, "DIGEST_CHUNK", 4096)
    residual = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    inputs = make_inputs(SPEC, 64, seed=1)._replace(residual=residual.to(torch.bfloat16))
    size = residual.numel() * 2  # 64 KiB of bf16: 16 chunks
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        first = fingerprint(inputs)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest < size, (largest, size)  # its temporaries are bounded, not [T, H] x8
    assert fingerprint(inputs) == first  # deterministic
    swapped = inputs.residual.clone()
    swapped[[0, 40]] = swapped[[40, 0]]  # a permutation of rows is another step
    assert fingerprint(inputs._replace(residual=swapped)) != first


def test_8_fused_tp1_refuses_a_negative_view():
    from fusion_bridge import FusionBridge
    from fusion_bridge.call.validation import EpilogueInputError

    inputs = make_inputs(SPEC, 5, seed=3)
    with FusionBridge(SPEC, strategy="fused_tp1", self_test=False, tuning="off") as bridge:
        for name in ("gemm2_out", "residual", "shared_output", "gamma", "expert_weights"):
            bad = inputs._replace(**{name: torch._neg_view(getattr(inputs, name))})
            with pytest.raises(EpilogueInputError, match=f"{name} must be a tensor whose mem"):
                bridge(*bad)
        bridge(*inputs)  # and a good call right after


def test_9_the_cli_names_what_is_wrong(capfd, monkeypatch, tmp_path):
    import json

    from fusion_bridge.cli.main import main
    from fusion_bridge.tuning import tables

    assert main(["--version", "--json"]) == 0
    doc = json.loads(capfd.readouterr().out)
    assert doc["command"] == "version" and doc["version"]
    small = ["--hidden", "64", "--top-k", "2", "--tokens", "3", "--max-tokens", "8"]
    assert main(["parity", *small, "--seed", str(2**63 - 1)]) == 0, capfd.readouterr().err
    capfd.readouterr()
    monkeypatch.setenv("FUSION_BRIDGE_STRATEGY", "reference")
    assert main(["parity", *small]) == 2
    assert "FUSION_BRIDGE_STRATEGY=reference leaves nothing to compare" in capfd.readouterr().err
    monkeypatch.delenv("FUSION_BRIDGE_STRATEGY")
    # a shipped table whose content was measured for another GPU is not used by `explain`
    monkeypatch.setattr(tables, "TABLES_DIR", tmp_path)
    described = ["explain", "--gpu", "NVIDIA H200", "--world-size", "2", *small[:4]]
    spec = EpilogueSpec(hidden_size=64, top_k=2, max_tokens=8192)
    env = Environment(world_size=2, gpu_name="NVIDIA H200", device_type="cuda", sm=90)
    table = tables.make_table(spec, env, {"separate": {"default": {1: 5.0}}})
    table["gpu"] = "NVIDIA H100"
    path = tables.default_table_path(spec, env)
    path.write_text(json.dumps(table))
    with pytest.warns(UserWarning, match="measured for gpu='NVIDIA H100'"):
        main(described)
    out = capfd.readouterr().out
    assert "no tuning table ships" in out and str(path) not in out, out


@pytest.mark.gpu
def test_8_on_a_gpu_fused_tp1_refuses_a_negative_view():
    from fusion_bridge import FusionBridge
    from fusion_bridge.call.validation import EpilogueInputError

    device = torch.device("cuda", torch.cuda.current_device())
    inputs = make_inputs(SPEC, 5, seed=3, device=device)
    with FusionBridge(SPEC, strategy="fused_tp1", device=device) as bridge:
        for name in ("gemm2_out", "residual", "shared_output", "gamma", "expert_weights"):
            bad = inputs._replace(**{name: torch._neg_view(getattr(inputs, name))})
            with pytest.raises(EpilogueInputError, match=f"{name} must be a tensor whose mem"):
                bridge(*bad)
        out = bridge(*inputs)
        assert not torch.isnan(out.norm_out).any()
