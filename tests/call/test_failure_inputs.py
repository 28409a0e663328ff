"""What the failure protocol reads from a call's inputs (call/payload.py, call/debug_call.py): the
group's T when the [T, ...] inputs disagree, and debug mode's fingerprint of the inputs every rank
holds identical. Both run on every rank of a group; here they are called directly (the gloo tests
in tests/distributed/ run them through the bridge)."""

import torch

from fusion_bridge import EpilogueSpec
from fusion_bridge.call.debug_call import replicated_fingerprint
from fusion_bridge.call.payload import group_tokens, unanimous_tokens
from fusion_bridge.oracle.synthetic import make_inputs

SPEC = EpilogueSpec(hidden_size=64, top_k=2)


def _rows(t, n):
    """t with n rows (its first rows repeated as needed)."""
    return t[torch.arange(n) % t.shape[0]].contiguous()


def test_the_group_t_needs_a_majority_of_the_inputs_and_a_tie_gives_none():
    """T is what more than half of the [T, ...] inputs the spec expects say (3 of 4, or 2 of 3
    without a shared output). A tie is never broken: either side may be the malformed one, and a
    payload of the wrong T crashes or corrupts the peers' collective (issue 42), so the rank does
    not guess (None: it cannot take part)."""
    inp = make_inputs(SPEC, 4, seed=1)
    perm, weights, residual = inp.expanded_idx_to_permuted_idx, inp.expert_weights, inp.residual
    assert group_tokens(inp, True) == 4
    # majority: three inputs say 4, the residual 3
    assert group_tokens(inp._replace(residual=_rows(residual, 3)), True) == 4
    # two against two, either way round: no T
    two_two = inp._replace(
        expanded_idx_to_permuted_idx=_rows(perm, 5), expert_weights=_rows(weights, 5)
    )
    assert group_tokens(two_two, True) is None
    assert (
        group_tokens(
            inp._replace(residual=_rows(residual, 5), expanded_idx_to_permuted_idx=_rows(perm, 5)),
            True,
        )
        is None
    )
    # one against one (weights 1-D, no shared output): no T
    no_shared = dict(shared_output=None)
    one_one = two_two._replace(expert_weights=weights.reshape(-1), **no_shared)
    assert group_tokens(one_one, False) is None
    # without a shared output two of the three are a majority, whichever two
    assert group_tokens(inp._replace(expert_weights=weights.reshape(-1), **no_shared), False) == 4
    assert group_tokens(inp._replace(residual=residual.tolist(), **no_shared), False) == 4
    # a shared output the spec expects but the call lacks counts against every T
    assert group_tokens(inp._replace(residual=_rows(residual, 5), **no_shared), True) is None
    # the residual unreadable and the index map and weights apart: no T
    no_residual = inp._replace(
        residual=residual.tolist(),
        expanded_idx_to_permuted_idx=_rows(perm, 5),
        expert_weights=_rows(weights, 6),
        **no_shared,
    )
    assert group_tokens(no_residual, False) is None
    assert (
        group_tokens(
            no_residual._replace(expanded_idx_to_permuted_idx=None, expert_weights=None), False
        )
        is None
    )


def test_a_shared_output_the_spec_has_none_of_still_says_t():
    """A call that passes a shared output to a spec without one (a validation error) still holds
    a T in it: it counts as a fourth [T, ...] input. Ignored, a 2-2 tie would look like 2 of 3
    (a guessed T), and three inputs of 0 rows would look unanimous beside a shared output of T:
    the rank would take part with T = 0, i.e. not at all, and its next call would pair with its
    peers' pending one."""
    inp = make_inputs(SPEC, 4, seed=2)  # the spec below has no shared output; this call has one
    perm, weights, residual = inp.expanded_idx_to_permuted_idx, inp.expert_weights, inp.residual
    assert group_tokens(inp, False) == unanimous_tokens(inp, False) == 4
    # the index map and weights say 5, the shared output and residual 4: a tie, no T
    tie = inp._replace(
        expanded_idx_to_permuted_idx=_rows(perm, 5), expert_weights=_rows(weights, 5)
    )
    assert group_tokens(tie, False) is None
    assert unanimous_tokens(tie, False) is None
    # three say 0 rows, the shared output says 4: a majority of 0, but not a unanimous one
    empty = inp._replace(expanded_idx_to_permuted_idx=perm[:0], expert_weights=weights[:0])
    empty = empty._replace(residual=residual[:0])
    assert group_tokens(empty, False) == 0
    assert unanimous_tokens(empty, False) is None
    # the same without the stray shared output: 0 rows everywhere, nothing to take part in
    assert unanimous_tokens(empty._replace(shared_output=None), False) == 0


def test_the_debug_fingerprint_covers_every_replicated_input_and_no_per_rank_one():
    """Ranks whose residual or expert weights differ are not on the same step: each changes its own
    checksum (a change of one element, one bit for the weights), so the error can name it.
    gemm2_out and the shared output are per-rank partials, and the index map is per rank in an
    expert-parallel layout (the Hugging Face patch's: -1 for the slots another rank holds): they
    differ between ranks on the same step and must not change it."""
    inp = make_inputs(SPEC, 4, seed=2, skip_fraction=0.0)
    base = replicated_fingerprint(inp)
    assert len(base) == 2 and all(base), base
    assert replicated_fingerprint(make_inputs(SPEC, 4, seed=2, skip_fraction=0.0)) == base
    residual = inp.residual.clone()
    residual[3, 5] = -residual[3, 5]
    weights = inp.expert_weights.clone()
    weights.view(torch.int32)[2, 1] ^= 1  # the last bit of one weight
    for index, changed in (
        (0, inp._replace(residual=residual)),
        (1, inp._replace(expert_weights=weights)),
    ):
        changed_print = replicated_fingerprint(changed)
        assert changed_print[index] != base[index], index
        assert changed_print[1 - index] == base[1 - index], index  # the other input's is its own
    perm = inp.expanded_idx_to_permuted_idx.clone()
    perm[::2] = -1  # this rank holds every other token's experts
    assert replicated_fingerprint(inp._replace(expanded_idx_to_permuted_idx=perm)) == base
    other_rank = make_inputs(SPEC, 4, rank=1, seed=2, skip_fraction=0.0)
    assert not torch.equal(other_rank.gemm2_out, inp.gemm2_out)
    assert replicated_fingerprint(other_rank) == base
