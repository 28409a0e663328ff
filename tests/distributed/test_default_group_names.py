"""The default process group under both its names (`group=None` and `dist.group.WORLD`) is one
group to the failure protocol, over a real gloo group of 2 ranks on CPU.

A rank that cannot take part in a call marks every bridge of this process on that group broken
(call/failure.break_group): the group is out of step on this rank. A bridge built with the other
name of the default group is on the same group; if it did not refuse, its next call's all-reduce
would pair with a peer's pending call (issue 52: norm_out off by 0.92, no error). Here both ranks
break one bridge (inputs that disagree in T: no collective is entered) and then call the other
bridge with valid inputs: each call must be refused at once, naming the bridge that broke it,
whichever name broke it. Had it run, its all-reduce would have paired with the other rank's.
"""

from __future__ import annotations

import torch

from fusion_bridge.cli.launch import run_distributed
from tests.distributed.test_rank_disagreement import RUN_TIMEOUT_S, _build, _call, _good
from tests.distributed.test_wrong_majority import _disagreeing


def _both_names(rank, world_size):
    world = torch.distributed.group.WORLD
    out = {}
    for broken_name, other_name in (("None", "WORLD"), ("WORLD", "None")):
        groups = {"None": None, "WORLD": world}
        with (
            _build(groups[broken_name]) as broken,
            _build(groups[other_name]) as other,
        ):
            inputs, _ = _good(world_size, rank, 4, seed=60)
            first = _call(broken, _disagreeing(inputs, "three_empty"))
            inputs, exact = _good(world_size, rank, 4, seed=61)
            out[broken_name] = (first, _call(other, inputs, exact), broken.name)
    torch.distributed.barrier()
    return out


def test_a_bridge_on_the_other_name_of_the_default_group_refuses_after_a_break():
    results = run_distributed(_both_names, 2, backend="gloo", timeout_s=RUN_TIMEOUT_S)
    for rank, out in enumerate(results):
        for broken_name, (first, later, broke_it) in out.items():
            where = (rank, f"broken on group={broken_name}")
            assert first["kind"] == "EpilogueInputError", (where, first)
            assert "they disagree" in first["msg"], (where, first["msg"])
            assert later["kind"] == "EpilogueInputError", (where, "not refused", later)
            assert "another FusionBridge on the same process group" in later["msg"], where
            assert f"same process group ({broke_it}) broke it" in later["msg"], (where, later)
