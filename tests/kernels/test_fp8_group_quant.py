"""Our standalone per-token-group / per-token FP8 kernel (kernels/fp8_group_quant.py) bit for bit
against the torch reference (`quant_ref.quantize_fp8_per_token_group` / `quantize_fp8_per_token`,
scales laid out by `fp8_scale_view`): codes and scale bits, in all three scale layouts, the TMA
layout's padding rows (0), at T = 0, 1, odd T, H not a power of two, several groups per program
with a partial last program, a group size that is not a power of two, the two-pass path of a group
wider than a program's tile; e4m3's whole range (every value, every tie with a step either side,
past 448), subnormals, all-zero groups, amaxes around the 1e-10 floor, one huge value per group,
+-inf and NaN groups, amaxes where the reciprocal multiply and a division by 448 differ.

Every output is poisoned before the kernel writes it (codes 0xFF, scale bits 0xFFFFFFFF, which
the reference never writes, the TMA padding included) and has poisoned guard elements after it
that must stay poisoned; the input is checked unmodified. Under the Triton interpreter on CPU (the
software e4m3 conversion and IEEE divisions); on a GPU the same tests run its hardware conversion
and the one-reciprocal-per-group division."""

import math

import pytest
import torch

from fusion_bridge.kernels.fp8_group_quant import (
    empty_scales,
    fp8_group_quant,
    fp8_group_quant_into,
    fp8_per_token_quant,
    launch_shape,
)
from fusion_bridge.oracle.quant_ref import (
    fp8_max_recip,
    fp8_scale_view,
    quantize_fp8_per_token,
    quantize_fp8_per_token_group,
)
from fusion_bridge.spec import ScaleLayout, fp8_scale_storage_shape
from tests.kernels.test_quant_ranges import e4m3_range

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYOUTS = [layout.value for layout in ScaleLayout]
INF, NAN = float("inf"), float("nan")
GUARD = 8  # poisoned scale elements after the scale storage; two poisoned code rows after q
POISON_SCALE_BITS = -1  # 0xFFFFFFFF: a negative NaN, which the kernel never writes


def _poisoned(tokens, hidden, group_size, layout):
    """(q, scales, code buffer, scale buffer): q [T, H] float8 and scales [T, G] in `layout`, views
    of poisoned buffers with guards after them."""
    groups = hidden // group_size
    qbuf = torch.full(((tokens + 2) * hidden,), 0xFF, dtype=torch.uint8, device=DEVICE)
    q = qbuf[: tokens * hidden].view(tokens, hidden).view(torch.float8_e4m3fn)
    shape = fp8_scale_storage_shape(tokens, groups, ScaleLayout(layout))
    n = math.prod(shape)
    sbuf = torch.full((n + GUARD,), POISON_SCALE_BITS, dtype=torch.int32, device=DEVICE)
    storage = sbuf[:n].view(torch.float32).view(shape)
    scales = storage if layout == "row_major" else storage.t()[:tokens]
    return q, scales, qbuf, sbuf


def _problems(x, group_size, layout, **launch):
    """Why the kernel's outputs for x are not the reference's, bit for bit (empty: they are)."""
    tokens, hidden = x.shape
    x = x.to(DEVICE)
    before = x.clone()
    q, scales, qbuf, sbuf = _poisoned(tokens, hidden, group_size, layout)
    fp8_group_quant_into(q, scales, x, group_size, layout, **launch)
    ref_q, ref_s = quantize_fp8_per_token_group(x.cpu(), group_size)
    want = fp8_scale_view(ref_s, layout)
    problems = []
    if not torch.equal(x.view(torch.uint8), before.view(torch.uint8)):
        problems.append("x was modified")
    got_q, ref_q = q.view(torch.uint8).cpu(), ref_q.view(torch.uint8)
    if not torch.equal(got_q, ref_q):
        bad = (got_q != ref_q).nonzero()[:4].tolist()
        problems.append(f"codes differ at {bad}: {[(got_q[i, j], ref_q[i, j]) for i, j in bad]}")
    if scales.shape != want.shape or scales.stride() != want.stride():
        problems.append(f"scales {scales.shape} {scales.stride()} != {want.shape} {want.stride()}")
    got_s, want_s = scales.cpu().view(torch.int32), want.contiguous().view(torch.int32)
    if not torch.equal(got_s, want_s):
        bad = (got_s != want_s).nonzero()[:4].tolist()
        problems.append(f"scale bits differ at {bad}: {[hex(got_s[i, j]) for i, j in bad]}")
    groups = hidden // group_size
    storage = sbuf[: sbuf.numel() - GUARD].cpu()
    if layout == "column_major_tma":  # the padding rows T .. round_up(T, 4): zeros
        padded = storage.view(fp8_scale_storage_shape(tokens, groups, ScaleLayout(layout)))
        if not (padded[:, tokens:] == 0).all():
            problems.append(f"TMA padding not 0: {padded[:, tokens:].tolist()}")
    if not (sbuf[sbuf.numel() - GUARD :] == POISON_SCALE_BITS).all():
        problems.append("a scale written past the storage")
    if not (qbuf[tokens * hidden :] == 0xFF).all():
        problems.append("a code written past q")
    return problems


def _rows(values: torch.Tensor, hidden: int) -> torch.Tensor:
    rows = -(-values.numel() // hidden)
    out = torch.zeros(rows * hidden, dtype=values.dtype)
    out[: values.numel()] = values.flatten()
    return out.view(rows, hidden)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokens", [0, 1, 5])
@pytest.mark.parametrize("hidden,group_size", [(192, 64), (384, 128)])
def test_random_rows_bit_for_bit_in_every_layout(layout, tokens, hidden, group_size):
    """bf16 rows of widely spread magnitudes; H = 192 is no power of two; T = 5 pads the TMA
    layout by 3 rows."""
    g = torch.Generator().manual_seed(tokens * 1000 + hidden)
    x = torch.randn(tokens, hidden, generator=g) * torch.exp2(
        torch.randint(-20, 20, (tokens, hidden // group_size, 1), generator=g).float()
    ).repeat_interleave(group_size, 1).view(tokens, hidden)
    assert not _problems(x.to(torch.bfloat16), group_size, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_several_groups_per_program_and_a_partial_last_program(layout):
    """BLOCK_M = 4 over 7 x 3 groups (8 x 3 over the TMA storage): the last program holds groups
    past the storage, which it must neither read nor write; fp16 input."""
    x = torch.randn(7, 192, generator=torch.Generator().manual_seed(3)) * 50
    assert not _problems(x.to(torch.float16), 64, layout, block_m=4)


@pytest.mark.parametrize("layout", ["row_major", "column_major_tma"])
def test_a_group_size_that_is_no_power_of_two(layout):
    """group 96 in a tile of 128: the 32 lanes past each group belong to the next group, never to
    this one's amax or codes (the spec takes powers of two; the kernel any divisor of H)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 192, generator=g)
    x[:, 96:] *= 1000  # the second group's values would dominate a first group reading past 96
    assert not _problems(x.to(torch.bfloat16), 96, layout, block_m=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_e4m3s_whole_range(dtype):
    """Groups of 64 each led by 448, so scale = 448 * fp32(1/448) = 1.0 exactly and the quotients
    are the values: every e4m3 value, every tie between neighbours with a step of `dtype` either
    side, both signs (the range's values past 448, inf and NaN go to the special groups)."""
    values = e4m3_range(dtype)
    values = values[values.float().abs() <= 448]
    assert float(torch.tensor(448.0) * fp8_max_recip()) == 1.0
    body = _rows(values, 63)
    x = torch.cat([torch.full((body.shape[0], 1), 448.0, dtype=dtype), body], dim=1)
    x = _rows(x, 192)  # 3 groups of 64 per row, odd T
    assert x.shape[0] % 2 == 1 or x.shape[0] > 8
    assert not _problems(x, 64, "column_major_tma")
    assert not _problems(x * 0.3, 64, "row_major")  # off the grid, other scales


def _special_groups(dtype) -> torch.Tensor:
    """[groups, 64]: one kind of special group each."""
    tiny = torch.finfo(dtype).tiny
    big = torch.finfo(dtype).max
    sub = [tiny / 2, -tiny / 4, tiny / 8, -tiny / 64]  # subnormals of dtype
    groups = [
        [0.0] * 64,  # all zero: scale 1e-10 * fp32(1/448), codes 0
        [-0.0, 0.0] * 32,  # signed zeros keep their sign
        sub * 16,  # subnormal amax: below the 1e-10 floor
        [1e-10, -5e-11, 2e-11, 0.0],  # amax at the floor
        [1.5e-10, -1e-10, 3e-11, -7e-11],  # just above it
        [9e-11, 1e-13, -4e-11, 1e-12],  # just below it
        [big, 1.0, -1.0, 1e30, -3e35, 0.5] + sub,  # one huge value: the rest go to 0 / subnormals
        [-big, 448.0, 2.0**-6, -(2.0**-9)],
        [INF, 1.0, -2.0, 0.0, -0.0, 3e5],  # scale inf: +-0 codes, inf / inf NaN -> 0x7F
        [-INF, INF, 5.0, -5.0],
        [NAN, 1.0, -2.0, 0.0, -0.0, 3.0],  # NaN scale, every code 0x7F
        [-NAN, -1.0, 2.0],
        [NAN, INF, -INF, 1.0],
        [NAN] * 64,
    ]
    rows = []
    for group in groups:
        rows.append(torch.tensor((group * 64)[:64], dtype=torch.float64).to(dtype))
    # a NaN of another payload (signalling, negative): the scale is still the reference's NaN
    payloads = [0x7F81, -1] if dtype != torch.float32 else [0x7F800001, -1]
    int_dtype = torch.int16 if dtype != torch.float32 else torch.int32
    odd_nans = torch.tensor(payloads * 32, dtype=int_dtype).view(dtype)
    rows.append(torch.where(torch.arange(64) % 3 == 0, odd_nans, rows[0]))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_special_values(dtype):
    groups = _special_groups(dtype)
    x = _rows(groups, 192)  # 15 groups: 5 rows of 3
    ref_q, ref_s = quantize_fp8_per_token_group(x, 64)
    assert torch.isnan(ref_s).any() and torch.isinf(ref_s).any()
    assert (ref_q.view(torch.uint8) == 0x7F).any()
    for layout in LAYOUTS:
        assert not _problems(x, 64, layout), layout


def test_the_reciprocal_multiply_and_not_a_division_by_448():
    """Group amaxes spread over the whole range, where amax * fp32(1/448) and amax / 448 round to
    different scales (the test shows there are such groups) and so give other codes."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 192, generator=g) * torch.exp2(torch.randint(-60, 60, (9, 192), generator=g))
    x = x.to(torch.bfloat16)
    _, ref_s = quantize_fp8_per_token_group(x, 32)
    amax = x.float().view(9, 6, 32).abs().amax(-1)
    assert (amax / torch.tensor(448.0) != ref_s).sum() >= 5
    assert not _problems(x, 32, "row_major")


@pytest.mark.parametrize("tokens,hidden,max_tile", [(1, 192, 8192), (3, 192, 64), (4, 96, 64)])
def test_per_token(tokens, hidden, max_tile):
    """The row as one group: in one tile, and read twice in tiles of 64 (H = 96: the last tile
    half past the row, whose lanes belong to the next row)."""
    g = torch.Generator().manual_seed(hidden + tokens)
    x = torch.randn(tokens, hidden, generator=g) * 30
    x[:, -1] = 4000.0 * (torch.arange(tokens) + 1)  # the amax in the row's last element
    x = x.to(torch.bfloat16).to(DEVICE)
    if tokens > 2:
        x[1, 7] = NAN
    if max_tile == 8192:
        q, s = fp8_per_token_quant(x)
    else:
        q = torch.full((tokens, hidden), 0xFF, dtype=torch.uint8, device=DEVICE)
        s = torch.full((tokens, 1), NAN, device=DEVICE)
        fp8_group_quant_into(q, s, x, hidden, "row_major", max_tile=max_tile)
    ref_q, ref_s = quantize_fp8_per_token(x.cpu())
    assert s.shape == (tokens, 1)
    assert torch.equal(q.view(torch.uint8).cpu(), ref_q.view(torch.uint8))
    assert torch.equal(s.cpu().view(torch.int32), ref_s.view(torch.int32))


def test_allocating_form_and_empty_scales():
    x = torch.randn(5, 256).to(torch.bfloat16).to(DEVICE)
    for layout in LAYOUTS:
        q, s = fp8_group_quant(x, 128, ScaleLayout(layout))
        ref_q, ref_s = quantize_fp8_per_token_group(x.cpu(), 128)
        want = fp8_scale_view(ref_s, layout)
        assert q.dtype == torch.float8_e4m3fn and s.stride() == want.stride()
        assert torch.equal(q.view(torch.uint8).cpu(), ref_q.view(torch.uint8))
        assert torch.equal(s.cpu(), want)
        assert empty_scales(5, 2, layout, DEVICE).stride() == want.stride()


def test_launch_shape_rule():
    # many groups: 32 groups of 128 per program; few: one each; a wide group: a tile of 8192
    assert launch_shape(1024 * 56, 128) == (128, 32, 8)
    assert launch_shape(56, 128) == (128, 1, 1)
    assert launch_shape(4096, 7168) == (8192, 1, 16)
    assert launch_shape(4096, 16384)[0] == 8192


def _bad(match, **changes):
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    args = dict(
        q=torch.empty(4, 256, dtype=torch.float8_e4m3fn),
        scales=empty_scales(4, 2, "column_major", "cpu"),
        x=x,
        group_size=128,
        scale_layout="column_major",
    )
    args.update(changes)
    with pytest.raises(ValueError, match=match):
        fp8_group_quant_into(**args)


def test_bad_arguments_are_refused_naming_them():
    _bad(r"group_size: expected a divisor of H = 256 .* got 96", group_size=96)
    _bad(r"group_size: expected a positive int, got 0", group_size=0)
    _bad(r"x: expected a 2-D tensor \[T, H\], got \[256\]", x=torch.zeros(256))
    _bad(r"x: expected dtype in .* got torch.int32", x=torch.zeros(4, 256, dtype=torch.int32))
    _bad(r"x: expected contiguous rows", x=torch.zeros(256, 4, dtype=torch.bfloat16).t())
    _bad(r"q: expected \[4, 256\] float8_e4m3fn .* got \[4, 128\]", q=torch.empty(4, 128))
    _bad(r"scale_layout: expected one of .* got 'ue8m0'", scale_layout="ue8m0")
    _bad(
        r"scales: expected the column_major layout's strides \(1, 4\) .* got \(2, 1\)",
        scales=torch.empty(4, 2),
    )
    _bad(r"scales: expected \[4, 2\] float32, got \[4, 3\]", scales=torch.empty(3, 4).t())
    t3 = dict(
        x=torch.zeros(3, 256, dtype=torch.bfloat16),
        q=torch.empty(3, 256, dtype=torch.float8_e4m3fn),
        scale_layout="column_major_tma",
    )
    # the TMA view of T = 3 without the storage of its padding row (7 of 8 elements)
    _bad(
        r"scales: expected storage for \[2, 4\] fp32",
        scales=torch.empty(7).as_strided((3, 2), (1, 4)),
        **t3,
    )
    _bad(
        r"scales: expected the column_major_tma layout's strides \(1, 4\)",
        scales=torch.empty(2, 3).t(),
        **t3,
    )
    _bad(r"block_m: expected a power of two", block_m=3)
    _bad(r"max_tile: expected a power of two", max_tile=100)
