"""Pure-torch FP8 and NVFP4 quantization, written for clarity: the oracle our kernels are
checked against.

Conventions (docs/math.md section 3, matching FlashInfer 0.7.2.post1 through 0.7.4):
- fp8:   q = e4m3_satfinite(x / scale), x already rounded to the activation dtype.
- nvfp4: per 16-element block b, FlashInfer's steps (its kernels' order of operations, with IEEE
         fp32 operations where its fast path takes approximate reciprocals):
         sf_b = e4m3(global_scale * (amax_b * fp32(1/6)));
         q = e2m1_rne_satfinite(fp32(x * fp32(1 / fp32(float(sf_b) * fp32(1 / global_scale))))),
         the sign bit x's (-0.0 gives code 8); q = +-0 where sf_b == 0 (FlashInfer multiplies by 0
         for an all-zero block; a block whose scale underflows to 0 is written the same way here,
         where FlashInfer's reciprocal of 0 would saturate its codes: sf 0 decodes every code to 0).
         Two e2m1 codes per byte, element 2i in the low nibble. Scales in the 128x4 swizzled layout
         ([round_up(T,128), round_up(H/16,4)], padding 0) or linear ([T, H/16]).
- special values: a NaN gives e4m3's NaN (0x7F, with the NaN's sign bit for fp8); +-inf saturates
  to +-448. A block holding a NaN has amax NaN, so its scale is the NaN 0x7F and every product in
  it NaN, whose e2m1 magnitude is 0. Every element but a NaN keeps x's sign bit (code 8 for a
  negative one or -0.0 that rounds to 0, in a block of scale 0 or NaN too), as FlashInfer's
  conversion does: the scale carries the NaN, the codes only signs.
"""

from __future__ import annotations

import torch

from fusion_bridge.spec import (  # noqa: F401 (re-exported)
    FP8_E4M3_MAX,
    NVFP4_BLOCK,
    ScaleLayout,
    SFLayout,
    fp8_scale_storage_shape,
    sf_shape,
)


def e2m1_values(device) -> torch.Tensor:
    """The eight e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (fp32, index = code), made on `device`
    by arithmetic: a host tensor copied over would make this torch path fail inside a CUDA-graph
    capture (`separate` with NVFP4 is captured like every strategy)."""
    code = torch.arange(8, device=device, dtype=torch.float32)
    mantissa = 1.0 + 0.5 * torch.remainder(code, 2)
    return torch.where(code < 2, code * 0.5, torch.exp2(torch.floor(code / 2) - 1) * mantissa)


def e4m3_satfinite(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round-to-nearest-even, saturating to +-448 (a plain
    cast gives NaN)."""
    return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """[T, H] activation-dtype -> [T, H] float8_e4m3fn."""
    return e4m3_satfinite(x.float() / torch.tensor(scale, dtype=torch.float32))


def e2m1_codes(x: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 codes (uint8): the nearest magnitude to |x|, ties to the even code, saturating
    at 6; NaN -> 0 (e2m1 has no NaN: only in a block whose scale is NaN, which carries it); bit 3
    (the sign) where `negative`. Found by distance to every value, independent of the kernel's
    threshold method."""
    values = e2m1_values(x.device)
    mag = x.abs().clamp(max=6.0)
    mag = torch.where(torch.isnan(mag), 0.0, mag)
    dist = (mag.unsqueeze(-1) - values).abs()
    best = dist.min(dim=-1, keepdim=True).values
    ties = dist == best
    codes = torch.arange(8, device=x.device).expand_as(dist)
    # among the nearest codes prefer the even one (mantissa bit 0); there are at most two
    even_first = (
        torch.where(ties & (codes % 2 == 0), codes, torch.full_like(codes, 99)).min(-1).values
    )
    any_first = torch.where(ties, codes, torch.full_like(codes, 99)).min(-1).values
    code = torch.where(even_first < 99, even_first, any_first)
    return (code | (negative.to(torch.int64) << 3)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    values = e2m1_values(codes.device)
    mag = values[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def swizzled_sf_offset(m: torch.Tensor, k: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Flat offset of (row m, block k) in FlashInfer's SWIZZLED_128x4 scale layout."""
    k4 = (num_blocks + 3) // 4
    return (
        (m // 128) * (k4 * 512) + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + (k % 4)
    )


def quantize_nvfp4(
    x: torch.Tensor, global_scale: float, layout: SFLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H] activation-dtype -> (packed uint8 [T, H/2], uint8 e4m3 scales in `layout`)."""
    tokens, hidden = x.shape
    blocks = x.float().reshape(tokens, hidden // NVFP4_BLOCK, NVFP4_BLOCK)
    one = torch.tensor(1.0, dtype=torch.float32)
    gs = torch.tensor(global_scale, dtype=torch.float32)
    amax = blocks.abs().amax(dim=-1)
    sf = e4m3_satfinite(gs * (amax * (one / 6.0)))
    sf_f = sf.float().unsqueeze(-1)
    # the multiplier to e2m1 units, one fp32 rounding per step; 0 where the scale is 0
    encode = torch.where(sf_f == 0, 0.0, one / (sf_f * (one / gs)))
    negative = torch.signbit(blocks) & ~torch.isnan(blocks)  # x's sign bit, -0.0 included
    codes = e2m1_codes(blocks * encode, negative).reshape(tokens, hidden)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    sf_bytes = sf.view(torch.uint8)
    if layout is SFLayout.LINEAR:
        return packed, sf_bytes.contiguous()
    rows, cols = sf_shape(tokens, hidden, layout)
    out = torch.zeros(rows * cols, dtype=torch.uint8, device=x.device)
    m = torch.arange(tokens, device=x.device).unsqueeze(1).expand(tokens, hidden // NVFP4_BLOCK)
    k = torch.arange(hidden // NVFP4_BLOCK, device=x.device).unsqueeze(0).expand_as(m)
    out[swizzled_sf_offset(m, k, hidden // NVFP4_BLOCK).reshape(-1)] = sf_bytes.reshape(-1)
    return packed, out.reshape(rows, cols)


def dequantize_nvfp4(
    packed: torch.Tensor, sf: torch.Tensor, global_scale: float, hidden: int, layout: SFLayout
) -> torch.Tensor:
    """Inverse of quantize_nvfp4 up to rounding, in fp32: for error measurements."""
    tokens = packed.shape[0]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(tokens, hidden)
    nb = hidden // NVFP4_BLOCK
    if layout is SFLayout.LINEAR:
        sf_rows = sf.reshape(tokens, nb)
    else:
        m = torch.arange(tokens, device=packed.device).unsqueeze(1).expand(tokens, nb)
        k = torch.arange(nb, device=packed.device).unsqueeze(0).expand_as(m)
        sf_rows = sf.reshape(-1)[swizzled_sf_offset(m, k, nb)]
    scale = sf_rows.view(torch.float8_e4m3fn).float() / global_scale
    return (e2m1_decode(codes).reshape(tokens, nb, NVFP4_BLOCK) * scale.unsqueeze(-1)).reshape(
        tokens, hidden
    )


# dynamic FP8 (per token group, per token): vLLM 0.34's Triton `_per_token_group_quant_fp8`
FP8_AMAX_EPS = 1e-10  # the floor of a group's amax (an all-zero group gets a tiny, finite scale)
E4M3_NAN_CODE = 0x7F  # every NaN code of the dynamic kinds, whatever the NaN's sign


def fp8_max_recip() -> torch.Tensor:
    """fp32(1 / 448), the reciprocal vLLM's kernel multiplies by (a 0-d fp32 tensor)."""
    return torch.tensor(1.0 / FP8_E4M3_MAX, dtype=torch.float32)


def quantize_fp8_per_token_group(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H] (activation dtype, norm_out already rounded) -> (q float8_e4m3fn [T, H], scales fp32
    [T, H // group_size] contiguous). Per group of `group_size` contiguous elements of a row, each
    step one IEEE fp32 operation:

        amax  = max |x| over the group                 (NaN if the group holds a NaN)
        scale = max(amax, 1e-10) * fp32(1/448)          (times the reciprocal, not divided)
        q     = e4m3(clamp(x / scale, -448, 448))       (round to nearest even)

    Special values (our rule, docs/math.md section 3): a group holding a NaN gets a NaN scale
    (positive, 0x7FC00000) and every code 0x7F; a group holding +-inf and no NaN gets the scale
    +inf, its finite elements the codes of +-0 (x / inf, sign kept) and its infinite ones 0x7F
    (inf / inf is NaN). Every NaN code is 0x7F (the NaN's sign, which differs between CPUs and
    GPUs, is dropped)."""
    tokens, hidden = x.shape
    assert hidden % group_size == 0, (hidden, group_size)
    groups = x.float().reshape(tokens, hidden // group_size, group_size)
    has_nan = torch.isnan(groups).any(dim=-1)
    amax = groups.abs().amax(dim=-1)
    amax = torch.where(has_nan, torch.tensor(float("nan")), amax)  # a max that keeps the NaN
    floor = torch.tensor(FP8_AMAX_EPS, dtype=torch.float32)
    scale = torch.where(has_nan, amax, torch.maximum(amax, floor)) * fp8_max_recip()
    scale = torch.where(has_nan, torch.tensor(float("nan")), scale)  # the canonical NaN bits
    quotient = groups / scale.unsqueeze(-1)
    codes = e4m3_satfinite(quotient).view(torch.uint8)
    codes = torch.where(torch.isnan(quotient), E4M3_NAN_CODE, codes).to(torch.uint8)
    return codes.view(torch.float8_e4m3fn).reshape(tokens, hidden), scale.contiguous()


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H] -> (q float8_e4m3fn [T, H], scales fp32 [T, 1]): `quantize_fp8_per_token_group` with
    the whole row as one group."""
    return quantize_fp8_per_token_group(x, x.shape[1])


def fp8_scale_view(scales: torch.Tensor, layout: ScaleLayout) -> torch.Tensor:
    """From row-major scales fp32 [T, G], the tensor a caller receives in `layout`:
    row_major: [T, G] contiguous; column_major: storage [G, T] handed out as its transpose, shape
    [T, G], strides (1, T); column_major_tma: storage [G, round_up(T, 4)] (padding columns 0),
    handed out as storage.t()[:T], shape [T, G], strides (1, round_up(T, 4))."""
    layout = ScaleLayout(layout)
    tokens, groups = scales.shape
    if layout is ScaleLayout.ROW_MAJOR:
        return scales.contiguous().clone()
    storage = torch.zeros(
        fp8_scale_storage_shape(tokens, groups, layout), dtype=torch.float32, device=scales.device
    )
    storage[:, :tokens] = scales.t()
    return storage.t()[:tokens]


def dequantize_fp8_dynamic(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """q [T, H] float8_e4m3fn and scales [T, H // group_size] (any layout's view) -> fp32 [T, H]
    = float(q) * scale of its group: for error measurements."""
    tokens, hidden = q.shape
    per_element = scales.float().repeat_interleave(group_size, dim=1)
    return q.float() * per_element.reshape(tokens, hidden)
