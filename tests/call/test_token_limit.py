"""A strategy's workspace holds max_tokens_per_call tokens: a call of exactly that many is taken,
one more is refused with an error naming T, the limit and the strategy."""

import pytest

from fusion_bridge.call.validation import check_token_limit
from fusion_bridge.epilogue_tensors import EpilogueInputError


def test_a_call_of_exactly_the_workspace_size_is_taken():
    check_token_limit(8, 8, "symm_fused_oneshot")
    check_token_limit(1, 1, "symm_fused_oneshot")
    check_token_limit(10**6, None, "separate")  # no limit


def test_one_token_more_than_the_workspace_is_refused_naming_both():
    with pytest.raises(EpilogueInputError) as info:
        check_token_limit(9, 8, "symm_fused_oneshot")
    message = str(info.value)
    assert "T" in message and "<= 8" in message and "9" in message
    assert "symm_fused_oneshot" in message
