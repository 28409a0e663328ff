"""The dynamic FP8 references (per token group, per token; fusion_bridge.oracle.quant_ref) against
a plain-loop statement of vLLM 0.34's `_per_token_group_quant_fp8` in numpy fp32, the NaN / inf
rule, and the three scale layouts' exact storage."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fusion_bridge.oracle.quant_ref import (
    fp8_scale_view,
    quantize_fp8_per_token,
    quantize_fp8_per_token_group,
)
from fusion_bridge.spec import ScaleLayout


def _e4m3_code(v: float) -> int:
    """The e4m3fn code of fp32 v by search over every finite code (nearest, ties to even mantissa),
    saturating at 448; NaN -> 0x7F."""
    if math.isnan(v):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = min(abs(v), 448.0)
    best, best_d = 0, math.inf
    for code in range(0x7F):  # 0x7F is NaN
        e, m = code >> 3, code & 7
        value = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        d = abs(a - value)
        if d < best_d or (d == best_d and code % 2 == 0):
            best, best_d = code, d
    return best | sign


def _loops(x: torch.Tensor, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Plain loops, numpy fp32, one group at a time: the formula as vLLM's kernel writes it."""
    xs = x.float().numpy()
    tokens, hidden = xs.shape
    recip = np.float32(1.0) / np.float32(448.0)
    codes = np.zeros((tokens, hidden), dtype=np.uint8)
    scales = np.zeros((tokens, hidden // group_size), dtype=np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        for t in range(tokens):
            for g in range(hidden // group_size):
                grp = xs[t, g * group_size : (g + 1) * group_size]
                if np.isnan(grp).any():
                    scale = np.float32(np.nan)
                else:
                    scale = np.maximum(np.abs(grp).max(), np.float32(1e-10)) * recip
                scales[t, g] = scale
                for i, v in enumerate(grp):
                    codes[t, g * group_size + i] = _e4m3_code(float(np.float32(v) / scale))
    return codes, scales


def _special_rows(hidden: int, group_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, hidden, generator=g) * 3
    x[0, :group_size] = 0.0  # an all-zero group
    x[0, group_size] = -0.0
    x[1] = torch.randn(hidden, generator=g) * 1e-39  # fp32 subnormals (bf16 keeps some)
    x[2, ::group_size] = 3e38  # one huge value per group
    x[3, 1] = float("nan")
    x[3, -1] = -float("nan")
    x[4, 2] = float("inf")
    x[4, -2] = -float("inf")
    x[5] = torch.exp2(torch.linspace(-9, 8.8, hidden))  # most of e4m3's range after the scale
    x[6, :group_size] = 1e-12  # below the eps floor
    return x.bfloat16()


@pytest.mark.parametrize("hidden,group_size", [(192, 64), (128, 16), (96, 32)])
def test_group_reference_matches_plain_loops(hidden: int, group_size: int) -> None:
    x = _special_rows(hidden, group_size)
    q, s = quantize_fp8_per_token_group(x, group_size)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (7, hidden // group_size) and s.is_contiguous()
    codes, scales = _loops(x, group_size)
    assert np.array_equal(q.view(torch.uint8).numpy(), codes)
    # bits, NaN included: the NaN scale is the canonical positive NaN
    got_bits = s.view(torch.int32).numpy()
    want = np.where(np.isnan(scales), np.float32(np.nan), scales).view(np.int32)
    assert np.array_equal(got_bits, want)


def test_nan_and_inf_rule() -> None:
    x = _special_rows(192, 64)
    q, s = quantize_fp8_per_token_group(x, 64)
    codes = q.view(torch.uint8)
    # a group holding a NaN (either sign): NaN scale, positive, and every code 0x7F
    assert torch.isnan(s[3, 0]) and torch.isnan(s[3, 2]) and not torch.isnan(s[3, 1])
    assert s[3, 0].view(torch.int32).item() == 0x7FC00000 == s[3, 2].view(torch.int32).item()
    assert (codes[3, :64] == 0x7F).all() and (codes[3, 128:] == 0x7F).all()
    # a group holding +-inf and no NaN: scale +inf, finite elements +-0, infinite ones 0x7F
    assert s[4, 0].item() == math.inf == s[4, 2].item()
    assert codes[4, 2] == 0x7F and codes[4, -2] == 0x7F
    finite = codes[4, :64][torch.arange(64) != 2]
    assert ((finite & 0x7F) == 0).all()
    assert torch.equal((finite & 0x80) != 0, torch.signbit(x[4, :64][torch.arange(64) != 2]))


def test_eps_floor_and_reciprocal_multiply() -> None:
    x = _special_rows(192, 64)
    q, s = quantize_fp8_per_token_group(x, 64)
    recip = torch.tensor(1 / 448, dtype=torch.float32)
    assert s[0, 0].item() == (torch.tensor(1e-10, dtype=torch.float32) * recip).item()
    assert s[6, 0].item() == (torch.tensor(1e-10, dtype=torch.float32) * recip).item()
    # a multiply by fp32(1/448), not a division by 448: they differ on some amax
    amax = torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 10
    assert not torch.equal(amax * recip, amax / 448.0)


def test_per_token_is_one_group_per_row() -> None:
    x = _special_rows(192, 64)
    q, s = quantize_fp8_per_token(x)
    qg, sg = quantize_fp8_per_token_group(x, 192)
    assert s.shape == (7, 1) and torch.equal(q.view(torch.uint8), qg.view(torch.uint8))
    assert torch.equal(s.view(torch.int32), sg.view(torch.int32))


@pytest.mark.parametrize("tokens", [0, 1, 3, 4, 9])
def test_scale_views(tokens: int) -> None:
    s = torch.randn(tokens, 3)
    row = fp8_scale_view(s, ScaleLayout.ROW_MAJOR)
    assert row.is_contiguous() and torch.equal(row, s)
    col = fp8_scale_view(s, "column_major")
    assert col.shape == (tokens, 3) and torch.equal(col, s)
    assert tokens <= 1 or col.stride() == (1, tokens)
    storage = col.t()
    assert storage.is_contiguous() and storage.shape == (3, tokens)
    tma = fp8_scale_view(s, ScaleLayout.COLUMN_MAJOR_TMA)
    padded = -(-tokens // 4) * 4
    assert tma.shape == (tokens, 3) and torch.equal(tma, s)
    assert tokens == 0 or tma.stride() == (1, padded)
    whole = torch.as_strided(tma, (3, padded), (padded, 1))  # the storage, padding included
    assert torch.equal(whole[:, :tokens], s.t())
    assert (whole[:, tokens:] == 0).all()
