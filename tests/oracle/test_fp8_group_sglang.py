"""How far SGLang's per-token-group FP8 formula lands from ours (vLLM 0.34's, `quant_ref`'s), on
normally distributed rows: the codes differ by at most one e4m3 step, on a small fraction of the
elements, never in sign; the scales differ in their last bits only.

    ours:   scale = max(amax, 1e-10) * fp32(1/448);  q = e4m3(clamp(x / scale))
    SGLang: scale = max(amax, 1e-10) / 448;          q = e4m3(clamp(x * (448 / max(amax, 1e-10))))

Both quotients approximate x * 448 / amax within a few fp32 roundings (a relative 2^-22 or so);
an e4m3 step is a relative 2^-3 to 2^-4, so the two round to different codes only where the exact
quotient lies within those few fp32 ulps of a rounding midpoint between two e4m3 values, and then
to the two neighbours of that midpoint: one step apart, the same sign."""

import torch

from fusion_bridge.oracle.quant_ref import (
    FP8_AMAX_EPS,
    e4m3_satfinite,
    quantize_fp8_per_token_group,
)

TOKENS, HIDDEN, GROUP = 256, 7168, 128


def sglang_per_token_group(x: torch.Tensor, group_size: int):
    """SGLang's formula in torch, each step one fp32 operation: the multiplier 448 / amax per group,
    then a product per element."""
    tokens, hidden = x.shape
    groups = x.float().reshape(tokens, hidden // group_size, group_size)
    amax = groups.abs().amax(dim=-1).clamp(min=FP8_AMAX_EPS)
    multiplier = torch.tensor(448.0) / amax
    q = e4m3_satfinite(groups * multiplier.unsqueeze(-1))
    return q.reshape(tokens, hidden), amax / torch.tensor(448.0)


def _rows(seed: int) -> torch.Tensor:
    """bf16 rows of normal values, each row at its own magnitude (log-normal), as norm_out rows
    scaled by gamma are."""
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.exp(torch.randn(TOKENS, 1, generator=g))
    return (torch.randn(TOKENS, HIDDEN, generator=g) * magnitude).to(torch.bfloat16)


def test_sglang_codes_differ_by_one_step_on_a_small_fraction():
    x = _rows(0)
    ours, our_scale = quantize_fp8_per_token_group(x, GROUP)
    theirs, their_scale = sglang_per_token_group(x, GROUP)
    a = ours.view(torch.uint8).int()
    b = theirs.view(torch.uint8).int()
    differ = a != b
    fraction = differ.float().mean().item()
    # Measured on this CPU (torch 2.13): 0.087% to 0.096% of the codes over 4 seeds of 512 x 7168
    # rows like these (this seed's 256 rows are within that range). Bound at 0.2%, about twice the
    # measured value: the fraction is set by how often a quotient falls within a few fp32 ulps of
    # an e4m3 midpoint (the module docstring), not by chance, so twice is a wide margin; the lower
    # bound shows the two formulas do differ on such rows (the reference is not SGLang's).
    assert 0.0002 <= fraction <= 0.002, fraction
    assert ((a - b).abs()[differ] == 1).all()  # one step: neighbouring codes of the same sign
    assert not ((a ^ b) & 0x80).any()
    # the decoded values differ by one e4m3 step relative to the value: at most 2^-3 of it
    da, db = ours.float()[differ], theirs.float()[differ]
    assert ((da - db).abs() <= da.abs().maximum(db.abs()) * 2.0**-3).all()
    # the scales: the same value up to fp32 rounding (a few ulps), different bits in many groups
    assert torch.allclose(our_scale, their_scale, rtol=2.0**-21, atol=0)
    assert (our_scale != their_scale).any()
