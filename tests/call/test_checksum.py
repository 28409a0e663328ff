"""The one digest every same-inputs check uses (call/checksum.py): no collision by construction,
order-sensitive, streamed in bounded pieces, and the only one (issue 54 item 8, issue 46)."""

import pathlib

import pytest
import torch

from fusion_bridge.call import checksum
from fusion_bridge.call.checksum import tensor_digest
from fusion_bridge.call.debug_call import replicated_fingerprint
from fusion_bridge.oracle.synthetic import make_inputs
from fusion_bridge.spec import EpilogueSpec

SPEC = EpilogueSpec(hidden_size=64, top_k=2, routed_scaling_factor=1.0)
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_prompts_that_fooled_the_weighted_sum_differ():
    """+9 at weight 1 and -1 at weight 9 cancelled in the position-weighted byte sum: prompts
    [100, 50, ...] and [109, 49, ...] passed check_same_inputs."""
    a = torch.tensor([100, 50, 7, 3, 11])
    b = torch.tensor([109, 49, 7, 3, 11])
    assert tensor_digest(a) != tensor_digest(b)
    assert tensor_digest(a) == tensor_digest(a.clone())


def test_a_residual_whose_element_0_goes_from_1_to_0_254_is_another_step():
    """bf16 1.0 is bytes (0x80, 0x3F), 0.254 is (0x82, 0x3E): +2 at weight 1, -1 at weight 2."""
    inputs = make_inputs(SPEC, 4, seed=3)
    residual = inputs.residual.to(torch.bfloat16)
    residual[0, 0] = 1.0
    changed = residual.clone()
    changed[0, 0] = 0.254
    assert changed[0, 0].view(torch.int16) != residual[0, 0].view(torch.int16)
    first = replicated_fingerprint(inputs._replace(residual=residual))
    second = replicated_fingerprint(inputs._replace(residual=changed))
    assert first[0] != second[0] and first[1] == second[1]


def test_moving_bytes_changes_it_the_position_weight_of_issue_52():
    """A permutation of the bytes (two rows swapped, byte 0 moved) is another input."""
    x = torch.arange(64, dtype=torch.uint8).reshape(8, 8)
    swapped = x.clone()
    swapped[[0, 5]] = swapped[[5, 0]]
    moved = x.clone()
    moved.view(-1)[[0, 1]] = moved.view(-1)[[1, 0]]
    digests = {tensor_digest(t) for t in (x, swapped, moved)}
    assert len(digests) == 3


def test_dtype_and_shape_are_part_of_it():
    x = torch.zeros(4, 4, dtype=torch.int32)
    others = (x.view(torch.float32), x.reshape(2, 8), x.view(torch.int16), x)
    assert len({tensor_digest(t) for t in others}) == 4  # same bytes, another dtype or shape


def test_any_layout_reads_the_same_values_in_bounded_pieces(monkeypatch):
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(checksum, "DIGEST_CHUNK", 512)
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    for view in (x[:, ::3], x.t(), x[::2], x[:, 7], x[3], x.t()[::5]):
        assert tensor_digest(view) == tensor_digest(view.contiguous()), view.stride()
    assert tensor_digest(torch.tensor(2.5)) == tensor_digest(torch.tensor(2.5))
    strided = x.t()  # not contiguous: read row block by row block, never copied whole
    size = x.numel() * x.element_size()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        tensor_digest(strided)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest <= 1024 < size, (largest, size)


def test_what_it_cannot_read_is_named():
    with pytest.raises(TypeError, match="expected a torch.Tensor, got list"):
        tensor_digest([1, 2])
    with pytest.raises(ValueError, match="zero tensor"):
        tensor_digest(torch._efficientzerotensor((2, 3)))
    with pytest.raises(ValueError, match="meta"):
        tensor_digest(torch.empty(2, device="meta"))


def test_one_checksum_in_the_product():
    """Issue 46: one name and one module for the checksum. The weighted byte sum's modulus appears
    (`% 65521`) is computed nowhere in fusion_bridge/call or fusion_bridge/ranks any more."""
    for folder in ("fusion_bridge/call", "fusion_bridge/ranks"):
        for path in (ROOT / folder).glob("*.py"):
            text = path.read_text()
            assert "% 65521" not in text and "def tensor_fingerprint" not in text, path
