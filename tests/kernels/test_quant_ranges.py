"""Our quantizers over the whole of e4m3's and e2m1's ranges, bit for bit against quant_ref (the
torch reference): every e4m3 value, every rounding boundary between two of them and one step
either side, the subnormals, saturation, +-inf and NaN; NVFP4 blocks whose scale lands on each kind
of e4m3 value (subnormal, normal, rounded, saturated, 0, NaN) with their elements on every e2m1
threshold and one step either side. Through the standalone quant kernel (the software conversion,
as the norm kernel and the multi-rank kernels quantize: fp32 input, so a step is one fp32 ulp) and
through fused_tp1's leaner code search (whole and split rows: bf16 values, one bf16 ulp), where the
norm of a row of ones is gamma itself. Outputs are poisoned first. On a GPU the same tests run the
GPU's own conversions (HW_CVT)."""

import pytest
import torch

from fusion_bridge.kernels.quant import QUANT_FP8, QUANT_NVFP4, quantize_into
from fusion_bridge.spec import EpilogueSpec, QuantSpec, SFLayout, sf_shape
from fusion_bridge.strategies.fused_tp1 import FusedTp1Strategy
from tests import oracle64
from tests.helpers import quant_problems
from tests.kernels.test_tp1 import DEVICE, ENV, _launch_with, whole_rows

INF, NAN = float("inf"), float("nan")
E2M1_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # the rounding boundaries, times sf
E2M1_VALUES = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _steps(x: torch.Tensor) -> torch.Tensor:
    """x, and one step of x's dtype toward 0 and away from it (where ties to even decide)."""
    return torch.cat([x, torch.nextafter(x, torch.zeros_like(x)), torch.nextafter(x, x * 2)])


def _nans(dtype) -> torch.Tensor:
    """Quiet and signalling NaNs of either sign."""
    if dtype == torch.float32:
        bits = [0x7FC00000, -0x400000, 0x7F800001, 0x7FFFFFFF, -1]  # -0x400000: 0xFFC00000
        return torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    return torch.tensor([0x7FC0, -0x40, 0x7F81, -1], dtype=torch.int16).view(dtype)


def e4m3_range(dtype) -> torch.Tensor:
    """Every finite e4m3 value, every midpoint between two neighbours (the ties) with a step of
    `dtype` either side, below the smallest subnormal (2^-10 is a tie to 0), at and past 448 (464
    is the midpoint to 480, which e4m3 lacks), `dtype`'s largest finite, +-inf, NaN; both signs."""
    values = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    mids = (values[1:] + values[:-1]) / 2
    edges = [2.0**-10, 2.0**-11, 464.0, 480.0, 1e6, torch.finfo(dtype).max, INF]
    x = torch.cat([values, mids, torch.tensor(edges)]).to(dtype)
    x = _steps(x)
    return torch.cat([x, -x, _nans(dtype)])


def e2m1_blocks(dtype) -> torch.Tensor:
    """[blocks, 16] of `dtype` for global scale 1: per e4m3 scale sf (subnormal, the smallest
    normal, normal, the largest) a block of amax 6 sf (so gs * amax / 6 = sf exactly) holding the
    thresholds times sf, one holding a step either side of each, one the e2m1 values times sf, all
    with both signs; then a scale that rounds down (e2m1 saturates), one that saturates at 448, the
    tie to a zero scale, a zero-scale block of tiny values of both signs, +-inf, NaN among finite
    values, all NaN, -NaN with -inf."""
    blocks = []
    for sf in (2.0**-9, 5 * 2.0**-9, 2.0**-6, 0.375, 1.0, 1.125, 13.0, 448.0):
        top = torch.tensor([6 * sf], dtype=dtype)
        t = torch.tensor(E2M1_THRESHOLDS, dtype=dtype) * sf
        down = torch.nextafter(t, torch.zeros_like(t))
        up = torch.nextafter(t, t * 2)
        values = torch.tensor(E2M1_VALUES[:-1], dtype=dtype) * sf
        blocks += [
            torch.cat([top, t, -t, torch.tensor([-0.0], dtype=dtype)]),
            torch.cat([-top, up, down, torch.tensor([0.0], dtype=dtype)]),
            torch.cat([top, -up, -down, torch.tensor([-0.0], dtype=dtype)]),
            torch.cat([-top, values, -values, top, torch.zeros(2, dtype=dtype)])[:16],
        ]
    specials = [
        [6.375, 6.25, -6.3, 1.0, -0.3, 5.0, 0.0, -0.0],  # sf = e4m3(1.0625) = 1: 6.375 saturates
        [3000.0, 2700.0, -2688.0, 1000.0, -1.0, 400.0, 0.5, -0.0],  # sf saturates at 448
        [6 * 2.0**-10, -(2.0**-10), 2.0**-12, 0.0, -0.0, -(2.0**-11)],  # a tie: sf 0
        [1e-4, -1e-4, -3e-5, 2e-5, 0.0, -0.0, -1e-9],  # sf 0: codes keep only the sign
        [INF, 1.0, -1.0, 100.0, -3e38, 0.0],  # sf 448, inf saturates
        [NAN, 1.0, -2.0, 0.0, -0.0, 3.0, -1e-9],  # sf NaN: codes keep only the sign
        [NAN] * 16,
        [-INF, -NAN, 5.0, -5.0],
    ]
    for row in specials:
        row = torch.tensor((row * 16)[:16], dtype=torch.float32).to(dtype)
        blocks.append(row)
    return torch.stack(blocks)


def _rows(x: torch.Tensor, hidden: int) -> torch.Tensor:
    """x laid out in rows of `hidden` (zero-padded)."""
    rows = -(-x.numel() // hidden)
    out = torch.zeros(rows * hidden, dtype=x.dtype)
    out[: x.numel()] = x.flatten()
    return out.view(rows, hidden)


def _quantized(quant: QuantSpec, x: torch.Tensor):
    """quantize_into of x [T, H] into poisoned outputs (0xFF, padding included)."""
    tokens, hidden = x.shape
    fp8 = quant.kind.value == "fp8"
    q = torch.full((tokens, hidden if fp8 else hidden // 2), 0xFF, dtype=torch.uint8)
    sf_dims = (0,) if fp8 else sf_shape(tokens, hidden, quant.sf_layout)
    sf = torch.full(sf_dims, 0xFF, dtype=torch.uint8)
    code, scale = (QUANT_FP8, quant.scale) if fp8 else (QUANT_NVFP4, quant.global_scale)
    q, sf, x = q.to(DEVICE), sf.to(DEVICE), x.to(DEVICE)
    quantize_into(q, sf, x, code, scale, quant.sf_layout is SFLayout.SWIZZLED_128x4)
    return q, sf


@pytest.mark.parametrize("scale", [1.0, 0.02], ids=["scale1", "scale0.02"])
def test_fp8_codes_over_e4m3s_whole_range(scale):
    """Scale 1 puts the quotients on the values above; 0.02 (the scale of the audit's mutant)
    moves them off it and through the subnormals by other paths."""
    x = e4m3_range(torch.float32)
    x = _rows(torch.cat([x, x * scale]), 256)
    quant = QuantSpec.fp8(scale)
    q, sf = _quantized(quant, x)
    nan = torch.isnan(x)
    assert nan.any() and (x.abs() == INF).any() and ((x.abs() < 2.0**-6) & (x != 0)).any()
    assert not quant_problems(quant, x, q, sf), quant_problems(quant, x, q, sf)


@pytest.mark.parametrize("global_scale", [1.0, 336.0])
def test_nvfp4_codes_over_e2m1s_whole_range(global_scale):
    """10 blocks a row (H=160). Global scale 1 keeps the blocks' designed scales; 336 (448 * 6 / 8)
    rounds the products. Linear scales: the codes and scales do not depend on the layout, and a
    swizzled launch is 128 programs, slow under the interpreter (fused_tp1's split rows below and
    tests/kernels/test_blocks.py cover the swizzled layout and its padding)."""
    quant = QuantSpec.nvfp4(global_scale, SFLayout.LINEAR)
    x = _rows(e2m1_blocks(torch.float32) / global_scale, 160)
    q, sf = _quantized(quant, x)
    nan_blocks = torch.isnan(x.view(x.shape[0], -1, 16)).any(-1)
    assert nan_blocks.any() and not nan_blocks.all()
    assert not quant_problems(quant, x, q, sf), quant_problems(quant, x, q, sf)


def _exact_quotient_codes(x: torch.Tensor, global_scale: float) -> torch.Tensor:
    """[T, H] e2m1 codes by the formula this library used before it took FlashInfer's steps:
    sf = e4m3(fp32(gs * amax) / 6), the code of the exact quotient fp32(x * gs) / sf. Only to show
    that a test's data tells the two apart."""
    f64 = torch.float64
    gs = torch.tensor(global_scale, dtype=torch.float32).to(f64)
    blocks = x.to(f64).reshape(x.shape[0], -1, 16)
    amax = blocks.abs().amax(-1, keepdim=True)
    sf = oracle64.e4m3_value((gs * amax).float().to(f64) / 6.0)
    quotient = (blocks * gs).float().to(f64) / sf
    return oracle64.e2m1_code(quotient.abs(), blocks < 0).reshape(x.shape)


@pytest.mark.parametrize("global_scale", [3.0, 384.0])
def test_nvfp4_codes_round_the_fp32_product_as_flashinfer_does(global_scale):
    """Codes and scales bit for bit against the float64 oracle's statement of FlashInfer's steps
    (sf = e4m3(gs * (amax * fp32(1/6))), the code of fp32(x * fp32(1 / fp32(sf * fp32(1 / gs))))),
    on data where that formula and the exact quotient give different codes (the product rounded
    to fp32 lands on or across a tie) or scales, and -0.0 written as code 8, in an all-zero block
    and among other values."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(24, 512, generator=g).to(torch.bfloat16)
    x[0, :16] = -0.0
    x[1, :8] = -0.0
    q, sf = _quantized(QuantSpec.nvfp4(global_scale, SFLayout.LINEAR), x)
    o_q, o_sf = oracle64.nvfp4(x, global_scale, False)
    assert torch.equal(sf.cpu(), o_sf) and torch.equal(q.cpu(), o_q)
    codes = torch.stack([q.cpu() & 0xF, q.cpu() >> 4], dim=-1).reshape(x.shape)
    assert (codes[0, :16] == 8).all() and (codes[1, :8] == 8).all() and sf[0, 0] == 0
    assert int((_exact_quotient_codes(x, global_scale) != codes).sum()) >= 10


def _tp1_with_gamma(quant: QuantSpec, gamma: torch.Tensor, config_of):
    """fused_tp1 on one row of ones (every slot skipped, no shared output) with this gamma: its
    sum of squares is H, its mean 1, and with eps = 1e-30 (below half an ulp of 1) the norm is
    gamma itself, so gamma's values are what gets quantized. config_of(spec): the launch config."""
    hidden = gamma.numel()
    spec = EpilogueSpec(
        hidden_size=hidden, top_k=1, has_shared_output=False, eps=1e-30, quant=quant
    )
    strat = FusedTp1Strategy(spec, ENV, device=torch.device(DEVICE))
    strat.prepare()
    strat._launcher.num_sms = 16
    from fusion_bridge.oracle.synthetic import make_inputs

    inp = make_inputs(spec, 1, seed=1, device=DEVICE, skip_fraction=0.0)
    inp = inp._replace(
        expanded_idx_to_permuted_idx=torch.full_like(inp.expanded_idx_to_permuted_idx, -1),
        residual=torch.ones_like(inp.residual),
        gamma=gamma.to(DEVICE),
    )
    return _launch_with(strat, inp, config_of(spec))


TP1_CONFIGS = {
    "whole": whole_rows,
    "split": lambda spec: __import__("fusion_bridge").kernels.tp1.configs.Tp1Config(512, 4),
}


@pytest.mark.parametrize(
    "quant,config",
    [
        (QuantSpec.fp8(1.0), "whole"),
        (QuantSpec.fp8(1.0), "split"),
        (QuantSpec.nvfp4(1.0, SFLayout.LINEAR), "whole"),
        (QuantSpec.nvfp4(1.0), "split"),
    ],
    ids=["fp8-whole", "fp8-split", "nvfp4_linear-whole", "nvfp4_swizzled-split"],
)
def test_fused_tp1_quantizes_the_whole_ranges(quant, config):
    """fused_tp1's leaner forms (codes in the row's own layout, NVFP4 by the search with no
    predicates): bf16 values over e4m3's range (fp8) or the e2m1 blocks (nvfp4), H=2048, in whole
    and split rows (the swizzled layout with split rows: their padding is a few items, a whole-row
    launch 128 programs)."""
    if quant.kind.value == "fp8":
        gamma = _rows(e4m3_range(torch.bfloat16), 2048)[0]
    else:
        gamma = _rows(e2m1_blocks(torch.bfloat16), 2048)[0]
    out = _tp1_with_gamma(quant, gamma, TP1_CONFIGS[config])
    if DEVICE == "cpu":  # the norm is gamma + 0.0 (-0.0 turns +0.0): the range was quantized
        norm, want = out.norm_out[0].cpu(), (gamma.float() + 0.0).to(torch.bfloat16)
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(norm), nan)
        assert torch.equal(norm[~nan].view(torch.int16), want[~nan].view(torch.int16))
    problems = quant_problems(quant, out.norm_out, out.quant, out.scale)
    assert not problems, problems


@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_every_quantizing_kernel_keeps_a_nan_row_nan(kind):
    """A residual row of NaN (what a peer of a failing rank gets, and what an overflow gives):
    norm_out's row is NaN, and its quantized row must say so as quant_ref does (fp8: NaN codes;
    nvfp4: NaN block scales), not finite codes the next GEMM reads as numbers. The standalone
    quant kernel, the norm kernel (local_fused), fused_tp1's whole rows (linear scales) and split
    rows (swizzled); the multi-rank kernels: tests/kernels/test_symm_oneshot.py, _twoshot.py."""
    from fusion_bridge.kernels.add_rmsnorm import add_rmsnorm_into
    from fusion_bridge.kernels.tp1.configs import Tp1Config
    from fusion_bridge.oracle.synthetic import make_inputs

    gs = 448 * 6 / 8.0
    linear = QuantSpec.fp8(0.02) if kind == "fp8" else QuantSpec.nvfp4(gs, SFLayout.LINEAR)
    swizzled = QuantSpec.fp8(0.02) if kind == "fp8" else QuantSpec.nvfp4(gs)
    spec = EpilogueSpec(hidden_size=64, top_k=2, quant=linear)
    inp = make_inputs(spec, 3, seed=9, device=DEVICE)
    inp.residual[1] = NAN
    got = {"quantize": (linear, inp.residual, *_quantized(linear, inp.residual))}
    out = _poisoned_like(spec, 3)
    fp8 = kind == "fp8"
    add_rmsnorm_into(
        *out, inp.residual, inp.residual * 0.5, inp.gamma, eps=spec.eps, weight_bias=0.0,
        quant=QUANT_FP8 if fp8 else QUANT_NVFP4, quant_scale=0.02 if fp8 else gs, swizzled=False,
    )  # fmt: skip
    got["add_rmsnorm"] = (linear, out[1], out[2], out[3])
    for quant, config, name in (
        (linear, whole_rows(spec), "tp1_whole"),
        (swizzled, Tp1Config(32, 1), "tp1_split"),
    ):
        tp1_spec = EpilogueSpec(hidden_size=64, top_k=2, quant=quant)
        strat = FusedTp1Strategy(tp1_spec, ENV, device=torch.device(DEVICE))
        strat.prepare()
        strat._launcher.num_sms = 16
        tp1 = _launch_with(strat, inp, config)
        got[name] = (quant, tp1.norm_out, tp1.quant, tp1.scale)
    problems = {
        name: quant_problems(quant, norm, q, sf, nan_rows=[1])
        for name, (quant, norm, q, sf) in got.items()
    }
    assert not any(problems.values()), problems


def _poisoned_like(spec, tokens):
    """residual_out, norm_out (NaN), q and sf (0xFF bytes) of `spec` for T rows."""
    from fusion_bridge.epilogue_tensors import allocate_outputs

    out = allocate_outputs(spec, tokens, torch.device(DEVICE))
    q = out.quant.view(torch.uint8)
    sf = out.scale if out.scale is not None else torch.empty(0, dtype=torch.uint8, device=DEVICE)
    for t in (out.residual_out, out.norm_out, q, sf):
        t.view(torch.uint8).fill_(0xFF)
    return out.residual_out, out.norm_out, q, sf


@pytest.mark.skipif(
    DEVICE != "cpu", reason="interpreter emulation (GPU: the emulated_on_one_gpu files)"
)
@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_the_multi_rank_kernels_keep_a_nan_row_nan(kind):
    """As above for the one-shot and the two-shot, 2 emulated ranks: the residual row 1 NaN on
    every rank (one TP group), every rank's quantized row 1 NaN as quant_ref's; nvfp4 with swizzled
    scales (the kernels write the padding with a few items, not 128 programs)."""
    from fusion_bridge.kernels.quant_codes import QUANT_FP8 as FP8
    from fusion_bridge.oracle.synthetic import make_inputs
    from fusion_bridge.testing.symm_twoshot_rig import EmulatedTwoshot
    from tests.kernels.test_symm_oneshot import SCALE, Group, outputs
    from tests.kernels.test_symm_twoshot import _run

    code = FP8 if kind == "fp8" else QUANT_NVFP4
    quant = QuantSpec.fp8(SCALE[code]) if kind == "fp8" else QuantSpec.nvfp4(SCALE[code])
    spec = EpilogueSpec(hidden_size=64, top_k=2, quant=quant)
    inputs = [make_inputs(spec, 3, rank=r, seed=7) for r in range(2)]
    for inp in inputs:
        inp.residual[1] = NAN
    grp = Group(spec, 2, 3, code, quant.sf_layout)
    oneshot = [outputs(spec, 3, code, quant.sf_layout) for _ in range(2)]
    grp.g.call(inputs, oneshot)
    twoshot = _run(EmulatedTwoshot(2, 4, 64), spec, inputs)
    problems = {
        (name, rank): quant_problems(quant, out[1], out[2], out[3], nan_rows=[1])
        for name, outs in (("oneshot", oneshot), ("twoshot", twoshot))
        for rank, out in enumerate(outs)
    }
    assert not any(problems.values()), problems


@pytest.mark.gpu
def test_the_gpu_conversions_over_the_whole_ranges_and_a_nan_row():
    """On a GPU the kernels take the GPU's own conversions (HW_CVT: the hardware fp8 conversion
    after a clamp that keeps a NaN, the NaN-keeping block max, fused_tp1's block scales by the
    hardware conversion): the tests above, on CUDA, for `python -m pytest -m gpu`."""
    assert DEVICE == "cuda"
    for scale in (1.0, 0.02):
        test_fp8_codes_over_e4m3s_whole_range(scale)
    for global_scale in (1.0, 336.0):
        test_nvfp4_codes_over_e2m1s_whole_range(global_scale)
    for quant, config in (
        (QuantSpec.fp8(1.0), "whole"),
        (QuantSpec.fp8(1.0), "split"),
        (QuantSpec.nvfp4(1.0), "whole"),
        (QuantSpec.nvfp4(1.0, SFLayout.LINEAR), "split"),
    ):
        test_fused_tp1_quantizes_the_whole_ranges(quant, config)
    for kind in ("fp8", "nvfp4"):
        test_every_quantizing_kernel_keeps_a_nan_row_nan(kind)


def test_swizzled_nvfp4_at_a_hidden_size_of_32_writes_all_four_scale_columns():
    """H=32 has 2 scale blocks a row and the swizzled layout 4 columns: the row kernel's block must
    still span 4 blocks (64 columns), or columns 2 and 3 of every one of the 128 padded rows keep
    the poisoned buffer's bytes instead of 0 (half of the 512 scale bytes)."""
    from fusion_bridge.oracle.quant_ref import quantize_nvfp4

    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    quant = QuantSpec.nvfp4(448.0, SFLayout.SWIZZLED_128x4)
    q, sf = _quantized(quant, x)
    ref_q, ref_sf = quantize_nvfp4(x, 448.0, SFLayout.SWIZZLED_128x4)
    assert sf.shape == (128, 4) and int((sf.cpu() == 0xFF).sum()) == 0
    assert torch.equal(sf.cpu(), ref_sf) and torch.equal(q.cpu(), ref_q)
