"""What the failure protocol reads from a call's inputs (call/payload.py, call/failure.py): the
group's T when the [T, ...] inputs disagree, and debug mode's fingerprint of the inputs every rank
holds identical. Both run on every rank of a group; here they are called directly (the gloo tests
in tests/distributed/ run them through the bridge)."""

import torch

from fusion_bridge import EpilogueSpec
from fusion_bridge.call.failure import replicated_fingerprint
from fusion_bridge.call.payload import group_tokens
from fusion_bridge.oracle.synthetic import make_inputs

SPEC = EpilogueSpec(hidden_size=64, top_k=2)


def _rows(t, n):
    """t with n rows (its first rows repeated as needed)."""
    return t[torch.arange(n) % t.shape[0]].contiguous()


def test_the_group_t_is_the_majority_and_a_tie_goes_to_the_residual():
    inp = make_inputs(SPEC, 4, seed=1)
    perm, weights = inp.expanded_idx_to_permuted_idx, inp.expert_weights
    assert group_tokens(inp) == 4
    # majority: three inputs say 4, the residual 3
    assert group_tokens(inp._replace(residual=_rows(inp.residual, 3))) == 4
    # two against two: the residual and the shared output say 4, the index map and weights 5
    two_two = inp._replace(
        expanded_idx_to_permuted_idx=_rows(perm, 5), expert_weights=_rows(weights, 5)
    )
    assert group_tokens(two_two) == 4
    # one against one (weights 1-D, no shared output): the residual's 4, not the index map's 5
    one_one = two_two._replace(expert_weights=weights.reshape(-1), shared_output=None)
    assert group_tokens(one_one) == 4
    # the residual unreadable: the index map's T wins a tie with the weights
    no_residual = inp._replace(
        residual=inp.residual.tolist(),
        expanded_idx_to_permuted_idx=_rows(perm, 5),
        expert_weights=_rows(weights, 6),
        shared_output=None,
    )
    assert group_tokens(no_residual) == 5
    assert (
        group_tokens(no_residual._replace(expanded_idx_to_permuted_idx=None, expert_weights=None))
        is None
    )


def test_the_debug_fingerprint_covers_every_replicated_input_and_no_per_rank_one():
    """Ranks whose residual, index map or expert weights differ are not on the same step: each
    changes the fingerprint (a change of one element, one bit for the weights). gemm2_out and the
    shared output are per-rank partials: they differ between ranks on the same step and must not."""
    inp = make_inputs(SPEC, 4, seed=2, skip_fraction=0.0)
    base = replicated_fingerprint(inp)
    assert replicated_fingerprint(make_inputs(SPEC, 4, seed=2, skip_fraction=0.0)) == base
    residual = inp.residual.clone()
    residual[3, 5] = -residual[3, 5]
    perm = inp.expanded_idx_to_permuted_idx.flip(0).contiguous()
    weights = inp.expert_weights.clone()
    weights.view(torch.int32)[2, 1] ^= 1  # the last bit of one weight
    for name, changed in (
        ("residual", inp._replace(residual=residual)),
        ("index map", inp._replace(expanded_idx_to_permuted_idx=perm)),
        ("expert weights", inp._replace(expert_weights=weights)),
    ):
        assert replicated_fingerprint(changed) != base, name
    other_rank = make_inputs(SPEC, 4, rank=1, seed=2, skip_fraction=0.0)
    assert not torch.equal(other_rank.gemm2_out, inp.gemm2_out)
    assert replicated_fingerprint(other_rank) == base
