"""The consumer check of issue 49, on one GPU: the bridge's dynamic FP8 outputs (world size 1,
`FusionBridge(EpilogueSpec(..., quant=...))` on cuda) fed to the GEMMs that read them in FP8 models,
the result within the bound of two FP8 quantizations of the operands. Two routes: the bridge's own
choice (`fused_tp1` at world size 1) and `local_fused_nccl` (our add+RMSNorm kernel after NCCL):

    |C - C_ref| <= (2 * 2^-4 + 2^-8) * (|A| @ |W|^T)   elementwise,
    C_ref = norm_out.float() @ W.float()^T,  A = norm_out,  W [N, H] the bf16 weight before its
    quantization

(2^-4: half an e4m3 step relative to a normal value, once for A's codes and once for W's; 2^-8:
the bf16 output's rounding, 2^-9, with as much again for the GEMM's fp32 accumulation.)

- fp8_per_token: `torch._scaled_mm` with rowwise scales (A's [T, 1] as handed out, W quantized
  per output channel, scales [1, N]);
- fp8_per_token_group, column_major and column_major_tma: `torch.nn.functional.scaled_mm(a, w.t(),
  scale_a, BlockWise1x128, scale_w.t(), BlockWise128x128)`, W quantized in 128x128 blocks here
  (scale_w [N/128, round_up(H/128, 4)], what torch's block_1x128_128x128 recipe takes). On an
  H100 with torch 2.11 that GEMM runs only with T a multiple of 4 (its scale_a must be 16-byte
  aligned per column). At other T it runs on round_up(T, 4) rows: for column_major_tma on the
  layout's own storage (its padding rows, which the bridge writes 0, read as the scales of zero
  code rows added to A); for column_major on a copy of the scales into such a padded buffer.
  C[:T] is checked;
- fp8_per_token_group, row_major: no GEMM takes 1x128 scales in row-major order, so A and W are
  dequantized (codes times their scales, in fp32) and multiplied in fp32.

Each case also checks the bridge's codes and scales bit for bit against our standalone kernel
(kernels/fp8_group_quant.py) on the bridge's own norm_out, a second implementation of the formula
on the GPU. Where the installed torch lacks an API, or the GPU is not an SM90 (the blockwise
recipe's only architecture in torch), the test skips with the reason."""

import pytest
import torch

from fusion_bridge import EpilogueSpec, FusionBridge, QuantSpec
from fusion_bridge.oracle.quant_ref import FP8_E4M3_MAX, dequantize_fp8_dynamic
from fusion_bridge.oracle.synthetic import make_inputs

pytestmark = pytest.mark.gpu
TOKENS = (1, 3, 4, 64, 257)
N = 384  # the weight's output dimension: a multiple of 128
BLOCK = 128
BOUND = 2 * 2.0**-4 + 2.0**-8
CASES = ["token", "row_major", "column_major", "column_major_tma"]
# the bridge's own choice at world size 1 (fused_tp1), and our add+RMSNorm kernel after NCCL
STRATEGIES = ["auto", "local_fused_nccl"]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _quant(case: str) -> QuantSpec:
    return (
        QuantSpec.fp8_per_token() if case == "token" else QuantSpec.fp8_per_token_group(128, case)
    )


@pytest.fixture(scope="module")
def bridges():
    """One bridge per (H, case, strategy), built on first use, closed at the end of the module."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (on a GPU machine: `python -m pytest -m gpu`)")
    built = {}

    def get(hidden: int, case: str, strategy: str) -> FusionBridge:
        if (hidden, case, strategy) not in built:
            spec = EpilogueSpec(
                hidden_size=hidden, top_k=8, routed_scaling_factor=2.5, quant=_quant(case)
            )
            built[(hidden, case, strategy)] = FusionBridge(spec, strategy=strategy, debug=False)
        return built[(hidden, case, strategy)]

    yield get
    for bridge in built.values():
        bridge.close()


def _call(bridge: FusionBridge, tokens: int, seed: int):
    inp = make_inputs(bridge.spec, tokens, seed=seed, device="cuda")
    out = bridge.finalize_epilogue(
        inp.gemm2_out,
        inp.expanded_idx_to_permuted_idx,
        inp.expert_weights,
        inp.shared_output,
        inp.residual,
        inp.gamma,
    )
    torch.cuda.synchronize()
    return out


def _weight(hidden: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(N, hidden, device="cuda", generator=g) / hidden**0.5).to(torch.bfloat16)


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_weight_blocks(w: torch.Tensor):
    """w [N, K] bf16 -> (codes [N, K] e4m3, scales fp32 [N/128, K/128], dequantized fp32 [N, K]):
    one scale amax / 448 per 128x128 block, as block-quantized FP8 checkpoints store them."""
    n, k = w.shape
    blocks = w.float().view(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-10) / FP8_E4M3_MAX
    codes = _e4m3(blocks / scale[:, None, :, None])
    dequant = codes.float() * scale[:, None, :, None]
    return codes.view(n, k), scale, dequant.view(n, k)


def quantize_weight_rows(w: torch.Tensor):
    """w [N, K] bf16 -> (codes [N, K] e4m3, scales fp32 [N]): one scale per output channel."""
    scale = w.float().abs().amax(dim=1).clamp(min=1e-10) / FP8_E4M3_MAX
    return _e4m3(w.float() / scale[:, None]), scale


def _padded_codes(q: torch.Tensor, rows: int) -> torch.Tensor:
    """q [T, H] e4m3 with zero code rows appended up to `rows`."""
    out = torch.zeros(rows, q.shape[1], dtype=torch.uint8, device=q.device)
    out[: q.shape[0]] = q.view(torch.uint8)
    return out.view(torch.float8_e4m3fn)


def _blockwise_gemm(q, scale_a, w_codes, w_scale):
    import torch.nn.functional as F

    kb = w_scale.shape[1]
    padded = torch.zeros(w_scale.shape[0], _round_up(kb, 4), device=w_scale.device)
    padded[:, :kb] = w_scale  # torch's recipe takes round_up(K/128, 4) weight scale columns
    return F.scaled_mm(
        q,
        w_codes.t(),
        scale_a,
        F.ScalingType.BlockWise1x128,
        padded.t(),
        F.ScalingType.BlockWise128x128,
        output_dtype=torch.bfloat16,
    )


def _gemm_group(case, q, scales, w):
    """C [T, N] of the bridge's per-token-group output and w, by `case`'s consumer."""
    tokens, hidden = q.shape
    w_codes, w_scale, w_dequant = quantize_weight_blocks(w)
    if case == "row_major":  # no GEMM reads these: dequantize, then an fp32 matmul
        return dequantize_fp8_dynamic(q, scales, BLOCK) @ w_dequant.t()
    rows = _round_up(tokens, 4)
    groups = hidden // BLOCK
    if rows == tokens:
        assert scales.stride() == (1, tokens) or groups == 1
        return _blockwise_gemm(q, scales, w_codes, w_scale)
    if case == "column_major_tma":  # the layout's storage, padding rows included
        full = torch.as_strided(scales, (rows, groups), (1, rows), scales.storage_offset())
        assert (full[tokens:] == 0).all(), "the TMA layout's padding rows are not 0"
    else:  # column_major: a copy into a padded column-major buffer
        full = torch.zeros(groups, rows, device=q.device).t()
        full[:tokens] = scales
    return _blockwise_gemm(_padded_codes(q, rows), full, w_codes, w_scale)[:tokens]


def _gemm_token(q, scales, w):
    tokens = q.shape[0]
    w_codes, w_scale = quantize_weight_rows(w)

    def run(a, sa):
        return torch._scaled_mm(a, w_codes.t(), sa, w_scale.view(1, -1), out_dtype=torch.bfloat16)

    if tokens % 4 == 0:
        return run(q, scales)
    try:
        return run(q, scales)
    except RuntimeError:  # a GEMM that wants M a multiple of 4: zero code rows appended
        rows = _round_up(tokens, 4)
        sa = torch.ones(rows, 1, device=q.device)
        sa[:tokens] = scales
        return run(_padded_codes(q, rows), sa)[:tokens]


def _needs(case: str) -> None:
    import torch.nn.functional as F

    if case == "token" and not hasattr(torch, "_scaled_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch._scaled_mm")
    if case in ("column_major", "column_major_tma"):
        if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
            pytest.skip(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm")
        major, minor = torch.cuda.get_device_capability()
        if major != 9:
            pytest.skip(
                f"torch runs the 1x128 x 128x128 recipe on SM90 only; this is sm_{major}{minor}"
            )


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("hidden", [7168, 2048])
def test_the_next_gemm_reads_the_dynamic_fp8_output(bridges, hidden, case, strategy):
    from fusion_bridge.kernels.fp8_group_quant import fp8_group_quant, fp8_per_token_quant

    _needs(case)
    bridge = bridges(hidden, case, strategy)
    for tokens in TOKENS:
        out = _call(bridge, tokens, seed=tokens)
        route = bridge.route_for(tokens, eager=True)
        q, scales = out.quant, out.scale
        assert q.dtype == torch.float8_e4m3fn and q.shape == (tokens, hidden)
        # our standalone kernel on the bridge's own norm_out: the same bits
        if case == "token":
            mine_q, mine_s = fp8_per_token_quant(out.norm_out)
        else:
            mine_q, mine_s = fp8_group_quant(out.norm_out, BLOCK, case)
        where = f"H={hidden} {case} T={tokens} route {route}"
        assert scales.shape == mine_s.shape and scales.stride() == mine_s.stride(), where
        assert torch.equal(q.view(torch.uint8), mine_q.view(torch.uint8)), where
        assert torch.equal(scales.view(torch.int32), mine_s.view(torch.int32)), where
        w = _weight(hidden, seed=hidden + tokens)
        c = _gemm_token(q, scales, w) if case == "token" else _gemm_group(case, q, scales, w)
        a = out.norm_out.float()
        c_ref = a @ w.float().t()
        bound = BOUND * (a.abs() @ w.float().abs().t())
        err = (c.float() - c_ref).abs()
        assert torch.isfinite(c).all(), f"{where}: non-finite GEMM output"
        assert (err <= bound).all(), (
            f"{where}: {(err > bound).sum().item()} elements past the bound, "
            f"worst err / bound {(err / bound).max().item():.3f}"
        )
