"""Issue 22 over real gloo groups on CPU: any failure on one rank keeps the group in step.

Each rank function catches what it expects and returns a summary
(tests/distributed/test_rank_disagreement.py
has the helpers and says why the runs cannot hang); the parent asserts per rank, against the
float64 oracle. The cases:
  - exotic tensors on one rank (sparse CSR residual, nested gemm2_out): their metadata checks used
    to raise a raw RuntimeError before the rank took part, and the next calls paired wrongly;
  - an allocation failure injected inside the strategy, before its collective, on one rank (stands
    for a GPU out-of-memory on one rank): the rank takes part with the NaN payload, then raises the
    original error; the next call is correct everywhere;
  - a failure after the collective: the group is already in step, the peers' values are correct;
  - debug mode with a rank that skips a call: every rank raises, naming the call numbers;
  - per-rank arguments that must agree (eager_us on one rank only) and a rank outside the group.
"""

from __future__ import annotations

import pytest
import torch

from fusion_bridge.cli.launch import run_distributed
from tests.distributed.test_rank_disagreement import (
    RUN_TIMEOUT_S,
    _assert_correct,
    _assert_nan,
    _build,
    _call,
    _finish,
    _good,
    _group,
)

INJECTED = "out of memory (injected on one rank)"


class _FailOnce:
    """Replace module.name with a function that raises `INJECTED` on its first call only."""

    def __init__(self, module, name: str) -> None:
        self.module, self.name, self.real = module, name, getattr(module, name)
        setattr(module, name, self)

    def __call__(self, *args, **kwargs):
        setattr(self.module, self.name, self.real)
        raise RuntimeError(INJECTED)


def _one_rank_fails_in_many_ways(rank, world_size):
    from fusion_bridge.strategies import separate

    group = _group(world_size)
    erring = world_size - 1
    out = []
    with _build(group) as bridge:
        for i, how in enumerate(("sparse_residual", "nested_gemm2", "oom_before", "after", None)):
            inputs, exact = _good(world_size, rank, 5 - i % 2, seed=50 + i)
            if rank == erring and how == "sparse_residual":
                inputs = inputs._replace(residual=inputs.residual.to_sparse_csr())
            elif rank == erring and how == "nested_gemm2":
                g = inputs.gemm2_out
                inputs = inputs._replace(gemm2_out=torch.nested.nested_tensor([g[:2], g[2:]]))
            elif rank == erring and how == "oom_before":
                _FailOnce(separate, "finalize_fp32")
            elif rank == erring and how == "after":
                _FailOnce(separate, "residual_norm_outputs")
            r = _call(bridge, inputs, exact)
            r["erring"] = rank == erring and how is not None
            out.append((how, r))
    _finish(group)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_any_failure_before_the_collective_takes_part_and_the_next_call_is_correct(world_size):
    results = run_distributed(
        _one_rank_fails_in_many_ways, world_size, backend="gloo", timeout_s=RUN_TIMEOUT_S
    )
    for rank, calls in enumerate(results):
        for how, r in calls:
            where = (rank, how)
            if how is None:
                _assert_correct(r, where)
            elif r["erring"]:
                assert r["unchanged"], (where, "inputs modified")
                if how == "sparse_residual":
                    assert (
                        r["input_error"] and "residual must be a dense (strided) tensor" in r["msg"]
                    ), (where, r)
                elif how == "nested_gemm2":
                    assert r["input_error"] and "gemm2_out" in r["msg"], (where, r)
                else:  # the strategy's own error, unchanged in type and text
                    assert r["kind"] == "RuntimeError" and INJECTED in r["msg"], (where, r)
            elif how == "after":  # the erring rank's collective ran: its peers are correct
                _assert_correct(r, where)
            else:
                _assert_nan(r, where)


def _skips_a_call_in_debug_mode(rank, world_size):
    group = _group(world_size)
    out = []
    with _build(group, debug=True) as bridge:
        # rank 1 skips step 1 (and makes one step more at the end, so every rank makes 4 calls and
        # the run ends in step): its next call carries step 2's data into the peers' step 1
        steps = (0, 2, 3, 4) if rank == 1 else (0, 1, 2, 3)
        for i in steps:
            inputs, exact = _good(world_size, rank, 4, seed=60 + i)
            out.append(_call(bridge, inputs, exact))
    _finish(group)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_debug_mode_names_a_skipped_call_on_every_rank(world_size):
    results = run_distributed(
        _skips_a_call_in_debug_mode, world_size, backend="gloo", timeout_s=RUN_TIMEOUT_S
    )
    for rank, calls in enumerate(results):
        _assert_correct(calls[0], (rank, "call 0"))
        # rank 1's next call is the peers' call 1 with call 2's data: every rank raises, and
        # every call after it too (the counts stay apart), never a value
        first_out_of_step = calls[1]
        assert first_out_of_step["kind"] == "GroupInputError", (rank, first_out_of_step)
        message = first_out_of_step["msg"]
        # the call numbers agree (rank 1 skipped a call), its inputs do not: the message says so
        assert "the ranks of the group are on the same call (bridge 0 call 2)" in message, message
        assert "the residual differs on rank 1 from rank 0" in message, message
        assert "the expert weights differ on rank 1 from rank 0" in message, message
        # from the call after, the peers' inputs are the ones rank 1 passed at its previous call
        assert "rank 0 is one call behind rank 1" in calls[2]["msg"], calls[2]["msg"]
        assert all(c["kind"] == "GroupInputError" for c in calls[1:]), (rank, calls)
        assert all(c["unchanged"] for c in calls), (rank, "inputs modified")


def _per_rank_arguments(rank, world_size):
    from fusion_bridge.ranks.agreement import RankAgreementError

    group = _group(world_size)
    out = {}
    try:
        _build(group, eager_us={"separate": {"default": {1: 5.0}}} if rank == 1 else None)
        out["eager_us"] = ("built", "")
    except RankAgreementError as exc:
        out["eager_us"] = (type(exc).__name__, str(exc))
    only_rank0 = torch.distributed.new_group([0], backend="gloo")
    if rank == 1:
        try:
            _build(only_rank0)
            out["non_member"] = ("built", "")
        except ValueError as exc:
            out["non_member"] = (type(exc).__name__, str(exc))
    _finish(group)
    return out


def test_arguments_that_differ_per_rank_and_a_rank_outside_the_group_are_named():
    results = run_distributed(_per_rank_arguments, 2, backend="gloo", timeout_s=RUN_TIMEOUT_S)
    for rank, out in enumerate(results):
        kind, message = out["eager_us"]
        assert kind == "RankAgreementError" and "eager_us_given" in message, (rank, message)
        # one field, not the eager plan's per-bucket routes
        assert "eager_route_by_bucket" not in message, message
    kind, message = results[1]["non_member"]
    assert kind == "ValueError" and "group must be a process group this process belongs to" in (
        message
    ), message
    assert "global rank 1 is not one of its ranks [0]" in message, message
