"""Dynamic FP8 (per token group, per token) in our Triton kernels, under the interpreter on CPU:
the add+RMSNorm kernel (`local_fused_nccl`'s) and `fused_tp1`'s whole and split rows. Codes and
scales bit for bit those of the torch reference (quant_ref.quantize_fp8_per_token_group) applied
to the kernel's own norm_out, in every scale layout (the TMA layout's padding zeros included),
over special rows: all-zero groups, one huge value per group (the rest of its row bf16
subnormals), NaN rows, +-inf columns, K=1 and skipped (-1) slots. Every output is poisoned before
the kernel writes it (NaN activations, 0xFF code and scale bytes over the scales' whole storage).
Bit-exact: the kernels take the reference's IEEE fp32 operations in its order."""

from __future__ import annotations

import pytest
import torch

from fusion_bridge.environment import Environment
from fusion_bridge.epilogue_tensors import EpilogueInputs, EpilogueOutputs, allocate_outputs
from fusion_bridge.kernels.add_rmsnorm import add_rmsnorm_into
from fusion_bridge.kernels.quant_codes import quant_args
from fusion_bridge.kernels.records import RowOutputs, RowSource
from fusion_bridge.kernels.tp1 import configs as tp1_configs
from fusion_bridge.kernels.tp1.configs import MAX_CHUNKS, Tp1Config
from fusion_bridge.oracle import quant_ref
from fusion_bridge.oracle.numerics import rel_err
from fusion_bridge.oracle.synthetic import make_inputs
from fusion_bridge.spec import EpilogueSpec, QuantSpec, ScaleLayout
from fusion_bridge.strategies.fused_tp1 import FusedTp1Strategy

ENV = Environment(device_type="cpu", world_size=1, triton_interpret=True, triton_version="3.6.0")
HIDDEN = 192  # not a power of two: the row block (256) holds a quarter of padding
QUANTS = [
    QuantSpec.fp8_per_token_group(64, "row_major"),
    QuantSpec.fp8_per_token_group(32, "column_major"),
    QuantSpec.fp8_per_token_group(16, "column_major_tma"),
    QuantSpec.fp8_per_token_group(64, "column_major_tma"),
    QuantSpec.fp8_per_token(),
]


def _id(q: QuantSpec) -> str:
    return f"{q.kind.value}-{q.group_size}-{q.scale_layout.value if q.scale_layout else ''}"


def storage_of(scale: torch.Tensor, spec: EpilogueSpec) -> torch.Tensor:
    """The whole fp32 storage behind a scale view (the TMA padding columns included)."""
    layout = spec.quant.scale_layout or ScaleLayout.ROW_MAJOR
    if layout is ScaleLayout.ROW_MAJOR:
        return scale
    tokens, groups = scale.shape
    width = tokens if layout is ScaleLayout.COLUMN_MAJOR else -(-tokens // 4) * 4
    return torch.as_strided(scale, (groups, width), (width, 1))


def poisoned(spec: EpilogueSpec, tokens: int) -> EpilogueOutputs:
    out = allocate_outputs(spec, tokens, torch.device("cpu"))
    out.residual_out.fill_(float("nan"))
    out.norm_out.fill_(float("nan"))
    out.quant.view(torch.uint8).fill_(0xFF)
    storage_of(out.scale, spec).view(torch.int32).fill_(-1)  # 0xFFFFFFFF: a NaN no kernel writes
    return out


def special_inputs(spec: EpilogueSpec, tokens: int, seed: int, top_k: int):
    """Random inputs whose rows 1.. are special: row 1 an all-zero first group, row 2 one huge
    value per group (its other elements then normalise to bf16 subnormals), row 3 a NaN, row 4
    a zero row; K=1 or skipped slots from make_inputs."""
    inp = make_inputs(spec, tokens, seed=seed)
    group = spec.quant.group_size or spec.hidden_size
    if tokens > 1:
        inp.residual[1, :group] = 0
        inp.expanded_idx_to_permuted_idx[1] = -1  # every slot skipped: the residual alone
        if inp.shared_output is not None:
            inp.shared_output[1, :group] = 0
    if tokens > 2:
        inp.residual[2, ::group] = 3e38
        inp.residual[2] *= torch.where(torch.arange(spec.hidden_size) % group == 0, 1.0, 1e-38)
    if tokens > 3:
        inp.residual[3, 7] = float("nan")
    if tokens > 4:
        inp.residual[4] = 0
        inp.expanded_idx_to_permuted_idx[4] = -1
        if inp.shared_output is not None:
            inp.shared_output[4] = 0
    return inp


def check(spec: EpilogueSpec, got: EpilogueOutputs, tag: str) -> list[str]:
    """Codes and scales (bits) against the reference on the kernel's own norm_out, the scale view's
    strides, and the TMA padding columns 0."""
    problems = []
    group = spec.quant.group_size or spec.hidden_size
    codes, scales = quant_ref.quantize_fp8_per_token_group(got.norm_out, group)
    if not torch.equal(got.quant.view(torch.uint8), codes.view(torch.uint8)):
        bad = (got.quant.view(torch.uint8) != codes.view(torch.uint8)).nonzero()[:4].tolist()
        problems.append(f"{tag}: codes differ at {bad}")
    if not torch.equal(got.scale.contiguous().view(torch.int32), scales.view(torch.int32)):
        problems.append(f"{tag}: scales {got.scale.tolist()} != {scales.tolist()}")
    want = quant_ref.fp8_scale_view(scales, spec.quant.scale_layout or "row_major")
    if got.scale.shape[0] > 1 and got.scale.stride() != want.stride():
        problems.append(f"{tag}: strides {got.scale.stride()} != {want.stride()}")
    storage, ref_storage = storage_of(got.scale, spec), storage_of(want, spec)
    if not torch.equal(storage.view(torch.int32), ref_storage.view(torch.int32)):
        problems.append(f"{tag}: scale storage (padding) {storage.tolist()}")
    return problems


def add_rmsnorm(spec: EpilogueSpec, inp, gamma: torch.Tensor) -> EpilogueOutputs:
    tokens = inp.residual.shape[0]
    out = poisoned(spec, tokens)
    reduced = inp.shared_output if inp.shared_output is not None else inp.residual
    q = quant_args(spec)
    add_rmsnorm_into(
        out.residual_out,
        out.norm_out,
        out.quant.view(torch.uint8),
        out.scale,
        inp.residual,
        reduced,
        gamma,
        eps=spec.eps,
        weight_bias=spec.weight_bias,
        quant=q.code,
        quant_scale=q.scale,
        swizzled=q.swizzled,
        group=q.group,
        scale_layout=q.scale_layout,
    )
    return out


@pytest.mark.parametrize("quant", QUANTS, ids=_id)
def test_add_rmsnorm_kernel_bit_for_bit(quant: QuantSpec) -> None:
    spec = EpilogueSpec(hidden_size=HIDDEN, top_k=2, quant=quant, weight_bias=0.5)
    problems = []
    for tokens in (0, 1, 3, 9):
        inp = special_inputs(spec, tokens, seed=tokens, top_k=2)
        before = inp.residual.clone()
        out = add_rmsnorm(spec, inp, inp.gamma)
        assert torch.equal(inp.residual.view(torch.int16), before.view(torch.int16))
        problems += check(spec, out, f"T={tokens}")
        if tokens > 3:  # the NaN row: every group NaN, every code 0x7F
            assert (
                torch.isnan(out.scale[3]).all() and (out.quant[3].view(torch.uint8) == 0x7F).all()
            )
    assert not problems, problems


@pytest.mark.parametrize("quant", QUANTS[:3], ids=_id)
def test_add_rmsnorm_kernel_infinite_columns(quant: QuantSpec) -> None:
    """gamma +inf at one column and -inf at another: those elements are +-inf in norm_out (NaN
    where x is 0), their groups' scales +inf, the finite elements there +-0, the infinite 0x7F."""
    spec = EpilogueSpec(hidden_size=HIDDEN, top_k=2, quant=quant)
    inp = make_inputs(spec, 5, seed=11)
    gamma = inp.gamma.clone()
    gamma[5], gamma[100] = float("inf"), -float("inf")
    out = add_rmsnorm(spec, inp, gamma)
    assert torch.isinf(out.norm_out[:, 5]).any()
    assert not check(spec, out, "inf")
    group = quant.group_size
    assert (out.scale[:, 5 // group] == float("inf")).all()


def _tp1(spec: EpilogueSpec) -> FusedTp1Strategy:
    strat = FusedTp1Strategy(spec, ENV, device=torch.device("cpu"))
    strat.prepare()
    strat._launcher.num_sms = 16  # split rows allowed where the config asks for them
    return strat


def _launch(strat: FusedTp1Strategy, inp, config) -> tuple[EpilogueOutputs, int]:
    """One call with `config` forced, into poisoned outputs; (outputs, the plan's chunks). A split
    launch advances its rows' arrival counters, a whole-row one none: checked, so the plan names
    the kernel that ran."""
    tokens = inp.residual.shape[0]
    out = poisoned(strat.spec, tokens)
    src, row_out = RowSource.of(inp), RowOutputs.of(out, strat._unused)
    launcher = strat._launcher
    plan, _ = launcher.call_args(src, row_out, config)
    words = launcher.sync_words()
    before = words.clone()
    launcher(src, row_out, config)
    counters = (words - before)[: tokens * (MAX_CHUNKS + 1)].view(-1, MAX_CHUNKS + 1)
    assert bool((counters != 0).any()) == bool(plan.chunks), plan
    return out, plan.chunks


@pytest.mark.parametrize("quant", QUANTS, ids=_id)
def test_fused_tp1_whole_and_split_rows_bit_for_bit(quant: QuantSpec) -> None:
    """Whole rows (the launcher's own config) and split rows in chunks of 64 and 128 columns (3 and
    2 chunks of H=192: chunks of whole groups; per token exchanges the row's amax between them).
    K=1 at T=1 and 3, K=3 at T=9 (split in 64s only: interpreter time); per token split at T=1
    only (its split rows: test_fused_tp1_per_token_split_rows_exchange_the_row_amax)."""
    problems = []
    whole, by64, by128 = None, Tp1Config(64, 2), Tp1Config(128, 2)
    cases = {1: ((1, (whole, by64, by128)), (3, (whole, by64, by128))), 3: ((9, (whole, by64)),)}
    if quant.group_size is None:  # per token (three interpreter launches per split call)
        cases = {1: ((1, (whole, by64)), (3, (whole,))), 3: ((9, (whole,)),)}
    for top_k, shapes in cases.items():
        spec = EpilogueSpec(hidden_size=HIDDEN, top_k=top_k, quant=quant, routed_scaling_factor=2.5)
        strat = _tp1(spec)
        for tokens, configs in shapes:
            inp = special_inputs(spec, tokens, seed=tokens + top_k, top_k=top_k)
            for config in configs:
                got, chunks = _launch(strat, inp, config)
                tag = f"K={top_k} T={tokens} config={config} chunks={chunks}"
                split = config is not None and (quant.group_size or 0) <= config.columns
                if bool(chunks) != split:
                    problems.append(f"{tag}: planned {chunks} chunks")
                problems += check(spec, got, tag)
    assert not problems, problems


def test_fused_tp1_zero_tokens_and_the_bridge() -> None:
    """T=0 gives empty outputs of the layout's shapes; a bridge call returns the reference's
    codes and scales for its own norm_out."""
    from fusion_bridge import FusionBridge

    spec = EpilogueSpec(hidden_size=HIDDEN, top_k=2, quant=QUANTS[2])
    with FusionBridge(spec, strategy="fused_tp1", self_test=False) as bridge:
        empty = bridge(*make_inputs(spec, 0))
        got = bridge(*make_inputs(spec, 3, seed=5))
    assert empty.quant.shape == (0, HIDDEN) and empty.scale.shape == (0, HIDDEN // 16)
    assert not check(spec, got, "bridge")


def _per_token_rows(spec: EpilogueSpec, seed: int):
    """7 rows (odd T) for per token in split rows of H=192 (chunks of 64: 3; of 128: 2, the last
    partial): rows 0 and 6 random; row 1 its largest magnitude in the last chunk (column 187),
    row 2 in the middle (column 90); row 3 a NaN in the last chunk only; row 4 all zero; row 5
    3e38 in the last chunk (its sum of squares overflows: the rescue, then the row's amax)."""
    inp = make_inputs(spec, 7, seed=seed)
    inp.residual[1, 187] = 1e4
    inp.residual[2, 90] = -1e4
    inp.residual[3, 180] = float("nan")
    inp.residual[4] = 0
    inp.expanded_idx_to_permuted_idx[4] = -1
    if inp.shared_output is not None:
        inp.shared_output[4] = 0
    inp.residual[5, 170] = 3e38
    return inp


def _same_as_whole_rows(
    spec: EpilogueSpec, whole: EpilogueOutputs, got: EpilogueOutputs, tag: str
) -> list[str]:
    """Split rows against whole rows (per token): residual_out bit for bit, norm_out within the
    strategy's bound, and the codes and scale of every row whose norm_out is bit for bit the whole
    rows' bit for bit too. Every row's norm_out is, here: under the interpreter these rows' chunk
    sums round as the whole row's sum (a GPU's reductions may differ by an ulp: then the codes are
    checked against the reference on the row's own norm_out alone, `check`)."""
    problems = []
    if not torch.equal(got.residual_out.view(torch.int16), whole.residual_out.view(torch.int16)):
        problems.append(f"{tag}: residual_out")
    same = [
        r
        for r in range(got.norm_out.shape[0])
        if torch.equal(got.norm_out[r].view(torch.int16), whole.norm_out[r].view(torch.int16))
    ]
    if len(same) < got.norm_out.shape[0]:
        problems.append(f"{tag}: norm_out bit for bit the whole rows' in rows {same} only")
    for r in same:
        if not torch.equal(got.quant[r].view(torch.uint8), whole.quant[r].view(torch.uint8)):
            problems.append(f"{tag}: row {r} codes differ from the whole rows'")
        if not torch.equal(got.scale[r].view(torch.int32), whole.scale[r].view(torch.int32)):
            problems.append(f"{tag}: row {r} scale {got.scale[r]} != {whole.scale[r]}")
    finite = torch.isfinite(whole.norm_out).all(dim=1)
    bound = FusedTp1Strategy.error_bound(spec, ENV)
    if rel_err(got.norm_out[finite], whole.norm_out[finite]) > bound:
        problems.append(f"{tag}: norm_out off the whole rows'")
    return problems


def test_fused_tp1_per_token_split_rows_exchange_the_row_amax() -> None:
    """Per token in split rows: each chunk's program publishes its chunk's amax of the normalized
    row and takes the row's one scale from every chunk's (the second exchange), so codes and
    scales are bit for bit the reference's on the kernel's own norm_out and the whole rows'. Rows
    whose amax lies in the last or a middle chunk (a chunk left out of the exchange, or a scale
    from a chunk's own amax, gives other codes), a NaN in the last chunk only (every chunk's codes
    0x7F, the scale NaN), an all-zero row, an overflowing sum; then gamma +inf in the last chunk
    and -inf in the middle (scale +inf, finite elements +-0, infinite ones 0x7F)."""
    spec = EpilogueSpec(hidden_size=HIDDEN, top_k=2, quant=QuantSpec.fp8_per_token(),
                        routed_scaling_factor=2.5, weight_bias=0.5)  # fmt: skip
    strat = _tp1(spec)
    rows = _per_token_rows(spec, seed=3)
    gamma_inf = rows.gamma.clone()
    gamma_inf[170], gamma_inf[100] = float("inf"), -float("inf")
    problems = []
    # the infinite columns on rows 0-2 only (interpreter time)
    first3 = EpilogueInputs(
        *(rows.gemm2_out, *(None if t is None else t[:3] for t in rows[1:5]), rows.gamma)
    )
    for label, inp in (("rows", rows), ("inf", first3._replace(gamma=gamma_inf))):
        whole, chunks = _launch(strat, inp, None)
        assert chunks == 0
        problems += check(spec, whole, f"{label} whole rows")
        for config, count in ((Tp1Config(64, 2), 3), (Tp1Config(128, 2), 2)):
            got, chunks = _launch(strat, inp, config)
            tag = f"{label} in {count} chunks of {config.columns}"
            assert chunks == count, tag
            problems += check(spec, got, tag)
            problems += _same_as_whole_rows(spec, whole, got, tag)
            if label == "rows":  # the rows are what they claim
                where = got.norm_out.float().abs().nan_to_num(0.0).argmax(dim=1)
                assert where[1] == 187 and where[2] == 90 and where[5] == 170, where
                assert (
                    torch.isnan(got.scale[3]).all()
                    and (got.quant[3].view(torch.uint8) == 0x7F).all()
                )
            else:  # the rows' largest magnitudes are +-inf
                assert (got.scale[:, 0] == float("inf")).all(), got.scale
    assert not problems, problems


def test_per_token_split_rows_whose_partner_amax_never_arrives_are_nan_and_reported() -> None:
    """The second exchange's wait is bounded: a call's sums published (its publish launch), then
    its outputs launch without the launch that publishes the later chunks' amaxes (3 polls): the
    chunks that wait for an amax that never comes give codes 0x7F and the row's scale NaN (the
    norm is whole: the sums arrived), not a hang; the strategy's next call raises, once."""
    spec = EpilogueSpec(hidden_size=HIDDEN, top_k=2, quant=QuantSpec.fp8_per_token())
    strat = _tp1(spec)
    inp = make_inputs(spec, 1, seed=5)
    config = Tp1Config(64, 2)
    out, chunks = _launch(strat, inp, config)  # a whole call: every word tagged with epoch 1
    assert chunks == 3 and not check(spec, out, "first call")
    plan, args = strat._launcher.call_args(RowSource.of(inp), RowOutputs.of(out, strat._unused),
                                           config)  # fmt: skip
    for phase in (tp1_configs.PUBLISH_PHASE, tp1_configs.OUTPUT_PHASE):
        fixed = plan.constexprs._replace(MAX_POLLS=3, PHASES=phase)
        plan.kernel(plan.grid, args, fixed, plan.warps)
    assert torch.isfinite(out.norm_out).all()
    assert torch.isnan(out.scale).all()
    assert (out.quant[0, :128].view(torch.uint8) == 0x7F).all()  # chunks 0 and 1 waited in vain
    with pytest.raises(RuntimeError, match="fused_tp1: an earlier call's split rows timed out"):
        strat.run(inp)
    assert not check(spec, strat.run(inp), "after")  # reported once; the next call runs


def test_per_token_takes_split_rows_where_the_other_formats_do() -> None:
    """`tp1_config` (132 SMs) gives per token static FP8's config at T=1, 16, 64 and 256 for
    H=7168, 4096, 2048 and 2880 (not a multiple of 256): below the launch table (T < 64) the
    unquantized call's split; from T=64 the table's FP8 entry, split ones included. A
    per-token launcher's words hold the chunk amaxes after the sums (AMAX_WORDS more); the other
    formats' hold the sums alone."""
    from fusion_bridge.kernels.layer import LayerRecord
    from fusion_bridge.kernels.quant import row_block
    from fusion_bridge.kernels.quant_codes import QUANT_FP8, QUANT_FP8_TOKEN, QUANT_NONE
    from fusion_bridge.kernels.tp1.launcher import Tp1Launcher

    for quant, words in (
        (QuantSpec.fp8_per_token(), tp1_configs.SYNC_WORDS + tp1_configs.AMAX_WORDS),
        (QuantSpec.fp8_per_token_group(64), tp1_configs.SYNC_WORDS),
    ):
        spec = EpilogueSpec(hidden_size=HIDDEN, top_k=2, quant=quant)
        launcher = Tp1Launcher(LayerRecord.of(spec), 16, torch.device("cpu"))
        assert launcher.sync_words().numel() == words, quant

    for hidden in (7168, 4096, 2048, 2880):
        for tokens in (1, 16, 64, 256):
            static = tp1_configs.tp1_config(tokens, hidden, QUANT_FP8, 132)
            got = tp1_configs.tp1_config(tokens, hidden, QUANT_FP8_TOKEN, 132)
            assert got == static, (hidden, tokens, got, static)
            if tokens < 64:  # below the launch table: the rule's split, as unquantized
                plain = tp1_configs.tp1_config(tokens, hidden, QUANT_NONE, 132)
                assert got == plain and got.columns < row_block(hidden), (hidden, tokens, got)
