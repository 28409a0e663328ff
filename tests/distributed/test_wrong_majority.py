"""Issue 54 item 7 over a real gloo group of 2 ranks on CPU: a rank whose [T, ...] inputs disagree
with each other in T never takes part with a guessed T (payload.unanimous_tokens).

Three wrong of four look like one wrong of four from the failing rank; a guess of 0 rows made the
peers' call pair with the rank's next one (plausible wrong values on every rank), a guess of T+1
made gloo abort the peer. Now such a rank marks its bridge broken (every later call refused at
once, naming the disagreement and what recovers) and its peers' call fails at the group's timeout:
loud on every rank, never a wrong value, never a killed peer.

  peer calls   the issue's case (index map, expert weights and shared output with 0 rows, the
               residual with T) while rank 0 calls with valid inputs, on a group of their own:
               rank 0's call raises at the group's (short) timeout, it returns no value
  alone        each disagreement on its own bridge, rank 0 not calling (it would wait for the
               group's timeout): the erring rank raises naming every input's rows, enters no
               collective, and refuses the next call at once
"""

from __future__ import annotations

import torch

from fusion_bridge.cli.launch import run_distributed
from tests.distributed.round_two_cases import SHORT_TIMEOUT
from tests.distributed.test_rank_disagreement import (
    RUN_TIMEOUT_S,
    _assert_correct,
    _build,
    _call,
    _count_collectives,
    _finish,
    _good,
    _group,
)

T_INPUTS = ("expanded_idx_to_permuted_idx", "expert_weights", "shared_output")


def _disagreeing(inputs, how):
    """This rank's inputs with their [T, ...] tensors disagreeing in T, as `how` says."""
    if how == "three_empty":  # 3 of 4 say 0, the residual says T
        return inputs._replace(**{k: getattr(inputs, k)[:0] for k in T_INPUTS})
    if how == "three_extra":  # 3 of 4 say T+1
        return inputs._replace(
            **{k: torch.cat([getattr(inputs, k), getattr(inputs, k)[:1]]) for k in T_INPUTS}
        )
    perm = inputs.expanded_idx_to_permuted_idx
    if how == "index_extra_row":  # 1 of 4 says T+1
        return inputs._replace(expanded_idx_to_permuted_idx=torch.cat([perm, perm[:1]]))
    if how == "residual_shape":  # 1 of 4 says T-1
        return inputs._replace(residual=inputs.residual[:-1].contiguous())
    raise AssertionError(how)


HOWS = ("three_empty", "three_extra", "index_extra_row", "residual_shape")


def _wrong_majority(rank, world_size):
    group = _group(world_size)
    out = {"alone": {}}
    # a group of its own: the peer's call fails at its timeout, which leaves it unusable; every
    # collective of the build before that is an ordinary one. The timeout is round two's
    # SHORT_TIMEOUT (3 s, as for the subgroups where a peer waits out a collective there), not
    # GROUP_TIMEOUT's 20 s: the peer sits idle for all of it.
    apart = torch.distributed.new_group(
        list(range(world_size)), timeout=SHORT_TIMEOUT, backend="gloo"
    )
    with _build(apart) as bridge:
        inputs, exact = _good(world_size, rank, 4, seed=40)
        if rank == 1:
            inputs = _disagreeing(inputs, "three_empty")
        out["peer"] = _call(bridge, inputs, exact)
    counts = _count_collectives()
    for how in HOWS:
        with _build(group) as bridge:
            if rank == 1:
                inputs, _ = _good(world_size, rank, 4, seed=41)
                before = counts["n"]
                first = _call(bridge, _disagreeing(inputs, how))
                good, _ = _good(world_size, rank, 4, seed=42)
                later = _call(bridge, good)
                out["alone"][how] = (first, later, counts["n"] - before)
    with _build(group) as bridge:  # rebuilt on every rank: in step again
        inputs, exact = _good(world_size, rank, 5, seed=43)
        out["rebuilt"] = _call(bridge, inputs, exact)
    _finish(group)
    return out


def test_a_rank_whose_inputs_disagree_in_t_never_guesses_it():
    results = run_distributed(_wrong_majority, 2, backend="gloo", timeout_s=RUN_TIMEOUT_S)
    peer, erring = results[0]["peer"], results[1]["peer"]
    assert peer["kind"] != "ok", ("the peer must not get a value", peer)
    assert erring["kind"] == "EpilogueInputError" and "they disagree" in erring["msg"], erring
    for how, (first, later, collectives) in results[1]["alone"].items():
        assert first["kind"] == "EpilogueInputError", (how, first)
        assert "they disagree" in first["msg"] and "residual " in first["msg"], (how, first)
        assert "rebuild every FusionBridge" in first["msg"], (how, first["msg"])
        assert collectives == 0, (how, "entered a collective with a guessed T")
        assert later["kind"] == "EpilogueInputError" and later["seconds"] < 2, (how, later)
        assert first["unchanged"] and later["unchanged"], how
    for rank, out in enumerate(results):
        _assert_correct(out["rebuilt"], (rank, "after rebuilding"))
