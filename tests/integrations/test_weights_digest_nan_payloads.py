"""The model check's weight digest (integrations/weights_digest) treats every NaN of a floating
dtype as one NaN: two bf16 models that differ only in a NaN's payload bits agree, one that differs
in a value does not."""

import torch

from fusion_bridge.integrations.weights_digest import parameter_digests


def _model(dtype, nan_bits=None, value=None):
    model = torch.nn.Linear(8, 4, dtype=dtype)
    with torch.no_grad():
        model.weight.copy_(torch.arange(32, dtype=torch.float32).view(4, 8).to(dtype))
        model.bias.zero_()
        if nan_bits is not None:
            model.weight.view(torch.int16)[0, 0] = nan_bits
        if value is not None:
            model.weight[3, 7] = value
    return model


def test_bf16_and_fp16_nans_with_other_payloads_agree():
    for dtype, quiet, other in (
        (torch.bfloat16, 0x7FC0, -0x3F),  # -0x3F: 0xFFC1, a negative NaN with another payload
        (torch.float16, 0x7E00, 0x7C01),  # a quiet and a signalling NaN
    ):
        a, b = _model(dtype, quiet), _model(dtype, other)
        assert torch.isnan(a.weight[0, 0]) and torch.isnan(b.weight[0, 0])
        assert parameter_digests(a) == parameter_digests(b), dtype
        assert parameter_digests(a) != parameter_digests(_model(dtype, quiet, value=-1.0)), dtype
