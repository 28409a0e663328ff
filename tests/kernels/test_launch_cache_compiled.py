"""GPU: the launch cache (kernels/launch_cache.py) gives bitwise the same outputs as Triton's normal
launch
for our three kernels, over token counts that do and do not share a specialization key (1, 3, 16,
64,
1000) and every quant mode; a misaligned view (one element in) falls back to the normal launch, and
is
then cached under its own key; the cached launch honours the current stream and captures in a CUDA
graph. "Went through the cache" is observed by counting calls of the kernel's JITFunction.run."""

from __future__ import annotations

import pytest
import torch

from fusion_bridge.epilogue_tensors import quant_buffers
from fusion_bridge.kernels import add_rmsnorm, finalize_add, launch_cache as launcher, quant
from fusion_bridge.kernels.records import RowOutputs, RowSource
from fusion_bridge.kernels.triton_launchers import LAUNCH_LAYOUTS
from fusion_bridge.spec import QuantKind, SFLayout

pytestmark = pytest.mark.gpu

H, K = 7168, 8
TOKENS = (1, 3, 16, 64, 1000)
KIND = {
    quant.QUANT_NONE: QuantKind.NONE,
    quant.QUANT_FP8: QuantKind.FP8,
    quant.QUANT_NVFP4: QuantKind.NVFP4,
}
QUANT_MODES = [
    (quant.QUANT_NONE, False),
    (quant.QUANT_FP8, False),
    (quant.QUANT_NVFP4, True),
    (quant.QUANT_NVFP4, False),
]


@pytest.fixture
def normal_runs(monkeypatch):
    """Counts JITFunction.run calls (the normal launch) per kernel."""
    counts = {}

    def count(kernel):
        original = kernel.run
        counts[id(kernel)] = 0

        def run(*args, **kwargs):
            counts[id(kernel)] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", run)

    return counts, count


def assert_fast_path_active(module):
    """Every Triton version pyproject allows is ported (kernels/triton_launchers.py)."""
    assert launcher.triton_version() in LAUNCH_LAYOUTS, launcher.triton_version()
    assert module._LAUNCH.disabled_reason is None, module._LAUNCH.disabled_reason


def misaligned(shape, dtype, fill):
    """A [*shape] view one element into its storage: not 16-byte aligned."""
    n = 1
    for s in shape:
        n *= s
    base = torch.empty(n + 1, dtype=dtype, device="cuda")
    view = base[1:].view(*shape)
    view.copy_(fill)
    assert view.data_ptr() % 16 != 0
    return view


def finalize_normal(out, g, perm, w, shared, scale):
    tokens = perm.shape[0]
    blocks, cx, warps = finalize_add._launch_shape(
        H, K, shared is not None, tokens <= 32, None, None
    )
    finalize_add._finalize_add_kernel[(tokens, blocks)](
        RowSource(g, perm, w, out if shared is None else shared, None, None),
        out,
        H,
        float(scale),
        **dict(zip(finalize_add._LAUNCH.constexpr_names, cx)),
        num_warps=warps,
    )
    return out


def finalize_inputs(tokens, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    P = tokens * K + 5
    g = torch.randn(P, H, dtype=torch.bfloat16, device="cuda", generator=gen)
    perm = (
        torch.randperm(P, device="cuda", generator=gen)[: tokens * K]
        .view(tokens, K)
        .to(torch.int32)
    )
    perm[0, -1] = -1  # a skipped slot
    w = torch.rand(tokens, K, device="cuda", generator=gen)
    shared = torch.randn(tokens, H, dtype=torch.bfloat16, device="cuda", generator=gen)
    return g, perm, w, shared


@pytest.mark.parametrize("with_shared", [True, False])
def test_finalize_add_cached_equals_normal(normal_runs, with_shared):
    counts, count = normal_runs
    kernel = finalize_add._finalize_add_kernel
    count(kernel)
    for tokens in TOKENS:
        g, perm, w, shared = finalize_inputs(tokens, tokens)
        shared = shared if with_shared else None
        expected = finalize_normal(
            torch.empty(tokens, H, dtype=torch.bfloat16, device="cuda"), g, perm, w, shared, 2.5
        )
        finalize_add.finalize_add_into(
            torch.empty_like(expected), g, perm, w, shared, 2.5
        )  # may be a miss
        before = counts[id(kernel)]
        out = torch.full_like(expected, float("nan"))
        finalize_add.finalize_add_into(out, g, perm, w, shared, 2.5)
        assert counts[id(kernel)] == before, f"T={tokens}: the second call did not use the cache"
        assert torch.equal(out, expected), f"T={tokens}"
    assert_fast_path_active(finalize_add)


def test_finalize_add_misaligned_view_falls_back_then_caches(normal_runs):
    counts, count = normal_runs
    kernel = finalize_add._finalize_add_kernel
    count(kernel)
    tokens = 16
    g, perm, w, shared = finalize_inputs(tokens, 7)
    expected = finalize_normal(
        torch.empty(tokens, H, dtype=torch.bfloat16, device="cuda"), g, perm, w, shared, 1.0
    )
    finalize_add.finalize_add_into(torch.empty_like(expected), g, perm, w, shared, 1.0)
    g_off = misaligned(g.shape, g.dtype, g)
    out_off = misaligned(expected.shape, expected.dtype, torch.zeros_like(expected))
    before = counts[id(kernel)]
    finalize_add.finalize_add_into(out_off, g_off, perm, w, shared, 1.0)
    assert counts[id(kernel)] == before + 1, "a misaligned pointer must take the normal launch"
    assert torch.equal(out_off, expected)
    out = torch.empty_like(expected)
    finalize_add.finalize_add_into(out, g, perm, w, shared, 1.0)  # aligned again: cached
    out_off.zero_()
    finalize_add.finalize_add_into(
        out_off, g_off, perm, w, shared, 1.0
    )  # misaligned: now cached too
    assert counts[id(kernel)] == before + 1
    assert torch.equal(out, expected) and torch.equal(out_off, expected)
    assert_fast_path_active(finalize_add)


def test_finalize_add_cached_launch_on_a_side_stream_and_in_a_cuda_graph():
    tokens = 3
    g, perm, w, shared = finalize_inputs(tokens, 11)
    expected = finalize_normal(
        torch.empty(tokens, H, dtype=torch.bfloat16, device="cuda"), g, perm, w, shared, 1.0
    )
    out = torch.empty_like(expected)
    finalize_add.finalize_add_into(out, g, perm, w, shared, 1.0)  # warm: cached from here
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    out.zero_()
    with torch.cuda.stream(side):
        for _ in range(3):
            finalize_add.finalize_add_into(out, g, perm, w, shared, 1.0)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        finalize_add.finalize_add_into(out, g, perm, w, shared, 1.0)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def row_inputs(tokens, seed, quant_mode, swizzled):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    residual, reduced = torch.randn(
        2, tokens, H, dtype=torch.bfloat16, device="cuda", generator=gen
    )
    gamma = torch.randn(H, dtype=torch.bfloat16, device="cuda", generator=gen)
    return residual, reduced, gamma


def buffers(tokens, quant_mode, swizzled):
    layout = SFLayout.SWIZZLED_128x4 if swizzled else SFLayout.LINEAR
    q, sf = quant_buffers(tokens, H, KIND[quant_mode], layout, torch.device("cuda"))
    q = torch.empty(0, dtype=torch.uint8, device="cuda") if q is None else q.view(torch.uint8)
    sf = torch.empty(0, dtype=torch.uint8, device="cuda") if sf is None else sf
    return q.fill_(0xAA), sf.fill_(0xAA)


def scale_for(quant_mode):
    return 0.05 if quant_mode == quant.QUANT_FP8 else 40.0


def norm_normal(residual, reduced, gamma, quant_mode, swizzled):
    tokens = residual.shape[0]
    r_out, n_out = torch.empty_like(residual), torch.empty_like(residual)
    q, sf = buffers(tokens, quant_mode, swizzled)
    cx, warps = quant.row_launch_shape(H, quant_mode, swizzled, True)
    sf_cols = sf.shape[1] if quant_mode == quant.QUANT_NVFP4 else 0
    named = dict(zip(add_rmsnorm._LAUNCH.constexpr_names, cx))
    add_rmsnorm._add_rmsnorm_kernel[(quant.launch_rows(quant_mode, swizzled, tokens, sf),)](
        residual,
        reduced,
        gamma,
        RowOutputs(r_out, n_out, q, sf),
        tokens,
        H,
        1e-6,
        0.5,
        scale_for(quant_mode),
        sf_cols,
        **named,
        num_warps=warps,
    )
    return r_out, n_out, q, sf


def norm_cached(residual, reduced, gamma, quant_mode, swizzled):
    tokens = residual.shape[0]
    r_out, n_out = torch.zeros_like(residual), torch.zeros_like(residual)
    q, sf = buffers(tokens, quant_mode, swizzled)
    add_rmsnorm.add_rmsnorm_into(
        r_out,
        n_out,
        q,
        sf,
        residual,
        reduced,
        gamma,
        eps=1e-6,
        weight_bias=0.5,
        quant=quant_mode,
        quant_scale=scale_for(quant_mode),
        swizzled=swizzled,
    )
    return r_out, n_out, q, sf


def quant_normal(x, quant_mode, swizzled):
    tokens = x.shape[0]
    q, sf = buffers(tokens, quant_mode, swizzled)
    cx, warps = quant.row_launch_shape(H, quant_mode, swizzled, True)
    sf_cols = sf.shape[1] if quant_mode == quant.QUANT_NVFP4 else 0
    quant._quantize_kernel[(quant.launch_rows(quant_mode, swizzled, tokens, sf),)](
        x,
        RowOutputs(None, None, q, sf),
        tokens,
        H,
        scale_for(quant_mode),
        sf_cols,
        **dict(zip(quant._LAUNCH.constexpr_names, cx)),
        num_warps=warps,
    )
    return q, sf


def quant_cached(x, quant_mode, swizzled):
    q, sf = buffers(x.shape[0], quant_mode, swizzled)
    quant.quantize_into(q, sf, x, quant_mode, scale_for(quant_mode), swizzled)
    return q, sf


def assert_same(got, expected, what):
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.shape == b.shape and torch.equal(a, b), f"{what}: output {i} differs"


@pytest.mark.parametrize("quant_mode,swizzled", QUANT_MODES)
def test_add_rmsnorm_and_quantize_cached_equal_normal(normal_runs, quant_mode, swizzled):
    counts, count = normal_runs
    count(add_rmsnorm._add_rmsnorm_kernel)
    count(quant._quantize_kernel)
    for tokens in TOKENS:
        residual, reduced, gamma = row_inputs(tokens, tokens, quant_mode, swizzled)
        expected = norm_normal(residual, reduced, gamma, quant_mode, swizzled)
        norm_cached(residual, reduced, gamma, quant_mode, swizzled)  # may be a miss
        before = counts[id(add_rmsnorm._add_rmsnorm_kernel)]
        got = norm_cached(residual, reduced, gamma, quant_mode, swizzled)
        assert counts[id(add_rmsnorm._add_rmsnorm_kernel)] == before, (
            f"T={tokens}: add_rmsnorm not cached"
        )
        assert_same(got, expected, f"add_rmsnorm T={tokens} quant={quant_mode} swizzled={swizzled}")
        if quant_mode == quant.QUANT_NONE:
            continue
        x = expected[1]
        q_expected = quant_normal(x, quant_mode, swizzled)
        quant_cached(x, quant_mode, swizzled)
        before = counts[id(quant._quantize_kernel)]
        q_got = quant_cached(x, quant_mode, swizzled)
        assert counts[id(quant._quantize_kernel)] == before, f"T={tokens}: quantize not cached"
        assert_same(
            q_got, q_expected, f"quantize T={tokens} quant={quant_mode} swizzled={swizzled}"
        )
    assert_fast_path_active(add_rmsnorm)
    if quant_mode != quant.QUANT_NONE:
        assert_fast_path_active(quant)


@pytest.mark.parametrize(
    "quant_mode,swizzled", [(quant.QUANT_FP8, False), (quant.QUANT_NVFP4, True)]
)
def test_row_kernels_misaligned_view_falls_back(normal_runs, quant_mode, swizzled):
    counts, count = normal_runs
    norm_k, quant_k = add_rmsnorm._add_rmsnorm_kernel, quant._quantize_kernel
    count(norm_k)
    count(quant_k)
    tokens = 64
    residual, reduced, gamma = row_inputs(tokens, 3, quant_mode, swizzled)
    expected = norm_normal(residual, reduced, gamma, quant_mode, swizzled)
    norm_cached(residual, reduced, gamma, quant_mode, swizzled)
    residual_off = misaligned(residual.shape, residual.dtype, residual)
    before = counts[id(norm_k)]
    got = norm_cached(residual_off, reduced, gamma, quant_mode, swizzled)
    assert counts[id(norm_k)] == before + 1, "a misaligned residual must take the normal launch"
    assert_same(got, expected, "add_rmsnorm misaligned")
    assert_same(
        norm_cached(residual, reduced, gamma, quant_mode, swizzled),
        expected,
        "add_rmsnorm aligned again",
    )
    assert counts[id(norm_k)] == before + 1
    x = expected[1]
    q_expected = quant_normal(x, quant_mode, swizzled)
    quant_cached(x, quant_mode, swizzled)
    before = counts[id(quant_k)]
    assert_same(
        quant_cached(misaligned(x.shape, x.dtype, x), quant_mode, swizzled),
        q_expected,
        "quantize misaligned",
    )
    assert counts[id(quant_k)] == before + 1
