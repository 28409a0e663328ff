"""`fused_tp1` (world size 1, one launch: the one-shot kernel with the exchange left out) on CPU,
under TRITON_INTERPRET=1 (GPU: tests/kernels/test_tp1_shapes_and_graphs.py): against the float64
oracle, bit for
bit against the two-launch path's residual_out and against the quantizers applied to its own
norm_out, awkward shapes included; its capability checks and declarations."""

import math

import pytest
import torch

from fusion_bridge.environment import Environment
import triton

from fusion_bridge.epilogue_tensors import EpilogueOutputs, allocate_outputs
from fusion_bridge.kernels.add_rmsnorm import add_rmsnorm_into
from fusion_bridge.kernels.finalize_add import finalize_add_into
from fusion_bridge.kernels.tp1.configs import Tp1Config
from fusion_bridge.oracle.numerics import rel_err
from fusion_bridge.spec import EpilogueSpec, QuantKind, QuantSpec, SFLayout, Stage
from fusion_bridge.strategies.base import UNIT_ROUNDOFF
from fusion_bridge.strategies.fused_tp1 import FusedTp1Strategy
from fusion_bridge.oracle.synthetic import make_inputs

from tests.helpers import garbage_weights_where_skipped
from tests.oracle64 import epilogue64_from, quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ENV = Environment(device_type="cpu", world_size=1, triton_interpret=True, triton_version="3.6.0")
QUANTS = [
    QuantSpec.none(),
    QuantSpec.fp8(0.02),
    QuantSpec.nvfp4(448 * 6 / 8.0, SFLayout.SWIZZLED_128x4),
    QuantSpec.nvfp4(448 * 6 / 8.0, SFLayout.LINEAR),
]


def two_launch(spec, inp):
    """The two-launch path's residual_out: our finalize kernel, then our add+RMSNorm kernel."""
    tokens, hidden = inp.residual.shape
    partial = torch.full_like(inp.residual, float("nan"))  # poisoned: an unwritten element shows
    finalize_add_into(
        partial,
        inp.gemm2_out,
        inp.expanded_idx_to_permuted_idx,
        inp.expert_weights,
        inp.shared_output,
        spec.routed_scaling_factor,
    )
    residual_out, norm_out = (
        torch.full_like(partial, float("nan")),
        torch.full_like(partial, float("nan")),
    )
    none = torch.empty(0, dtype=torch.uint8, device=partial.device)
    add_rmsnorm_into(
        residual_out,
        norm_out,
        none,
        none,
        inp.residual,
        partial,
        inp.gamma,
        eps=spec.eps,
        weight_bias=spec.weight_bias,
        quant=0,
        quant_scale=1.0,
        swizzled=False,
    )
    return residual_out


def _oracle_cases():
    """Every quantization at every shape, except that T=129 (a second 128-row tile of swizzled
    NVFP4 scales, its padding written by programs past T) runs at T=7 under the interpreter unless
    the scales are swizzled NVFP4. For the others a whole-row launch at T=129 is T=7's with more
    programs (one per row, the same constexprs: whole_rows(spec) depends on H alone), about 7 s of
    interpreted programs for the three. residual_out against the two-launch path at T=129 (it does
    not depend on the quantization) is checked in the swizzled case. A GPU runs T=129 for all."""
    shapes = ((1, 96, 8), (3, 160, 1), (5, 2880, 8), (2, 320, 4), (129, 64, 2))
    for quant in QUANTS:
        swizzled = quant.kind is QuantKind.NVFP4 and quant.sf_layout is SFLayout.SWIZZLED_128x4
        for tokens, hidden, top_k in shapes:
            if tokens > 128 and DEVICE == "cpu" and not swizzled:
                tokens = 7
            name = f"{quant.kind.value}-{quant.sf_layout.value}-{tokens}-{hidden}-{top_k}"
            yield pytest.param(tokens, hidden, top_k, quant, id=name)


@pytest.mark.parametrize("tokens,hidden,top_k,quant", list(_oracle_cases()))
def test_matches_the_oracle_and_the_two_launch_path(tokens, hidden, top_k, quant):
    spec = EpilogueSpec(
        hidden_size=hidden,
        top_k=top_k,
        routed_scaling_factor=2.5,
        weight_bias=0.5,
        has_shared_output=(top_k != 4),
        quant=quant,
    )
    strat = FusedTp1Strategy(spec, ENV, device=torch.device(DEVICE))
    strat.prepare()
    # skipped slots carry NaN / inf weights (allowed garbage): they must not reach the sum
    inp = garbage_weights_where_skipped(
        make_inputs(spec, tokens, seed=tokens + hidden, device=DEVICE, skip_fraction=0.3)
    )
    before = [t.clone() for t in inp if t is not None]
    out = _launch_with(strat, inp, whole_rows(spec))
    after = [t for t in inp if t is not None]  # the caller's tensors untouched (bits: NaN weights)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after))
    x64, norm64 = epilogue64_from(spec, [inp])
    u = UNIT_ROUNDOFF[spec.dtype]
    # the partial's rounding, the output's and the oracle's, independent: in quadrature
    bound = FusedTp1Strategy.error_bound(spec, ENV)
    assert bound == pytest.approx(math.sqrt(3) * u)
    for got, ref in ((out.residual_out, x64), (out.norm_out, norm64)):
        assert torch.isfinite(got).all()
        assert rel_err(got, ref) <= bound
    # the partial is rounded as the two-launch path stores it: residual_out is that path's
    assert torch.equal(out.residual_out, two_launch(spec, inp))
    # quantization reads the kernel's own rounded norm_out: bit-exact, scale padding included
    if quant.kind is QuantKind.FP8:
        ref = quantize(out.norm_out, "fp8", quant.scale)[0]
        assert torch.equal(out.quant.view(torch.uint8), ref.view(torch.uint8))
        assert out.scale is None
    elif quant.kind is QuantKind.NVFP4:
        swizzled = quant.sf_layout is SFLayout.SWIZZLED_128x4
        ref_q, ref_sf = quantize(out.norm_out, "nvfp4", quant.global_scale, swizzled)
        assert torch.equal(out.quant, ref_q.view(torch.uint8))
        assert torch.equal(out.scale, ref_sf.view(torch.uint8))
    else:
        assert out.quant is None and out.scale is None


def test_a_row_whose_sum_of_squares_overflows_fp32_is_normalized():
    """|x| ~ 1e25: the fp32 sum of squares overflows; the norm is scaled (as the two-launch path's
    kernel does), not zeroed."""
    spec = EpilogueSpec(hidden_size=96, top_k=2, has_shared_output=False)
    strat = FusedTp1Strategy(spec, ENV, device=torch.device(DEVICE))
    strat.prepare()
    inp = make_inputs(spec, 2, seed=4, device=DEVICE, skip_fraction=0.0)
    inp.residual[0].mul_(1e25)
    out = _launch_with(strat, inp, whole_rows(spec))
    x64, norm64 = epilogue64_from(spec, [inp])
    assert torch.isfinite(out.norm_out).all()
    assert rel_err(out.norm_out, norm64) <= FusedTp1Strategy.error_bound(spec, ENV)


def test_zero_tokens_launch_nothing():
    from fusion_bridge.kernels.layer import LayerRecord
    from fusion_bridge.kernels.records import RowOutputs, RowSource
    from fusion_bridge.kernels.tp1.launcher import Tp1Launcher

    spec = EpilogueSpec(hidden_size=64, top_k=2)
    inp = make_inputs(spec, 0, device=DEVICE)
    none = torch.empty(0, dtype=torch.uint8, device=DEVICE)
    out = torch.empty(0, 64, dtype=spec.dtype, device=DEVICE)
    launcher = Tp1Launcher(LayerRecord.of(spec), 0, torch.device(DEVICE))
    launcher(RowSource.of(inp), RowOutputs(out, out, none, none))
    assert not launcher._plans  # nothing planned, nothing launched


def test_capability_and_declarations():
    spec = EpilogueSpec(hidden_size=7168, top_k=8, quant=QuantSpec.fp8(0.1))
    gpu = Environment(device_type="cuda", sm=90, world_size=1, triton_version="3.6.0")
    assert FusedTp1Strategy.not_supported_reasons(spec, gpu) == []
    codes = {
        r.code for r in FusedTp1Strategy.not_supported_reasons(spec, gpu.replace(world_size=2))
    }
    assert codes == {"world_size_unsupported"}
    for hidden, codes in (
        (16384, set()),
        (16400, {"hidden_too_large"}),
        (20000, {"hidden_too_large"}),
    ):
        # 16384 (the largest row block held in registers) is accepted, the next multiple of 16 not
        wide = EpilogueSpec(hidden_size=hidden, top_k=8)
        got = {r.code for r in FusedTp1Strategy.not_supported_reasons(wide, gpu)}
        assert got == codes, (hidden, got)
    (step,) = FusedTp1Strategy.steps(spec, gpu)
    assert step.stages == (Stage.FINALIZE, Stage.SHARED_ADD, Stage.RESIDUAL_NORM, Stage.QUANT)
    assert FusedTp1Strategy.is_auto_selectable(spec, gpu)
    assert not FusedTp1Strategy.is_auto_selectable(spec, ENV)


def test_eps_is_applied_and_an_all_zero_row_stays_zero():
    """Rows of rms ~0.01-0.03, where eps = 1e-2 shrinks norm_out about 3x, and an all-zero row (0
    with eps, NaN without), NaN / inf weights in skipped slots. Mutants killed: the world-size-1
    launch passing another eps than the spec's; a skipped slot's weight multiplied in."""
    import dataclasses

    from tests.helpers import small_rows_and_a_zero_row

    spec = EpilogueSpec(hidden_size=96, top_k=4, eps=1e-2, weight_bias=0.5)
    inp = small_rows_and_a_zero_row(spec, 1, 5, seed=24, device=DEVICE)[0]
    _, norm = epilogue64_from(spec, [inp])
    _, without_eps = epilogue64_from(dataclasses.replace(spec, eps=1e-9), [inp])
    rows = [0, 2, 3, 4]
    assert rel_err(without_eps[rows], norm[rows]) > 0.5  # the case observes eps
    strat = FusedTp1Strategy(spec, ENV, device=torch.device(DEVICE))
    strat.prepare()
    out = _launch_with(strat, inp, whole_rows(spec))
    assert (out.residual_out[1] == 0).all() and (out.norm_out[1] == 0).all()
    assert rel_err(out.norm_out, norm) <= FusedTp1Strategy.error_bound(spec, ENV)


def whole_rows(spec) -> Tp1Config:
    """The whole-row launch config of `spec` (one program per row, its production warps), named
    explicitly."""
    from fusion_bridge.kernels.quant import row_block
    from fusion_bridge.kernels.tp1.configs import whole_row_warps

    return Tp1Config(row_block(spec.hidden_size), whole_row_warps(1, spec.hidden_size))


def call_records(inp, out: EpilogueOutputs, unused: torch.Tensor) -> tuple:
    """The launcher's records (RowSource, RowOutputs) of a call into `out`."""
    from fusion_bridge.kernels.records import RowOutputs, RowSource

    return RowSource.of(inp), RowOutputs.of(out, unused)


def poisoned_outputs(spec, tokens, device=DEVICE) -> EpilogueOutputs:
    """Every output of one call, poisoned: NaN activations, 0xFF code and scale bytes (-NaN in
    e4m3, never a code of a finite row), padding included. An element a kernel leaves unwritten
    shows up."""
    out = allocate_outputs(spec, tokens, torch.device(device))
    for t in (out.residual_out, out.norm_out, out.quant, out.scale):
        if t is not None:
            t.view(torch.uint8).fill_(0xFF)
    return out


def _launch_with(strat, inp, config):
    """One call through the strategy's launcher with the launch config `config` forced (None: the
    launcher's own config for T, `Tp1Launcher.config_for`), into poisoned outputs. Checks that
    the kernel the launcher's plan names ran, whatever an earlier call of this launcher cached: a
    split launch advances its chunk count's arrival counter of every row by one call's worth, a
    whole-row launch touches none. The plan is the launcher's (`Tp1Launcher.plan`), the one source
    of the config rule: the test does not restate it."""
    from fusion_bridge.kernels.tp1.configs import MAX_CHUNKS

    tokens, hidden = inp.residual.shape
    out = poisoned_outputs(strat.spec, tokens, inp.residual.device)
    src, row_out = call_records(inp, out, strat._unused)
    launcher = strat._launcher
    plan, _ = launcher.call_args(src, row_out, config)
    assert plan.config == (config or launcher.config_for(tokens)), plan
    words = launcher.sync_words()
    before = words.clone()
    launcher(src, row_out, config)
    counters = (words - before)[: tokens * (MAX_CHUNKS + 1)].view(-1, MAX_CHUNKS + 1)
    expected = torch.zeros_like(counters)
    if plan.chunks:
        assert plan.chunks == triton.cdiv(hidden, plan.config.columns), plan
        expected[:, plan.chunks] = 2 * MAX_CHUNKS
    assert torch.equal(counters, expected), (
        f"{plan.config} did not run as planned: {counters.tolist()}"
    )
    return out


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: f"{q.kind.value}-{q.sf_layout.value}")
def test_split_rows_under_the_interpreter(quant):
    """Rows split over programs that exchange their sums of squares (the small-T kernel), both
    phases run one after the other: residual_out bit for bit the whole rows' (and so the two-launch
    path's), norm_out against the float64 oracle, quant codes and scales (padding included) those
    of its own norm_out. Calls alternate chunk counts and T, so each count's arrival counter and
    tags must stay in step while the others run; H=160 ends in a partial chunk.

    The whole rows' residual_out comes from the same spec without quantization: the whole-row
    kernel stores residual_out before its norm and quantization read it (kernels/tp1/whole_rows.py),
    and launches one program per row, where a swizzled NVFP4 launch is 128 (the scale padding
    rows': three quarters of this test's interpreted time). The whole rows with each quantization,
    their padding included, are test_matches_the_oracle_and_the_two_launch_path's."""
    from fusion_bridge.kernels.tp1.configs import Tp1Config, split_ok

    problems = []
    for hidden, chunks_of in ((320, (64, 128)), (160, (64,))):
        spec = EpilogueSpec(
            hidden_size=hidden, top_k=3, routed_scaling_factor=2.5, weight_bias=0.5, quant=quant
        )
        strat = FusedTp1Strategy(spec, ENV, device=torch.device(DEVICE))
        strat.prepare()
        strat._launcher.num_sms = 16
        plain_spec = EpilogueSpec(**{**spec.__dict__, "quant": QuantSpec.none()})
        plain = FusedTp1Strategy(plain_spec, ENV, device=torch.device(DEVICE))
        plain.prepare()
        for rep in range(2):
            for tokens in (1, 3):
                inp = make_inputs(spec, tokens, seed=rep * 10 + tokens, device=DEVICE)
                whole = _launch_with(plain, inp, whole_rows(plain_spec))
                x64, norm64 = epilogue64_from(spec, [inp])
                for chunk in chunks_of:
                    config = Tp1Config(chunk, 2)
                    assert split_ok(config, tokens, hidden, 16)
                    got = _launch_with(strat, inp, config)
                    tag = f"H={hidden} T={tokens} chunk={chunk} rep={rep}"
                    if not torch.equal(got.residual_out, whole.residual_out):
                        problems.append(f"{tag}: residual_out")
                    bound = FusedTp1Strategy.error_bound(spec, ENV)
                    if not rel_err(got.norm_out, norm64) <= bound:
                        problems.append(f"{tag}: norm_out err {rel_err(got.norm_out, norm64)}")
                    if quant.kind is QuantKind.FP8:
                        ref = quantize(got.norm_out, "fp8", quant.scale)[0]
                        if not torch.equal(got.quant.view(torch.uint8), ref.view(torch.uint8)):
                            problems.append(f"{tag}: fp8 codes")
                    if quant.kind is QuantKind.NVFP4:
                        swz = quant.sf_layout is SFLayout.SWIZZLED_128x4
                        ref_q, ref_sf = quantize(got.norm_out, "nvfp4", quant.global_scale, swz)
                        if not torch.equal(got.quant, ref_q.view(torch.uint8)):
                            problems.append(f"{tag}: nvfp4 codes")
                        if not torch.equal(got.scale, ref_sf.view(torch.uint8)):
                            problems.append(f"{tag}: nvfp4 scales")
    assert not problems, problems


def test_split_rows_overflowing_the_sum_of_squares_are_normalized():
    """|x| ~ 1e25 in one chunk of a row: its chunks' fp32 sum overflows; every program of the row
    rescales from the row's largest magnitude (found by recomputing every chunk of the row), as
    whole rows do. Row 0 holds its huge values in its last chunk only (H=288: a partial chunk),
    row 1 in its first only, row 2 none: a rescue that skips a chunk at either end is off by
    orders of magnitude (3.9e24 relative where the last was skipped)."""
    spec = EpilogueSpec(hidden_size=288, top_k=2, has_shared_output=False)
    strat = FusedTp1Strategy(spec, ENV, device=torch.device(DEVICE))
    strat.prepare()
    strat._launcher.num_sms = 16
    inp = make_inputs(spec, 3, seed=4, device=DEVICE, skip_fraction=0.0)
    inp.residual[0, 256:].mul_(1e25)
    inp.residual[1, :64].mul_(1e25)
    got = _launch_with(strat, inp, Tp1Config(64, 2))
    _, norm64 = epilogue64_from(spec, [inp])
    assert torch.isfinite(got.norm_out).all()
    for row in range(3):  # per row: the rows differ by 25 orders of magnitude
        err = rel_err(got.norm_out[row : row + 1], norm64[row : row + 1])
        assert err <= FusedTp1Strategy.error_bound(spec, ENV), (row, err)


def test_a_split_row_whose_partner_never_arrives_is_nan_not_a_hang():
    """The wait phase alone, with no publish before it and a bound of 3 polls: the row's words
    carry an older tag, so the wait gives up and the row's norm_out is NaN."""
    from fusion_bridge.kernels.tp1 import launcher as L

    spec = EpilogueSpec(hidden_size=320, top_k=2)
    strat = FusedTp1Strategy(spec, ENV, device=torch.device(DEVICE))
    strat.prepare()
    strat._launcher.num_sms = 16
    config = Tp1Config(64, 2)
    inp = make_inputs(spec, 1, seed=5, device=DEVICE)
    out = _launch_with(strat, inp, config)  # one full call: tags of epoch 1
    assert torch.isfinite(out.norm_out).all()
    plan, args = strat._launcher.call_args(*call_records(inp, out, strat._unused), config)
    words = strat._launcher.sync_words()
    counter = words[0 * (L.MAX_CHUNKS + 1) + plan.chunks]
    assert counter.item() == 2 * L.MAX_CHUNKS  # what one call adds to its chunk count's counter
    words[0 * (L.MAX_CHUNKS + 1) + plan.chunks] += 2 * L.MAX_CHUNKS  # as after a publish
    fixed = plan.constexprs._replace(MAX_POLLS=3, PHASES=L.OUTPUT_PHASE)
    plan.kernel(plan.grid, args, fixed, plan.warps)
    assert torch.isnan(out.norm_out).all()


def test_a_split_row_whose_partner_never_arrives_is_reported_not_silent():
    """As the test above (the wait phase alone, no partner published, 3 polls): the row's norm_out
    is NaN. Then the caller must learn of it, as `symm_fused_oneshot` reports a failed wait (its
    next call raises a RuntimeError naming the strategy), not keep getting NaN it cannot see."""
    from fusion_bridge.kernels.tp1 import launcher as L

    spec = EpilogueSpec(hidden_size=320, top_k=2)
    strat = FusedTp1Strategy(spec, ENV, device=torch.device(DEVICE))
    strat.prepare()
    strat._launcher.num_sms = 16
    config = Tp1Config(64, 2)
    inp = make_inputs(spec, 1, seed=5, device=DEVICE)
    out = _launch_with(strat, inp, config)
    plan, args = strat._launcher.call_args(*call_records(inp, out, strat._unused), config)
    strat._launcher.sync_words()[plan.chunks] += 2 * L.MAX_CHUNKS  # as after a publish
    fixed = plan.constexprs._replace(MAX_POLLS=3, PHASES=L.OUTPUT_PHASE)
    plan.kernel(plan.grid, args, fixed, plan.warps)
    assert torch.isnan(out.norm_out).all()  # the failed wait happened
    with pytest.raises(RuntimeError, match="fused_tp1: an earlier call's split rows timed out"):
        strat.run(inp)
    assert torch.isfinite(strat.run(inp).norm_out).all()  # reported once; the next call runs


@pytest.mark.parametrize("hidden", [1344, 2880, 7744])
def test_swizzled_nvfp4_with_an_odd_count_of_scale_groups_takes_whole_rows(hidden):
    """H not a multiple of 128 (H/64 odd) with swizzled NVFP4 scales: whole rows at every T, where
    below the launch table's T every other output format, the linear scales and the next multiple
    of 128 keep the split."""
    from fusion_bridge.kernels.quant import QUANT_NONE, QUANT_NVFP4, row_block
    from fusion_bridge.kernels.tp1.configs import tp1_config

    sms = 132
    for tokens in (1, 16, 64):
        whole = tp1_config(tokens, hidden, QUANT_NVFP4, sms, swizzled=True)
        assert whole.columns == row_block(hidden), (tokens, whole)
        assert whole.prefetch == 0
        if tokens >= 64:  # the measured launch table decides from T=64 (test_tp1_launch_table)
            continue
        for quant, swizzled, h in (
            (QUANT_NVFP4, False, hidden),
            (QUANT_NONE, False, hidden),
            (QUANT_NVFP4, True, hidden + 64),
        ):
            split = tp1_config(tokens, h, quant, sms, swizzled=swizzled)
            assert split.columns < row_block(h), (tokens, h, quant, swizzled, split)


@pytest.mark.parametrize("tokens", [1, 8])
def test_the_launcher_plans_with_its_layer_s_scale_layout(tokens):
    """The config a call that names none gets is the launcher's (`config_for`, the one source the
    GPU parity grid reads): at H=2880 with swizzled NVFP4 scales on an H100's 132 SMs that is
    whole rows (issue 40's rule), where the same layer with linear scales splits its rows."""
    from fusion_bridge.kernels.layer import LayerRecord
    from fusion_bridge.kernels.quant import QUANT_NVFP4, row_block
    from fusion_bridge.kernels.tp1.configs import tp1_config
    from fusion_bridge.kernels.tp1.launcher import Tp1Launcher

    chunks = {}
    for layout in (SFLayout.SWIZZLED_128x4, SFLayout.LINEAR):
        spec = EpilogueSpec(hidden_size=2880, top_k=8, quant=QuantSpec.nvfp4(336.0, layout))
        launcher = Tp1Launcher(LayerRecord.of(spec), 132, torch.device("cpu"))
        swizzled = layout is SFLayout.SWIZZLED_128x4
        assert launcher.config_for(tokens) == tp1_config(tokens, 2880, QUANT_NVFP4, 132, swizzled)
        sf_dims = (128, 180) if swizzled else (tokens, 180)
        chunks[layout] = launcher.plan(tokens, 8, True, True, sf_dims).chunks
    assert launcher.config_for(tokens).columns < row_block(2880)  # linear: split rows
    assert chunks == {SFLayout.SWIZZLED_128x4: 0, SFLayout.LINEAR: 6 if tokens == 1 else 3}


def test_the_records_of_a_call_and_its_bound_launch_name_the_call_s_tensors():
    """The eager call's shortcuts hand the kernel the same arguments as the records built field by
    field: `call_records` builds `RowSource` from `EpilogueInputs` by position (mutant
    i50-row-source-by-position), the split rows' record holds this call's words (the current
    stream's set, not the CUDA graphs' one: mutant i50-split-sync-graph-words), and a plan's bound
    launch carries the plan's sizes and the layer's scalars after the records."""
    from fusion_bridge.kernels.records import RowSource
    from fusion_bridge.kernels.tp1.launcher import GRAPH_WORDS

    spec = EpilogueSpec(hidden_size=7168, top_k=8)
    strat = FusedTp1Strategy(spec, ENV, device=torch.device("cpu"))
    strat.prepare()
    inp = make_inputs(spec, 3)
    out, src, dst = strat.call_records(inp)
    assert src == RowSource.of(inp)
    by_name = {"gemm2_out": "gemm2_out", "perm": "expanded_idx_to_permuted_idx",
               "weights": "expert_weights", "shared": "shared_output", "residual": "residual",
               "gamma": "gamma"}  # fmt: skip
    assert set(by_name) == set(RowSource._fields)
    for field, name in by_name.items():
        assert getattr(src, field) is getattr(inp, name), (field, name)
    launcher = strat._launcher
    sync = launcher.split_sync()
    assert sync.words is launcher.sync_words() and sync.words is not launcher._sync[GRAPH_WORDS]
    assert launcher.split_sync() is sync  # built once per set of words
    for num_sms in (0, 132):  # whole rows (the interpreter's default), split rows (an H100's)
        launcher.num_sms = num_sms
        launcher._plans.clear()  # plans are kept per T: decide again with this SM count
        plan, args = launcher.call_args(src, dst)
        assert bool(plan.chunks) == bool(num_sms)
        lead = args[: 3 if plan.chunks else 2]
        assert (*lead, *plan.launch.fixed) == args and lead[-1] is (sync if plan.chunks else dst)
        assert plan.launch.constexprs == plan.constexprs and plan.launch.grid == plan.grid
        assert plan.launch.num_warps == plan.warps and plan.launch.launcher is plan.kernel
