"""The torch FP8 / NVFP4 reference against hand-computed values, the swizzle formula, and the
independent float64 oracle's quantizers (tests/oracle64.py) over many binades."""

import pytest
import torch

from fusion_bridge.spec import SFLayout
from fusion_bridge.oracle.quant_ref import (
    dequantize_nvfp4,
    e2m1_codes,
    e2m1_values,
    e4m3_satfinite,
    quantize_fp8,
    quantize_nvfp4,
    swizzled_sf_offset,
)
from tests import oracle64


def bits(t):
    return t.view(torch.uint8).tolist()


def test_fp8_saturates_instead_of_nan_and_rounds_to_even():
    x = torch.tensor([1000.0, -1000.0, 448.0, 1.0625, 1.1875, -0.0, 2.0**-9, 2.0**-11])
    # 0x7E = 448, 0xFE = -448; 1.0625 is halfway 1.0/1.125 -> even (1.0 = 0x38); 1.1875 -> 1.25
    # (0x3A)
    # -0.0 keeps its sign (0x80); 2^-9 is the smallest subnormal (0x01); 2^-11 rounds to 0
    assert bits(e4m3_satfinite(x)) == [0x7E, 0xFE, 0x7E, 0x38, 0x3A, 0x80, 0x01, 0x00]


def test_fp8_scale_is_a_divisor():
    x = torch.tensor([[2.0, -4.0]], dtype=torch.bfloat16)
    assert quantize_fp8(x, 2.0).float().tolist() == [[1.0, -2.0]]


def test_e2m1_ties_go_to_the_even_code_and_saturate():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, 0.26, -0.75, -6.0, -0.1])
    # codes: 0.25->0 (0), 0.75->1.0 (2), 1.25->1.0 (2), 1.75->2 (4), 2.5->2 (4), 3.5->4 (6), 5->4
    # (6),
    # 7 and 100 saturate at 6 (7), 0.26->0.5 (1); negatives carry bit 3, also when they round to 0
    assert e2m1_codes(x, x < 0).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 7, 1, 8 | 2, 8 | 7, 8 | 0]


def test_e2m1_values_are_the_format_table():
    assert e2m1_values("cpu").tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_nvfp4_hand_computed_blocks():
    values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    block_exact = torch.tensor(values + [-v for v in values])  # amax 6, gs 1 -> sf 1.0 exactly
    block_zero = torch.zeros(16)  # sf 0, every code 0
    block_round = torch.full((16,), 6.375)  # sf = e4m3(1.0625) -> 1.0 (tie to even)
    x = torch.stack([torch.cat([block_exact, block_zero, block_round])]).to(torch.bfloat16)
    q, sf = quantize_nvfp4(x, 1.0, SFLayout.LINEAR)
    assert sf.tolist() == [[0x38, 0x00, 0x38]]
    codes = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(1, 48)
    # negatives carry bit 3, -0.0 too (code 8: its sign bit, as FlashInfer's conversion keeps it)
    assert codes[0, :16].tolist() == list(range(8)) + [8] + [8 | c for c in range(1, 8)]
    assert codes[0, 16:32].tolist() == [0] * 16
    assert codes[0, 32:].tolist() == [7] * 16  # 6.375 / 1.0 saturates at 6
    assert q[0, 0].item() == (1 << 4) | 0  # element 2i in the low nibble


def test_nvfp4_global_scale_is_a_multiplier():
    x = torch.full((1, 16), 3.0, dtype=torch.bfloat16)
    q, sf = quantize_nvfp4(
        x, 2.0, SFLayout.LINEAR
    )  # sf = e4m3(2*3/6) = 1.0; q = e2m1(3*2/1) = 6 (code 7)
    assert sf.tolist() == [[0x38]] and (q == 0x77).all()
    assert torch.equal(dequantize_nvfp4(q, sf, 2.0, 16, SFLayout.LINEAR), torch.full((1, 16), 3.0))


def test_swizzle_offsets_follow_the_layout_formula():
    # (m // 128) * (K4 * 512) + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + (k % 4)
    blocks = 9  # K4 = 3
    for m, k, expected in [
        (0, 0, 0),
        (1, 0, 16),
        (32, 0, 4),
        (0, 1, 1),
        (0, 4, 512),
        (127, 8, 1024 + 496 + 12),
        (128, 0, 1536),
        (130, 5, 1536 + 512 + 32 + 1),
    ]:
        assert swizzled_sf_offset(torch.tensor(m), torch.tensor(k), blocks).item() == expected


def test_swizzled_scales_land_at_their_offsets_and_padding_is_zero():
    torch.manual_seed(0)
    x = torch.randn(130, 80).to(torch.bfloat16)  # 5 blocks -> 8 columns, 130 rows -> 256 rows
    q_lin, sf_lin = quantize_nvfp4(x, 100.0, SFLayout.LINEAR)
    q_swz, sf_swz = quantize_nvfp4(x, 100.0, SFLayout.SWIZZLED_128x4)
    assert sf_swz.shape == (256, 8) and torch.equal(q_lin, q_swz)
    flat = sf_swz.reshape(-1)
    m = torch.arange(130).unsqueeze(1).expand(130, 5)
    k = torch.arange(5).unsqueeze(0).expand(130, 5)
    offsets = swizzled_sf_offset(m, k, 5)
    assert torch.equal(flat[offsets.reshape(-1)].reshape(130, 5), sf_lin)
    written = torch.zeros_like(flat, dtype=torch.bool)
    written[offsets.reshape(-1)] = True
    assert (flat[~written] == 0).all() and (sf_lin != 0).all()


def _wide_range(tokens, hidden, seed):
    """Values over many binades: tiny (e4m3 subnormals after scaling), ordinary, saturating;
    zeros."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-20, 12, (tokens, hidden), generator=g).float())
    x = torch.randn(tokens, hidden, generator=g) * mag
    x[0, :16] = 0.0
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_reference_matches_the_float64_oracle(dtype):
    x = _wide_range(7, 96, 1).to(dtype)
    for scale in (0.02, 1.0, 3.0):
        assert torch.equal(quantize_fp8(x, scale).view(torch.uint8), oracle64.fp8_codes(x, scale))


@pytest.mark.parametrize("swizzled", [True, False])
def test_nvfp4_reference_matches_the_float64_oracle(swizzled):
    layout = SFLayout.SWIZZLED_128x4 if swizzled else SFLayout.LINEAR
    for tokens, hidden, gs in [(3, 96, 448.0), (130, 80, 100.0), (5, 160, 2688.0 / 7.0)]:
        x = _wide_range(tokens, hidden, tokens).to(torch.bfloat16)
        q, sf = quantize_nvfp4(x, gs, layout)
        o_q, o_sf = oracle64.nvfp4(x, gs, swizzled)
        assert torch.equal(q, o_q) and torch.equal(sf, o_sf)


def test_the_three_swizzle_descriptions_agree():
    """quant_ref's offset formula, the oracle's restatement of it, and the oracle's tile
    permutation."""
    for tokens, blocks in [(1, 1), (130, 5), (256, 9)]:
        sf = (torch.arange(tokens * blocks) % 251 + 1).to(torch.uint8).reshape(tokens, blocks)
        tiled = oracle64.swizzle(sf).reshape(-1)
        for m in range(0, tokens, 7):
            for k in range(blocks):
                off = oracle64.swizzle_offset(m, k, blocks)
                assert off == swizzled_sf_offset(torch.tensor(m), torch.tensor(k), blocks).item()
                assert tiled[off] == sf[m, k]
        assert torch.equal(oracle64.unswizzle(oracle64.swizzle(sf), tokens, blocks), sf)


@pytest.mark.parametrize("global_scale", [1.0, 3.0, 384.0, 537.6])
def test_nvfp4_reference_takes_flashinfers_steps(global_scale):
    """Normal-distributed rows (where the fp32 product lands on an e2m1 tie now and then): the
    reference's codes and scales equal the float64 oracle's statement of FlashInfer's steps, -0.0
    included (code 8)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 512, generator=g).to(torch.bfloat16)
    x[0, :5] = -0.0
    q, sf = quantize_nvfp4(x, global_scale, SFLayout.LINEAR)
    o_q, o_sf = oracle64.nvfp4(x, global_scale, False)
    assert torch.equal(sf, o_sf) and torch.equal(q, o_q)
    assert (q[0, :2] == 0x88).all()
