"""Our Triton kernels under TRITON_INTERPRET=1 on CPU (on a GPU machine the same tests run on the
GPU).

Two oracles: the fp32 torch reference rounded once (`torch_math` / `quant_ref`: each kernel rounds
once
from fp32, so under the interpreter the outputs must be *equal*; on a GPU FMA contraction may move a
value by at most one ulp), and the independent float64 oracle (`tests/oracle64.py`): every element
within half an ulp of the exact value, plus the fp32 arithmetic error before the one rounding.
Quantized outputs are checked bit for bit against both quantizers applied to the kernel's own
norm_out. Outputs are poisoned first, so an element left unwritten shows up.
"""

import subprocess
import sys

import pytest
import torch

from fusion_bridge import EpilogueSpec
from fusion_bridge.spec import SFLayout
from fusion_bridge.oracle.quant_ref import quantize_fp8, quantize_nvfp4, sf_shape
from fusion_bridge.oracle.synthetic import make_inputs
from fusion_bridge.oracle.torch_math import finalize_fp32, rmsnorm_fp32
from fusion_bridge.kernels.add_rmsnorm import add_rmsnorm_into
from fusion_bridge.kernels.finalize_add import finalize_add_into
from fusion_bridge.kernels.quant import QUANT_FP8, QUANT_NONE, QUANT_NVFP4, quantize_into
from tests import oracle64
from tests.helpers import garbage_weights_where_skipped

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISON = 0xFF
# fp32 error before the one rounding, relative: an RMSNorm row (sum of squares, rsqrt, two products)
# stays below 2^-22 measured (2.4e-7 worst over H=80..2880); 2^-20 leaves 4x.
NORM_FP32_SLACK = 2.0**-20
# a finalize sum of K+1 <= 9 fp32 terms errs by at most 9 * 2^-24 <= 2^-20 times the sum of |terms|
FINALIZE_FP32_SLACK = 2.0**-20


def poisoned(shape, dtype):
    t = torch.empty(shape, dtype=dtype, device=DEVICE)
    t.view(torch.uint8).fill_(POISON)  # NaN for float dtypes
    return t


def assert_rounded_once(got, ref_fp32, fp32_slack_abs=None):
    """Equal to the fp32 reference rounded once (interpreter); on a GPU (FMA, another summation
    order)
    within one ulp, plus `fp32_slack_abs` where fp32 sums cancel: then the result's ulp is smaller
    than
    the fp32 error of its terms (measured on H200: fp16 finalize, H=160, K=8, T=9, one element)."""
    want = ref_fp32.to(got.dtype)
    if DEVICE == "cpu":
        diff = (got.float() != want.float()).nonzero()
        assert torch.equal(got, want), f"{len(diff)} elements differ, e.g. at {diff[:5].tolist()}"
    else:
        g, w = got.cpu().double(), want.cpu().double()
        limit = oracle64.ulp(w, got.dtype) + (
            0.0 if fp32_slack_abs is None else fp32_slack_abs.cpu().double()
        )
        bad = ~((g - w).abs() <= limit)
        idx = bad.nonzero()[:5].tolist()
        assert not bad.any(), (
            f"{int(bad.sum())} elements beyond the bound, e.g. at {idx}: got "
            f"{[g[tuple(i)].item() for i in idx]}, fp32 ref {[w[tuple(i)].item() for i in idx]}"
        )


@pytest.mark.parametrize("tokens", [0, 1, 3, 9])
@pytest.mark.parametrize("hidden,top_k", [(80, 1), (160, 8), (2880, 2)])
@pytest.mark.parametrize(
    "dtype,weight_dtype,shared",
    [
        (torch.bfloat16, torch.float32, True),
        (torch.bfloat16, torch.bfloat16, False),
        (torch.float16, torch.float32, True),
    ],
)
def test_finalize_add_rounds_once_from_fp32(tokens, hidden, top_k, dtype, weight_dtype, shared):
    scaling = 2.5  # != 1: a kernel that drops it is off by 2.5x
    spec = EpilogueSpec(
        hidden_size=hidden,
        top_k=top_k,
        dtype=dtype,
        has_shared_output=shared,
        routed_scaling_factor=scaling,
    )
    inp = make_inputs(spec, tokens, seed=tokens + hidden, device=DEVICE, weight_dtype=weight_dtype)
    # NaN / inf weights in the skipped slots (allowed there): mutant killed, a skipped slot's
    # weight multiplied in instead of dropped
    inp = garbage_weights_where_skipped(inp)
    out = poisoned((tokens, hidden), dtype)
    finalize_add_into(
        out,
        inp.gemm2_out,
        inp.expanded_idx_to_permuted_idx,
        inp.expert_weights,
        inp.shared_output,
        scaling,
    )
    ref = finalize_fp32(
        inp.gemm2_out, inp.expanded_idx_to_permuted_idx, inp.expert_weights, scaling
    )
    if shared:
        ref = ref + inp.shared_output.float()
    # skipped slots point at NaN rows: a read of one shows up as non-finite
    assert torch.isfinite(out).all()
    cpu = [None if t is None else t.cpu() for t in inp]
    exact = oracle64.finalize64(cpu[0], cpu[1], cpu[2], scaling)
    magnitude = oracle64.finalize64(cpu[0].abs(), cpu[1], cpu[2].abs(), scaling)
    if shared:
        exact, magnitude = exact + cpu[3].double(), magnitude + cpu[3].double().abs()
    assert_rounded_once(
        out, ref, 2 * FINALIZE_FP32_SLACK * magnitude
    )  # two fp32 sums: ours and the reference's
    oracle64.check_rounded_once(out.cpu(), exact, slack_abs=FINALIZE_FP32_SLACK * magnitude)


def _norm_inputs(tokens, hidden, seed, magnitude=1.0):
    g = torch.Generator().manual_seed(seed)
    residual = (magnitude * torch.randn(tokens, hidden, generator=g)).to(torch.bfloat16)
    reduced = (3 * magnitude * torch.randn(tokens, hidden, generator=g)).to(torch.bfloat16)
    gamma = (1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16)
    return residual.to(DEVICE), reduced.to(DEVICE), gamma.to(DEVICE)


def _run_add_rmsnorm(residual, reduced, gamma, eps, weight_bias, quant, scale, layout):
    tokens, hidden = residual.shape
    dtype = residual.dtype
    residual_out, norm_out = poisoned((tokens, hidden), dtype), poisoned((tokens, hidden), dtype)
    q_shape = {QUANT_NONE: (0,), QUANT_FP8: (tokens, hidden), QUANT_NVFP4: (tokens, hidden // 2)}[
        quant
    ]
    q = poisoned(q_shape, torch.uint8)
    sf = poisoned(sf_shape(tokens, hidden, layout) if quant == QUANT_NVFP4 else (0,), torch.uint8)
    add_rmsnorm_into(
        residual_out,
        norm_out,
        q,
        sf,
        residual,
        reduced,
        gamma,
        eps=eps,
        weight_bias=weight_bias,
        quant=quant,
        quant_scale=scale,
        swizzled=layout is SFLayout.SWIZZLED_128x4,
    )
    return residual_out, norm_out, q, sf


def check_quant_codes(quant, layout, scale, norm_out, q, sf):
    """Bit for bit against quant_ref and against the float64 oracle's quantizers, both applied to
    the
    kernel's own rounded norm_out (the quantizers' input by convention)."""
    swizzled = layout is SFLayout.SWIZZLED_128x4
    if quant == QUANT_FP8:
        assert torch.equal(q, quantize_fp8(norm_out, scale).view(torch.uint8))
        assert torch.equal(q.cpu(), oracle64.fp8_codes(norm_out.cpu(), scale))
    if quant == QUANT_NVFP4:
        ref_q, ref_sf = quantize_nvfp4(norm_out, scale, layout)
        assert torch.equal(q, ref_q)
        assert torch.equal(sf, ref_sf)  # includes the zeroed swizzle padding (was poisoned)
        o_q, o_sf = oracle64.nvfp4(norm_out.cpu(), scale, swizzled)
        assert torch.equal(q.cpu(), o_q) and torch.equal(sf.cpu(), o_sf)


QUANTS = [
    (QUANT_NONE, SFLayout.LINEAR),
    (QUANT_FP8, SFLayout.LINEAR),
    (QUANT_NVFP4, SFLayout.SWIZZLED_128x4),
    (QUANT_NVFP4, SFLayout.LINEAR),
]


@pytest.mark.parametrize("tokens,hidden", [(1, 80), (3, 160), (130, 80), (3, 2880)])
@pytest.mark.parametrize("quant,layout", QUANTS)
def test_add_rmsnorm_quant_rounds_once_and_quantizes_its_own_output(tokens, hidden, quant, layout):
    residual, reduced, gamma = _norm_inputs(tokens, hidden, tokens * 31 + hidden)
    scale = {QUANT_NONE: 1.0, QUANT_FP8: 0.02, QUANT_NVFP4: 448 * 6 / 6.0}[quant]
    eps, weight_bias = 1e-6, 0.5  # weight_bias != 0: the scale is gamma + 0.5, not gamma
    residual_out, norm_out, q, sf = _run_add_rmsnorm(
        residual, reduced, gamma, eps, weight_bias, quant, scale, layout
    )
    x = residual.float() + reduced.float()
    assert torch.equal(residual_out, x.to(residual.dtype))  # one RNE rounding of the same fp32 sum
    assert torch.isfinite(norm_out).all()
    assert_rounded_once(norm_out, rmsnorm_fp32(x, gamma, eps, weight_bias))
    oracle64.check_rounded_once(
        norm_out.cpu(), oracle64.rmsnorm64(x.cpu(), gamma.cpu(), eps, weight_bias), NORM_FP32_SLACK
    )
    check_quant_codes(quant, layout, scale, norm_out, q, sf)


@pytest.mark.parametrize("quant,layout", QUANTS)
def test_eps_is_observable_and_applied(quant, layout):
    """Rows of rms ~0.03: mean(x^2) ~ 1e-3, so eps = 1e-2 shrinks norm_out about 3x; dropping eps
    (or
    using another) cannot pass the once-rounded comparison."""
    eps, weight_bias = 1e-2, -0.25
    residual, reduced, gamma = _norm_inputs(5, 96, 7, magnitude=0.01)
    x = residual.float() + reduced.float()
    with_eps = oracle64.rmsnorm64(x.cpu(), gamma.cpu(), eps, weight_bias)
    without = oracle64.rmsnorm64(x.cpu(), gamma.cpu(), 1e-9, weight_bias)
    assert oracle64.normwise_rel_err(with_eps, without) > 0.5  # the case really observes eps
    scale = {QUANT_NONE: 1.0, QUANT_FP8: 0.002, QUANT_NVFP4: 448 * 6 / 0.5}[quant]
    _, norm_out, q, sf = _run_add_rmsnorm(
        residual, reduced, gamma, eps, weight_bias, quant, scale, layout
    )
    assert_rounded_once(norm_out, rmsnorm_fp32(x, gamma, eps, weight_bias))
    oracle64.check_rounded_once(norm_out.cpu(), with_eps, NORM_FP32_SLACK)
    check_quant_codes(quant, layout, scale, norm_out, q, sf)


@pytest.mark.parametrize(
    "quant,layout",
    [
        (QUANT_FP8, SFLayout.LINEAR),
        (QUANT_NVFP4, SFLayout.SWIZZLED_128x4),
        (QUANT_NVFP4, SFLayout.LINEAR),
    ],
)
def test_standalone_quantize_matches_both_quantizers(quant, layout):
    x = (2 * torch.randn(5, 96, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16)
    x[0, :16] = 0.0  # an all-zero block: sf 0, every code 0
    x[1, 0] = 1000.0  # fp8 saturates (1000 / 0.01 far above 448)
    x = x.to(DEVICE)
    scale = 0.01 if quant == QUANT_FP8 else 100.0
    if quant == QUANT_FP8:
        q, sf = poisoned((5, 96), torch.uint8), torch.empty(0, dtype=torch.uint8, device=DEVICE)
    else:
        q, sf = poisoned((5, 48), torch.uint8), poisoned(sf_shape(5, 96, layout), torch.uint8)
    quantize_into(q, sf, x, quant, scale, layout is SFLayout.SWIZZLED_128x4)
    check_quant_codes(quant, layout, scale, x, q, sf)


def test_custom_ops_allocate_empty_outputs_for_zero_tokens():
    import fusion_bridge.kernels.ops  # noqa: F401

    empty = torch.empty(0, 64, dtype=torch.bfloat16, device=DEVICE)
    out = torch.ops.fusion_bridge.finalize_add(
        torch.empty(4, 64, dtype=torch.bfloat16, device=DEVICE),
        torch.empty(0, 2, dtype=torch.int32, device=DEVICE),
        torch.empty(0, 2, device=DEVICE),
        None,
        1.0,
    )
    assert out.shape == (0, 64)
    r, n, q, sf = torch.ops.fusion_bridge.add_rmsnorm_quant(
        empty,
        empty,
        torch.ones(64, dtype=torch.bfloat16, device=DEVICE),
        1e-6,
        0.0,
        QUANT_NVFP4,
        1.0,
        True,
    )
    assert r.shape == n.shape == (0, 64) and q.shape == (0, 32) and sf.shape == (0, 4)


@pytest.mark.skipif(DEVICE != "cpu", reason="about the interpreter")
def test_an_interpreter_that_cannot_import_is_reported_with_its_cause():
    """numpy missing: under TRITON_INTERPRET=1 `import triton` fails; the reason must say so, not
    claim that triton is missing."""
    code = (
        "import sys; sys.modules['numpy'] = None\n"  # as if numpy were not installed
        "from fusion_bridge.environment import detect\n"
        "from fusion_bridge.reasons import require_triton\n"
        "env = detect(probe_flashinfer=False)\n"
        "r = require_triton(env, 'local_fused')\n"
        "print(env.triton_version, '|', r.code, '|', r.message, '|', r.hint)\n"
    )
    import os

    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    version, reason_code, message, hint = [
        p.strip() for p in res.stdout.strip().splitlines()[-1].split("|")
    ]
    assert version == "None" and reason_code == "triton_interpreter_unavailable"
    assert "numpy" in message and "TRITON_INTERPRET=1" in message and "pip install numpy" in hint


def test_rounding_to_bf16_keeps_every_nan_a_nan():
    """The GPU's NaN is 0x7FFFFFFF: the integer round-to-nearest-even would carry into the sign bit
    and
    turn it into -0.0 (seen on H200: a NaN partial sum came out as norm_out -0.0). Every NaN pattern
    stays
    NaN; finite values round to nearest even as torch does."""
    bits = torch.tensor(
        [0x7FFFFFFF, 0x7FC00000, -1, 0x7F800001, 0x3F808000, 0x3F818000, 0x3F80FFFF],
        dtype=torch.int32,
    )
    x = bits.view(torch.float32)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.empty(len(bits), dtype=torch.bfloat16, device=device)
    _round_kernel[(1,)](x.to(device), out, len(bits), BLOCK=8)
    out = out.cpu()
    assert out[:4].isnan().all(), out[:4].float()
    assert torch.equal(out[4:], x[4:].to(torch.bfloat16))


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fusion_bridge.kernels.rounding import round_to  # noqa: E402


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + cols, mask=cols < n, other=0.0)
    tl.store(out_ptr + cols, round_to(x, tl.bfloat16), mask=cols < n)


from fusion_bridge.kernels.quant import _e2m1_codes, _e2m1_nibbles  # noqa: E402


@triton.jit
def _e2m1_both_kernel(p_ptr, out_ptr, n, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    p = tl.load(p_ptr + cols, mask=cols < n, other=0.0)
    neg = (p.to(tl.int32, bitcast=True) < 0) & (p == p)
    tl.store(out_ptr + cols, _e2m1_codes(tl.abs(p)) | (neg.to(tl.int32) << 3), mask=cols < n)
    tl.store(
        out_ptr + BLOCK + cols, _e2m1_nibbles(p, neg.to(tl.float32)).to(tl.int32), mask=cols < n
    )


def test_nvfp4_codes_by_search_equal_the_seven_comparisons():
    """`_e2m1_nibbles` (the world-size-1 kernels' NVFP4 codes, by search) against `_e2m1_codes`
    (the seven comparisons), both against the e2m1 rounding by distance (quant_ref), with the sign
    bit as the kernels set it (x's sign bit: -0.0 gets code 8, NaN none), at each rounding
    boundary and one fp32 step either side of it (where ties-to-even decides), 0, 6 and past it,
    inf and NaN, each of either sign."""
    from fusion_bridge.oracle.quant_ref import e2m1_codes

    edges = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0, 7.0, 100.0, 1e-30])
    p = torch.cat(
        [
            edges,
            torch.nextafter(edges, torch.tensor(0.0)),
            torch.nextafter(edges, torch.tensor(1e30)),
        ]
    )
    p = torch.cat([p, torch.tensor([float("inf"), float("nan")])])
    p = torch.cat([p, -p])
    n = len(p)
    block = triton.next_power_of_2(n)
    out = torch.full((2 * block,), -1, dtype=torch.int32, device=DEVICE)
    _e2m1_both_kernel[(1,)](p.to(DEVICE), out, n, BLOCK=block)
    seven, nibbles = (out[i * block : i * block + n].cpu() for i in range(2))
    expected = e2m1_codes(p, torch.signbit(p) & ~torch.isnan(p)).to(torch.int32)
    assert torch.equal(seven, expected), [
        (float(p[i]), int(seven[i]), int(expected[i])) for i in (seven != expected).nonzero()[:5]
    ]
    assert bool((seven[(p == 0) & torch.signbit(p)] == 8).all())  # -0.0
    bad = (seven != nibbles).nonzero().flatten()
    assert len(bad) == 0, [(float(p[i]), int(seven[i]), int(nibbles[i])) for i in bad[:5]]
