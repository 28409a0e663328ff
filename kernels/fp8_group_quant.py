"""Standalone per-token-group and dynamic per-token FP8 (e4m3) quantization of an activation
[T, H]: the separate kernel an engine runs after its add+RMSNorm (vLLM's
`per_token_group_quant_fp8`, SGLang's), written by us so that the fused epilogue can be compared
with "our add+RMSNorm, then this" (benchmarks/fp8_group_quant.py), and so that the formula has a
second implementation to check the fused kernels' codes against on the GPU.

Per group of `group_size` contiguous elements of a row (per token: the whole row is one group),
every step one IEEE fp32 operation in this order, as `fusion_bridge.oracle.quant_ref`'s
`quantize_fp8_per_token_group` (vLLM 0.34's Triton kernel; docs/math.md section 3):

    amax  = max |x| over the group               (NaN where the group holds a NaN)
    scale = max(amax, 1e-10) * fp32(1/448)       (a product with the fp32 reciprocal)
    q     = e4m3_rne(clamp(x / scale, -448, 448))  (the quotient correctly rounded)

A group holding a NaN gets the NaN scale (0x7FC00000) and every code 0x7F (e4m3's NaN, positive):
a NaN-dropping max would give it a finite scale and hide the NaN from the next GEMM. Every NaN
quotient is written 0x7F (a group holding +-inf and no NaN: scale +inf, x / inf = +-0 for its
finite elements, inf / inf NaN for the infinite ones).

Scale layouts (G = H / group_size; the tensor handed out is always [T, G] fp32):
- "row_major": storage [T, G], contiguous;
- "column_major": storage [G, T], handed out transposed (strides (1, T));
- "column_major_tma" (DeepGEMM's on SM90): storage [G, round_up(T, 4)], handed out as
  `storage.t()[:T]` (strides (1, round_up(T, 4))); the padding rows T .. round_up(T, 4) of every
  group column are written 0 by this kernel.

On a GPU the e4m3 conversion is the hardware's (round to nearest even, after a clamp that keeps a
NaN) and the division takes one correctly rounded reciprocal per group (`_div_exact`); under the
Triton interpreter both are done in software (the interpreter's fp8 cast does not round to
nearest even). Both give the bits of the torch reference.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from fusion_bridge.epilogue_tensors import fp8_scale_buffer
from fusion_bridge.kernels.launch_cache import KernelLauncher
from fusion_bridge.kernels.quant import _e4m3_rne_satfinite
from fusion_bridge.spec import ScaleLayout

LAYOUTS = ("row_major", "column_major", "column_major_tma")
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# the most elements of x one program holds in registers; a wider group (a per-token row of a
# large H) is read twice: once for its amax, once for its codes
MAX_TILE = 8192
# elements of x per program when groups are many (several groups per program), and the number of
# programs below which fewer groups go to each program (to keep every SM busy at small T)
TILE_ELEMENTS = 4096
MIN_PROGRAMS = 1024


@triton.jit
def _amax_bits(x):
    """The bits of max |x| along axis 1 of x [M, C] fp32, as int32: the integer max of the
    magnitudes' bits, whose order is the magnitudes' and which keeps a NaN (a NaN's bits are above
    inf's; a float max would drop it on the GPU and in the interpreter alike)."""
    return tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)


@triton.jit
def _group_scale(amax_bits):
    """scale = max(amax, 1e-10) * fp32(1/448), NaN kept and written as the reference's NaN
    0x7FC00000 (whatever the input NaN's payload; a GPU's arithmetic NaN is 0x7FFFFFFF);
    fp32(1/448) = 0.0022321429569274187 exactly (the fp32 nearest 1/448)."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    scale = tl.maximum(amax, 1e-10, propagate_nan=tl.PropagateNan.ALL) * 0.0022321429569274187
    nan = tl.full(scale.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(scale != scale, nan, scale)


@triton.jit
def _div_exact(x, scale):
    """x [M, C] / scale [M] correctly rounded, with one IEEE reciprocal per group (a GPU only: its
    fma rounds once). Markstein: q0 = RN(x * inv) is within an ulp of x / scale, the remainder
    x - scale * q0 is exact in an fma, and RN(q0 + r * inv) = RN(x / scale) for a normal quotient.
    Here scale is in [2^-43, 2^120] (or inf, NaN): a quotient that is not normal, or an x too
    small for an exact remainder, is below 2^-10 in magnitude and e4m3 gives it +-0 either way.
    Where q0 is +-0 (keeps x's zero sign), NaN or inf / inf (NaN) it is the answer."""
    inv = tl.math.div_rn(1.0, scale)[:, None]
    s = tl.broadcast_to(scale[:, None], x.shape)
    q0 = x * inv
    q = tl.fma(tl.fma(-q0, s, x), inv, q0)
    return tl.where((q != q) | (q0 == 0.0), q0, q)


@triton.jit
def _codes(x, scale, HW_CVT: tl.constexpr):
    """The e4m3 code bytes of x [M, C] fp32 for its groups' scale [M]; every NaN quotient 0x7F."""
    if HW_CVT:
        v = _div_exact(x, scale)
        v = tl.maximum(v, -448.0, propagate_nan=tl.PropagateNan.ALL)
        v = tl.minimum(v, 448.0, propagate_nan=tl.PropagateNan.ALL)
        code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        v = tl.math.div_rn(x, scale[:, None])
        code, _ = _e4m3_rne_satfinite(v)  # saturates at 448 itself
    return tl.where(v != v, 0x7F, code).to(tl.uint8)


@triton.jit
def _fp8_group_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    tokens,
    x_row_stride,
    groups_per_row,
    scale_rows,
    s_row_stride,
    s_group_stride,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    """BLOCK_M groups per program, numbered m = t * groups_per_row + j over the rows of the scale
    storage (scale_rows: T, or round_up(T, 4) with the TMA layout's padding rows, whose groups
    read nothing, store no codes and a scale of 0). x row t at x_ptr + t * x_row_stride; q
    contiguous [T, H] (group m's codes at m * GROUP); the scale of (t, j) at
    s_ptr + t * s_row_stride + j * s_group_stride."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # < 2^31 (checked at launch)
    t = m // groups_per_row  # a 32-bit division; the offsets below in 64 bits
    j = m - t * groups_per_row
    live = t < tokens
    x_group = x_ptr + (t.to(tl.int64) * x_row_stride + j * GROUP)
    q_group = q_ptr + m.to(tl.int64) * GROUP
    cols = tl.arange(0, CHUNK)
    if CHUNK >= GROUP:  # the whole group in registers: one read
        mask = live[:, None] & (cols < GROUP)[None, :]
        x = tl.load(x_group[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = _group_scale(_amax_bits(x))
        tl.store(q_group[:, None] + cols[None, :], _codes(x, scale, HW_CVT), mask=mask)
    else:  # a group wider than the tile: its amax first, then its codes (the second read: L2)
        bits = tl.zeros([BLOCK_M], dtype=tl.int32)
        for c0 in range(0, GROUP, CHUNK):
            mask = live[:, None] & ((c0 + cols) < GROUP)[None, :]
            offs = c0 + cols[None, :]
            x = tl.load(x_group[:, None] + offs, mask=mask, other=0.0).to(tl.float32)
            bits = tl.maximum(bits, _amax_bits(x))
        scale = _group_scale(bits)
        for c0 in range(0, GROUP, CHUNK):
            mask = live[:, None] & ((c0 + cols) < GROUP)[None, :]
            offs = c0 + cols[None, :]
            x = tl.load(x_group[:, None] + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_group[:, None] + offs, _codes(x, scale, HW_CVT), mask=mask)
    tl.store(
        s_ptr + (t.to(tl.int64) * s_row_stride + j * s_group_stride),
        tl.where(live, scale, 0.0),
        mask=t < scale_rows,
    )


_LAUNCH = KernelLauncher(_fp8_group_quant_kernel, ("GROUP", "CHUNK", "BLOCK_M", "HW_CVT"))


def _layout_name(scale_layout) -> str:
    name = getattr(scale_layout, "value", scale_layout)  # the spec's ScaleLayout enum, or its value
    if name not in LAYOUTS:
        raise ValueError(f"scale_layout: expected one of {LAYOUTS}, got {scale_layout!r}")
    return name


def scale_storage_rows(tokens: int, scale_layout) -> int:
    """Rows of the scale storage per group column: round_up(T, 4) for column_major_tma, else T."""
    padded = _layout_name(scale_layout) == "column_major_tma"
    return -(-tokens // 4) * 4 if padded else tokens


def empty_scales(tokens: int, groups: int, scale_layout, device) -> torch.Tensor:
    """Uninitialised fp32 scales [T, G] in `scale_layout` (module docstring), as handed out: the
    bridge's own allocation of a layout (`epilogue_tensors.fp8_scale_buffer`)."""
    layout = ScaleLayout(_layout_name(scale_layout))
    return fp8_scale_buffer(tokens, groups, layout, torch.device(device))


def _expected_strides(tokens: int, groups: int, name: str) -> tuple[int, int]:
    return (groups, 1) if name == "row_major" else (1, scale_storage_rows(tokens, name))


def _check_x(x) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x: expected a 2-D tensor [T, H], got {got}")


def _check(q: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, group_size, name: str) -> int:
    """The arguments of `fp8_group_quant_into`, with errors naming the argument, what it must be
    and what it is; returns G."""
    _check_x(x)
    for arg, t in (("q", q), ("scales", scales)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{arg}: expected a tensor, got {type(t).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"x: expected dtype in {INPUT_DTYPES}, got {x.dtype}")
    tokens, hidden = x.shape
    if hidden and x.stride(1) != 1:
        raise ValueError(f"x: expected contiguous rows (stride(1) == 1), got strides {x.stride()}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size: expected a positive int, got {group_size!r}")
    if hidden % group_size:
        raise ValueError(
            f"group_size: expected a divisor of H = {hidden} (H % group_size == 0), got "
            f"{group_size}"
        )
    groups = hidden // group_size
    if q.shape != (tokens, hidden) or q.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(
            f"q: expected [{tokens}, {hidden}] float8_e4m3fn (or its uint8 view), got "
            f"{list(q.shape)} {q.dtype}"
        )
    if not q.is_contiguous():
        raise ValueError(f"q: expected a contiguous tensor, got strides {q.stride()}")
    if scales.shape != (tokens, groups) or scales.dtype != torch.float32:
        raise ValueError(
            f"scales: expected [{tokens}, {groups}] float32, got {list(scales.shape)} "
            f"{scales.dtype}"
        )
    want = _expected_strides(tokens, groups, name)
    strides = zip(scales.shape, scales.stride(), want)
    if tokens and any(size > 1 and got != w for size, got, w in strides):
        raise ValueError(
            f"scales: expected the {name} layout's strides {want} (see empty_scales), got "
            f"{scales.stride()}"
        )
    needed = groups * scale_storage_rows(tokens, name) if tokens else 0
    held = scales.untyped_storage().nbytes() // 4 - scales.storage_offset()
    if name == "column_major_tma" and held < needed:
        raise ValueError(
            f"scales: expected storage for [{groups}, {scale_storage_rows(tokens, name)}] fp32 "
            f"(the TMA layout's padding rows included), got {held} elements"
        )
    for arg, t in (("q", q), ("scales", scales)):
        if t.device != x.device:
            raise ValueError(f"{arg}: expected device {x.device} (x's), got {t.device}")
    return groups


@functools.lru_cache(maxsize=512)
def launch_shape(groups: int, group_size: int, max_tile: int = MAX_TILE) -> tuple[int, int, int]:
    """(CHUNK, BLOCK_M, num_warps) for `groups` groups (over the scale storage's rows) of
    `group_size`: a group's elements in one power-of-two tile of at most `max_tile`; several
    groups per program up to TILE_ELEMENTS, fewer while that leaves fewer than MIN_PROGRAMS
    programs; 16 elements of x per thread (two 16-byte loads of bf16)."""
    chunk = min(triton.next_power_of_2(group_size), max_tile)
    block_m = max(1, TILE_ELEMENTS // chunk)
    while block_m > 1 and triton.cdiv(groups, block_m) < MIN_PROGRAMS:
        block_m //= 2
    return chunk, block_m, max(1, min(16, block_m * chunk // 512))


def fp8_group_quant_into(
    q: torch.Tensor,
    scales: torch.Tensor,
    x: torch.Tensor,
    group_size: int,
    scale_layout="row_major",
    *,
    max_tile: int = MAX_TILE,
    block_m: Optional[int] = None,
) -> None:
    """Quantize x [T, H] (bf16, fp16 or fp32; rows contiguous) into preallocated outputs:
    q [T, H] float8_e4m3fn (or its uint8 view), contiguous; scales fp32 [T, H / group_size] in
    `scale_layout` ("row_major", "column_major", "column_major_tma" or the spec's ScaleLayout), as
    `empty_scales` makes them (strides checked; the TMA layout's padding rows are written 0).
    x is only read. T == 0 launches nothing. max_tile: the most elements of x a program holds
    (tests make it small to take the two-pass path of wide groups); block_m: groups per program
    in place of `launch_shape`'s (a power of two: tests and benchmark sweeps)."""
    name = _layout_name(scale_layout)
    groups = _check(q, scales, x, group_size, name)
    if max_tile < 16 or max_tile & (max_tile - 1):
        raise ValueError(f"max_tile: expected a power of two >= 16, got {max_tile}")
    tokens = x.shape[0]
    if tokens == 0 or groups == 0:
        return
    rows = scale_storage_rows(tokens, name)
    if rows * groups + TILE_ELEMENTS >= 2**31:
        raise ValueError(
            f"x: expected fewer than 2^31 groups (T * H / group_size), got {rows * groups}"
        )
    chunk, rule_m, warps = launch_shape(rows * groups, group_size, max_tile)
    if block_m is None:
        block_m = rule_m
    elif block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m: expected a power of two >= 1, got {block_m}")
    else:
        warps = max(1, min(16, block_m * chunk // 512))
    s_row, s_group = _expected_strides(tokens, groups, name)
    _LAUNCH(
        (triton.cdiv(rows * groups, block_m),),
        (
            x,
            q.view(torch.uint8),
            scales,
            tokens,
            x.stride(0),
            groups,
            rows,
            s_row,
            s_group,
        ),
        (group_size, chunk, block_m, x.is_cuda),
        warps,
    )


def fp8_group_quant(
    x: torch.Tensor, group_size: int = 128, scale_layout="row_major"
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (q [T, H] float8_e4m3fn, scales [T, H / group_size] fp32 in `scale_layout`),
    newly allocated (fp8_group_quant_into's rules)."""
    _check_x(x)
    tokens, hidden = x.shape
    groups = hidden // group_size if isinstance(group_size, int) and group_size > 0 else 0
    q = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device=x.device)
    scales = empty_scales(tokens, groups, scale_layout, x.device)
    fp8_group_quant_into(q, scales, x, group_size, scale_layout)
    return q, scales


def fp8_per_token_quant(
    x: torch.Tensor, out: Optional[tuple[torch.Tensor, torch.Tensor]] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8: x [T, H] -> (q [T, H] float8_e4m3fn, scales [T, 1] fp32), the row
    as one group (`quantize_fp8_per_token`'s formula). out: preallocated (q, scales) to write."""
    _check_x(x)
    tokens, hidden = x.shape
    if hidden == 0:
        raise ValueError("x: expected H > 0 for per-token quantization, got H = 0")
    if out is None:
        q = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device=x.device)
        out = (q, torch.empty(tokens, 1, dtype=torch.float32, device=x.device))
    fp8_group_quant_into(out[0], out[1], x, hidden, "row_major")
    return out
