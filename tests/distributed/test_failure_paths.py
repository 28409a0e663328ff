"""Issue 41's failure paths over one real gloo group of 2 ranks on CPU (one spawn, shared by the
tests through a module fixture: a spawn costs more than every call here together). Each case runs
on its own bridge; every rank function catches what it expects and returns it, the parent asserts
per rank against the float64 oracle (tests/distributed/test_rank_disagreement.py has the helpers
and says why a run cannot hang).

  shadow     shadow sampling every 2nd call, rank 1's first call fails before its collective: it
             takes part in the call's route and in the shadow run its peers sample, so the next
             calls are correct everywhere (a rank that skipped the shadow ran one behind for good)
  quantized  FP8, NVFP4 and dynamic FP8 specs, rank 1's first call fails: rank 0's quantized
             outputs are NaN as quant_ref writes them (NaN fp8 codes, NaN NVFP4 block scales, NaN
             dynamic FP8 scales with codes 0x7F), not finite codes
  threads    a call held inside its strategy on a second thread while the main thread calls the
             same bridge: refused with ConcurrentCallError on each rank; the held call raises
             after its collective instead of returning (on a peer the threads may have gone the
             other way); the bridge then refuses every later call
"""

from __future__ import annotations

import threading

import pytest

from fusion_bridge.cli.launch import run_distributed
from fusion_bridge.spec import EpilogueSpec, QuantSpec
from tests import oracle64
from tests.helpers import once_per_run
from tests.distributed.test_rank_disagreement import (
    RUN_TIMEOUT_S,
    TOL,
    _assert_correct,
    _assert_nan,
    _bad,
    _build,
    _call,
    _finish,
    _good,
    _group,
)

QUANTIZED = (  # (spec, strategy): our kernels (local_fused_nccl) and the torch path
    (EpilogueSpec(hidden_size=64, top_k=2, quant=QuantSpec.fp8(0.02)), "local_fused_nccl"),
    (
        EpilogueSpec(hidden_size=64, top_k=2, quant=QuantSpec.nvfp4(448.0, "linear")),
        "local_fused_nccl",
    ),
    # swizzled scales through the torch path only: our norm kernel launches 128 programs for them,
    # slow under the interpreter (tests/kernels/test_quant_ranges.py covers the layout's NaN rows)
    (EpilogueSpec(hidden_size=64, top_k=2, quant=QuantSpec.nvfp4(448.0)), "separate"),
    # dynamic FP8: NaN rows NaN-scaled, every code 0x7F (docs/math.md section 3)
    (
        EpilogueSpec(
            hidden_size=64, top_k=2, quant=QuantSpec.fp8_per_token_group(16, "column_major_tma")
        ),
        "local_fused_nccl",
    ),
    (EpilogueSpec(hidden_size=64, top_k=2, quant=QuantSpec.fp8_per_token()), "separate"),
)


def _shadow(rank, world_size, group):
    out = []
    # the shadow is `separate` itself: its collective is the selected route's (same shape and
    # dtype), so a rank whose runs drift out of step pairs calls silently instead of crashing gloo
    with _build(group, shadow="separate:2") as bridge:
        for i in range(4):
            inputs, exact = _good(world_size, rank, 4, seed=70 + i)
            if rank == 1 and i == 0:
                inputs = _bad(inputs, "gamma_dtype")
            out.append(_call(bridge, inputs, exact))
        shadow = bridge.explain().to_dict()["shadow"]
    return out, shadow


def _quantized(rank, world_size, group):
    from tests.helpers import quant_problems

    out = []
    for spec, strategy in QUANTIZED:
        with _build(group, spec, strategy=strategy) as bridge:
            for i in range(2):
                inputs, exact = _good(world_size, rank, 4, seed=90 + i, spec=spec)
                failing = rank == 1 and i == 0
                try:
                    got = bridge(*(_bad(inputs, "gamma_dtype") if failing else inputs))
                except Exception as exc:  # returned to the parent, which asserts on it
                    out.append((strategy, i, type(exc).__name__, str(exc)))
                    continue
                nan_rows = range(4) if i == 0 else ()  # a peer of the failing rank: all NaN
                problems = quant_problems(spec.quant, got.norm_out, got.quant, got.scale, nan_rows)
                err = oracle64.normwise_rel_err(got.norm_out, exact[1]) if i else None
                out.append((strategy, i, "ok", (problems, err)))
    return out


def _threads(rank, world_size, group):
    from fusion_bridge.registry import register
    from tests.strategy_fixture import PausingSeparate

    register(PausingSeparate.name, "tests.strategy_fixture:PausingSeparate")
    out = {}
    with _build(group, strategy=PausingSeparate.name) as bridge:
        held, held_exact = _good(world_size, rank, 4, seed=100)
        PausingSeparate.reset(hold=True)
        running = {}
        thread = threading.Thread(
            target=lambda: running.update(r=_call(bridge, held, held_exact)), name="caller-a"
        )
        thread.start()
        assert PausingSeparate.entered.wait(60)
        other, _ = _good(world_size, rank, 4, seed=101)
        out["refused"] = _call(bridge, other)
        PausingSeparate.release.set()
        thread.join(60)
        out["held"] = running["r"]
        PausingSeparate.reset(hold=False)
        later, _ = _good(world_size, rank, 4, seed=102)
        out["later"] = _call(bridge, later)
    return out


def _failure_paths(rank, world_size):
    group = _group(world_size)
    out = {
        "shadow": _shadow(rank, world_size, group),
        "quantized": _quantized(rank, world_size, group),
        "threads": _threads(rank, world_size, group),
    }
    _finish(group)
    return out


@pytest.fixture(scope="module")
def failure_paths(tmp_path_factory):
    return once_per_run(  # one spawned group per run: xdist workers share it
        tmp_path_factory,
        "failure_paths",
        lambda _: run_distributed(_failure_paths, 2, backend="gloo", timeout_s=RUN_TIMEOUT_S),
    )


def test_a_rank_that_fails_takes_part_in_the_sampled_shadow_run_too(failure_paths):
    """Had the failing rank skipped the shadow run, its counter would lag and every later run pair
    with a peer's other one (calls 1 and 3 wrong on rank 1; with a shadow of another collective
    shape gloo aborts the process)."""
    for rank, result in enumerate(failure_paths):
        calls, shadow = result["shadow"]
        shadow_calls = shadow["calls"]
        first = calls[0]
        if rank == 1:
            assert first["input_error"] and "gamma.dtype" in first["msg"], first
        else:
            _assert_nan(first, (rank, "call 0"))
        for i, r in enumerate(calls[1:], start=1):
            _assert_correct(r, (rank, f"call {i} after the failed one"))
        assert shadow_calls == 4, (rank, "shadow sampling counter", shadow_calls)
        if rank == 0:  # the sampled call 0 was NaN by rank 1's failure payload: not a divergence
            assert shadow["peer_failed"] == 1 and shadow["sampled"] == 1, shadow
            for name, stats in shadow["outputs"].items():
                assert stats["max_rel_err"] < 1e-2, (name, stats)  # was inf


def test_the_peers_of_a_failing_rank_get_nan_in_their_quantized_outputs_too(failure_paths):
    """Then the next call is correct everywhere, its codes quant_ref's of its norm_out."""
    for rank, result in enumerate(failure_paths):
        for strategy, i, kind, detail in result["quantized"]:
            where = (rank, strategy, f"call {i}")
            if rank == 1 and i == 0:
                assert kind == "EpilogueInputError" and "gamma.dtype" in detail, (where, detail)
                continue
            assert kind == "ok", (where, detail)
            problems, err = detail
            assert not problems, (where, problems)
            assert i == 0 or err <= TOL, (where, err)


def test_a_call_from_a_second_thread_while_one_runs_is_refused_on_every_rank(failure_paths):
    for rank, result in enumerate(failure_paths):
        r = result["threads"]
        refused, held, later = r["refused"], r["held"], r["later"]
        assert refused["kind"] == "ConcurrentCallError", (rank, refused)
        assert "while another thread's call of it was running" in refused["msg"], refused["msg"]
        assert refused["seconds"] < 5, (rank, "refused at once, no collective", refused)
        # the held call's collective ran, but a refusal came while it ran: on a peer the two
        # threads may have gone the other way, so it raises rather than return what it paired with
        assert held["kind"] == "EpilogueInputError", (rank, held)
        assert "ConcurrentCallError" in held["msg"] and held["unchanged"], (rank, held)
        assert later["kind"] == "EpilogueInputError", (rank, later)
        assert "rebuild every FusionBridge" in later["msg"], later["msg"]
        assert "ConcurrentCallError" in later["msg"], later["msg"]
        assert refused["unchanged"] and later["unchanged"], rank
