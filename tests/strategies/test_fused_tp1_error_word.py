"""`fused_tp1`'s run reads the split rows' error word in place (`FusedTp1Strategy.run`): a word an
earlier launch left raises once, naming the timeout, and the next call runs; no word, no raise."""

from __future__ import annotations

import pytest
import torch

from fusion_bridge import EpilogueSpec, FusionBridge
from fusion_bridge.oracle.synthetic import make_inputs


def test_an_error_word_left_by_an_earlier_launch_raises_once_then_calls_run():
    spec = EpilogueSpec(hidden_size=128, top_k=2)
    with FusionBridge(spec, None, strategy="fused_tp1", self_test=False) as bridge:
        strategy = bridge._instances["fused_tp1"]
        inputs = make_inputs(spec, 3, device=bridge.device)
        want = strategy.run(inputs)  # no word: runs
        strategy._launcher._error_word[0] = 1  # as a split launch that gave up leaves it
        with pytest.raises(RuntimeError, match="timed out waiting for the other programs"):
            strategy.run(inputs)
        assert strategy._launcher._error_word[0] == 0  # taken: reported once
        got = strategy.run(inputs)
        assert torch.equal(got.residual_out, want.residual_out)
        assert torch.equal(got.norm_out, want.norm_out)
