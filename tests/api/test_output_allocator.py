"""`OutputAllocator` (epilogue_tensors.py): the hot path's outputs are what `allocate_outputs`
gives, for every quant and T, fresh on every call, whatever T came before (its templates are kept
per T); and a bridge call's outputs through it are the caller's own."""

from __future__ import annotations

import pytest
import torch

from fusion_bridge import EpilogueSpec, FusionBridge, QuantSpec
from fusion_bridge.epilogue_tensors import OutputAllocator, allocate_outputs
from fusion_bridge.oracle.synthetic import make_inputs

H, K = 256, 4
QUANTS = {
    "none": QuantSpec.none(),
    "fp8": QuantSpec.fp8(2.0),
    "nvfp4_swizzled": QuantSpec.nvfp4(336.0),
    "nvfp4_linear": QuantSpec.nvfp4(336.0, sf_layout="linear"),
    # dynamic FP8: scales as views of another storage (column-major, the TMA layout's padding)
    "fp8_group_row_major": QuantSpec.fp8_per_token_group(64, "row_major"),
    "fp8_group_column_major": QuantSpec.fp8_per_token_group(64, "column_major"),
    "fp8_group_column_major_tma": QuantSpec.fp8_per_token_group(64, "column_major_tma"),
    "fp8_per_token": QuantSpec.fp8_per_token(),
}


def _described(outputs) -> dict:
    return {
        name: (tuple(t.shape), t.stride(), t.dtype, t.device, t.is_contiguous())
        for name, t in outputs.named().items()
    }


def _spans(outputs) -> list[tuple[int, int]]:
    return sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for t in outputs.named().values()
        if t.numel()
    )


@pytest.mark.parametrize("quant", list(QUANTS))
def test_outputs_are_allocate_outputs_for_every_t_in_any_order(quant):
    spec = EpilogueSpec(hidden_size=H, top_k=K, quant=QUANTS[quant])
    device = torch.device("cpu")
    allocate = OutputAllocator(spec, device)
    for tokens in (1, 64, 3, 1, 0, 129, 64, 0, 1):  # repeats: the templates kept per T
        got, want = allocate(tokens), allocate_outputs(spec, tokens, device)
        assert _described(got) == _described(want), (quant, tokens)
        assert (got.quant is None, got.scale is None) == (want.quant is None, want.scale is None)


@pytest.mark.parametrize("quant", ["none", "nvfp4_swizzled"])
def test_every_call_gets_fresh_tensors_sharing_nothing(quant):
    spec = EpilogueSpec(hidden_size=H, top_k=K, quant=QUANTS[quant])
    allocate = OutputAllocator(spec, torch.device("cpu"))
    kept = [allocate(5) for _ in range(3)]  # all alive at once
    spans = sorted(s for out in kept for s in _spans(out))
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, spans  # no two outputs of any call overlap
    storages = [t.untyped_storage().data_ptr() for o in kept for t in o.named().values()]
    assert len(set(storages)) == len(storages)  # one allocation per output
    bases = {b.untyped_storage().data_ptr() for b in allocate._bases.values()}
    assert not bases & set(storages)  # none is a template's memory


@pytest.mark.parametrize("quant", ["none", "nvfp4_swizzled"])
def test_a_bridge_calls_outputs_are_its_own_and_match_a_fresh_allocation(quant):
    spec = EpilogueSpec(hidden_size=H, top_k=K, quant=QUANTS[quant])
    with FusionBridge(spec, None, strategy="fused_tp1", self_test=False) as bridge:
        for tokens in (2, 7, 2):
            inputs = make_inputs(spec, tokens, device=bridge.device)
            a = bridge.finalize_epilogue(*inputs)
            b = bridge.finalize_epilogue(*inputs)
            assert _described(a) == _described(allocate_outputs(spec, tokens, bridge.device))
            assert not set(_spans(a)) & set(_spans(b))
            for name, t in a.named().items():
                assert torch.equal(t, b.named()[name]), name
