"""What our strategies hand to FlashInfer, checked on CPU through a fake `flashinfer.comm`.

The FlashInfer kernels need SM >= 90 GPUs, so the GPU grid is the only place they run for real;
there a
wrong argument either dies, or (weight_bias = 0 in the grid, a divisor passed as its inverse that
still
rounds into range, an fp32 weight read as bf16) passes silently. Here a fake `flashinfer.comm`
module
(installed in `sys.modules` of each rank) records every keyword argument of
`trtllm_allreduce_fusion`,
`trtllm_moe_finalize_allreduce_fusion` and `TRTLLMAllReduceFusionWorkspace`, and writes recognisable
values into the outputs it is given. The strategy classes are built directly
(`cls(spec, env, group, device=cpu)`, `prepare()`, `run(inputs, variant)`, `close()`) with
`Environment`
values that describe an H200 (SM90) or B200 (SM100) TP2 machine, in a real 2-rank gloo group (they
call
`torch.distributed.get_rank(group)`); our own Triton kernels run under TRITON_INTERPRET=1.

One spawn runs every case on both ranks and ships back what the fake recorded; the tests below judge
it. `tests/strategies/test_flashinfer_api.py` (the real-signature drift test) stays: this file
checks values,
that
one checks names against the installed package; `test_every_keyword_we_pass_exists_in_flashinfer`
joins the two when flashinfer is installed.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
import types
from typing import NamedTuple, Optional

import pytest
import torch

from fusion_bridge.environment import Environment
from fusion_bridge.spec import EpilogueSpec, QuantKind, QuantSpec, SFLayout

WORLD = 2
RUN_TIMEOUT_S = 300  # the whole 2-rank run (every case, both ranks, kernels under the interpreter)
FI_VERSION = "0.7.2.post1"
FP8_SCALE = 3.0  # a divisor; its inverse (0.333..) is not representable: easy to tell apart
NVFP4_GLOBAL_SCALE = (
    448 * 6 / 5.0
)  # 537.6: rounds in float32, so the test compares the float32 tensor
MISSING = "<missing>"  # a keyword the strategy did not pass at all

# ---------------------------------------------------------------- the fake flashinfer.comm


class AllReduceFusionPattern:
    """Copied from flashinfer 0.7.2.post1, flashinfer/comm/trtllm_ar.py (test_fake_enums_match_...
    checks)."""

    kAllReduce = 0
    kARResidualRMSNorm = 1
    kARResidualRMSNormFP8Quant = 2
    kARResidualRMSNormFP4Quant = 3
    kARResidualRMSNormOutFP8Quant = 4
    kARResidualRMSNormOutFP4Quant = 5
    kMoEReductionARResidualRMSNorm = 6
    kMoEFinalizeARResidualRMSNorm = 7


class QuantizationSFLayout:
    """Copied from flashinfer 0.7.2.post1, flashinfer/comm/trtllm_ar.py."""

    SWIZZLED_128x4 = 0
    SWIZZLED_8x4 = 1
    LINEAR = 2


def _pattern(tokens: int, cols: int, salt: int) -> torch.Tensor:
    """Recognisable, varied float values (multiples of 1/16 in [-3.2, 3.1], exact in bf16 and
    fp16)."""
    idx = torch.arange(tokens * cols, dtype=torch.int64).reshape(tokens, cols)
    return ((idx * 37 + salt * 11) % 101 - 50).float() / 16


def _fill(t: Optional[torch.Tensor], salt: int) -> None:
    if t is None:
        return
    if t.dtype == torch.uint8:
        idx = torch.arange(t.numel(), dtype=torch.int64).reshape(t.shape)
        t.copy_(((idx * 29 + salt) % 251).to(torch.uint8))
    else:
        t.copy_(_pattern(t.shape[0], t.shape[1], salt).to(t.dtype))


class _FakeLog:
    # (function name, positional args, kwargs as passed, tensor clones at call time)
    calls: list = []
    workspaces: list = []  # every FakeWorkspace made, in order


class FakeWorkspace:
    """Records its constructor arguments; `workspace_tensor` is a one-element tensor naming it."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        self.serial = len(_FakeLog.workspaces)
        self.workspace_tensor = torch.tensor([1000 + self.serial], dtype=torch.int64)
        self.metadata = {"buffer_size": 1 << 20, "flag_size": 1024, "lamport_buffer_size": 3 << 20}
        self.destroyed = 0
        _FakeLog.workspaces.append(self)

    def destroy(self):
        self.destroyed += 1


def _record(name: str, args: tuple, kwargs: dict) -> None:
    clones = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    _FakeLog.calls.append((name, args, dict(kwargs), clones))


def fake_trtllm_allreduce_fusion(*args, **kwargs):
    _record("trtllm_allreduce_fusion", args, kwargs)
    for i, name in enumerate(
        ("residual_out", "norm_out", "quant_out", "scale_out", "allreduce_out")
    ):
        _fill(kwargs.get(name), salt=i + 1)


def fake_trtllm_moe_finalize_allreduce_fusion(*args, **kwargs):
    _record("trtllm_moe_finalize_allreduce_fusion", args, kwargs)
    for i, name in enumerate(("residual_out", "norm_out", "quant_out", "scale_out")):
        _fill(kwargs.get(name), salt=i + 1)


def install_fake_flashinfer() -> types.ModuleType:
    """Put a fake `flashinfer` package with a fake `comm` module in sys.modules (this process
    only)."""
    package = types.ModuleType("flashinfer")
    # a package, so `import flashinfer.comm` looks the submodule up in sys.modules
    package.__path__ = []
    comm = types.ModuleType("flashinfer.comm")
    comm.AllReduceFusionPattern = AllReduceFusionPattern
    comm.QuantizationSFLayout = QuantizationSFLayout
    comm.TRTLLMAllReduceFusionWorkspace = FakeWorkspace
    comm.trtllm_allreduce_fusion = fake_trtllm_allreduce_fusion
    comm.trtllm_moe_finalize_allreduce_fusion = fake_trtllm_moe_finalize_allreduce_fusion
    package.comm = comm
    sys.modules["flashinfer"], sys.modules["flashinfer.comm"] = package, comm
    return comm


# ---------------------------------------------------------------- the cases


def env_for(sm: int, strategy: str = "") -> Environment:
    """A TP2 H200 (sm=90) or B200 (sm=100) as the capability checks see it (flashinfer_fused_fp4:
    with a
    flashinfer release after 0.7.4, the only one that would admit it)."""
    return Environment(
        device_type="cuda",
        sm=sm,
        gpu_name={90: "NVIDIA H200", 100: "NVIDIA B200"}[sm],
        world_size=WORLD,
        single_node=True,
        triton_version="3.4.0",
        flashinfer_version="0.8.0" if strategy == FF4 else FI_VERSION,
        triton_interpret=True,
    )


BASE = dict(eps=1e-5, weight_bias=0.75, routed_scaling_factor=2.5, max_tokens=64)
S_BF16 = EpilogueSpec(hidden_size=256, top_k=4, dtype=torch.bfloat16, **BASE)
S_FP16_NO_SHARED = EpilogueSpec(
    hidden_size=512,
    top_k=3,
    dtype=torch.float16,
    eps=3e-4,
    weight_bias=-0.25,
    routed_scaling_factor=0.625,
    has_shared_output=False,
    max_tokens=48,
)
S_FP8 = EpilogueSpec(
    hidden_size=256, top_k=4, dtype=torch.bfloat16, quant=QuantSpec.fp8(FP8_SCALE), **BASE
)
S_FP8_FP16 = EpilogueSpec(
    hidden_size=256, top_k=2, dtype=torch.float16, quant=QuantSpec.fp8(FP8_SCALE), **BASE
)
S_NVFP4_SW = EpilogueSpec(
    hidden_size=256,
    top_k=4,
    dtype=torch.bfloat16,
    quant=QuantSpec.nvfp4(NVFP4_GLOBAL_SCALE, SFLayout.SWIZZLED_128x4),
    **BASE,
)
S_NVFP4_LIN = EpilogueSpec(
    hidden_size=256,
    top_k=4,
    dtype=torch.bfloat16,
    quant=QuantSpec.nvfp4(NVFP4_GLOBAL_SCALE, SFLayout.LINEAR),
    **BASE,
)

LFF, FF, FF4 = "local_fused_flashinfer", "flashinfer_fused", "flashinfer_fused_fp4"


class Case(NamedTuple):
    name: str
    strategy: str
    spec: EpilogueSpec
    sm: int
    tokens: int
    variant: str
    weight_dtype: torch.dtype = torch.float32


CASES = [
    # local_fused_flashinfer: one-shot exactly when the variant says so (two-shot only at T > world
    # size, where the planner may choose it)
    Case("lff_bf16_oneshot_T7", LFF, S_BF16, 90, 7, "oneshot"),
    Case("lff_bf16_twoshot_T7", LFF, S_BF16, 90, 7, "twoshot"),
    Case("lff_bf16_twoshot_T3", LFF, S_BF16, 100, 3, "twoshot", torch.bfloat16),
    Case("lff_bf16_oneshot_T2", LFF, S_BF16, 90, 2, "oneshot"),
    Case("lff_bf16_oneshot_T1", LFF, S_BF16, 100, 1, "oneshot"),
    Case("lff_fp16_noshared_oneshot_T5", LFF, S_FP16_NO_SHARED, 100, 5, "oneshot", torch.bfloat16),
    Case("lff_fp8_sm90", LFF, S_FP8, 90, 4, "twoshot"),
    Case("lff_fp8_fp16_sm100", LFF, S_FP8_FP16, 100, 5, "oneshot"),
    Case("lff_nvfp4_swizzled_sm90", LFF, S_NVFP4_SW, 90, 5, "oneshot"),
    Case("lff_nvfp4_linear_sm90", LFF, S_NVFP4_LIN, 90, 3, "twoshot"),
    Case("lff_nvfp4_swizzled_sm100", LFF, S_NVFP4_SW, 100, 5, "oneshot"),
    Case("lff_nvfp4_linear_sm100", LFF, S_NVFP4_LIN, 100, 6, "twoshot"),
    # flashinfer_fused: expert weights of every dtype pair, shared output or none, every quant and
    # SM
    Case("ff_bf16_w_fp32", FF, S_BF16, 90, 5, "default", torch.float32),
    Case("ff_bf16_w_bf16", FF, S_BF16, 100, 3, "default", torch.bfloat16),
    Case("ff_fp16_w_fp32_noshared", FF, S_FP16_NO_SHARED, 90, 6, "default", torch.float32),
    Case("ff_fp16_w_bf16_noshared", FF, S_FP16_NO_SHARED, 100, 4, "default", torch.bfloat16),
    Case("ff_fp8_sm90", FF, S_FP8, 90, 4, "default", torch.float32),
    Case("ff_fp8_fp16_sm100", FF, S_FP8_FP16, 100, 3, "default", torch.bfloat16),
    Case("ff_nvfp4_swizzled_sm90", FF, S_NVFP4_SW, 90, 5, "default"),
    Case("ff_nvfp4_swizzled_sm100", FF, S_NVFP4_SW, 100, 9, "default"),
    Case("ff_nvfp4_linear_sm100", FF, S_NVFP4_LIN, 100, 4, "default"),
    # flashinfer_fused_fp4, as a flashinfer release after 0.7.4 on SM100 would admit it (class built
    # directly)
    Case("ff4_nvfp4_swizzled_sm100", FF4, S_NVFP4_SW, 100, 5, "default"),
]
CASE_BY_NAME = {c.name: c for c in CASES}
LFF_CASES = [c.name for c in CASES if c.strategy == LFF]
FF_CASES = [c.name for c in CASES if c.strategy == FF]
FF4_CASES = [c.name for c in CASES if c.strategy == FF4]


def strategy_class(name: str):
    from fusion_bridge.strategies.flashinfer_fused import FlashInferFusedStrategy
    from fusion_bridge.strategies.flashinfer_fused_fp4 import FlashInferFusedFp4Strategy
    from fusion_bridge.strategies.local_fused_flashinfer import LocalFusedFlashInferStrategy

    return {
        LFF: LocalFusedFlashInferStrategy,
        FF: FlashInferFusedStrategy,
        FF4: FlashInferFusedFp4Strategy,
    }[name]


# ---------------------------------------------------------------- what the ranks run


def _wire(t: torch.Tensor) -> dict:
    """A tensor as a picklable record (float8 does not pickle: ship its bytes)."""
    if t.dtype == torch.float8_e4m3fn:
        return {"dtype": t.dtype, "data": t.view(torch.uint8).clone()}
    return {"dtype": t.dtype, "data": t.clone()}


def _ship(value, named: dict):
    """A recorded keyword value: tensors as records plus the names of the objects they are
    (`is`)."""
    if isinstance(value, torch.Tensor):
        rec = _wire(value)
        rec["is"] = sorted(n for n, obj in named.items() if obj is value)
        return rec
    return value


def _run_into_out(strategy, case: Case, inputs, outputs) -> dict:
    """The same call again with preallocated outputs (`out=`): whether run() returned `out`, wrote
    what the plain call returned, and which of FlashInfer's output keywords were out's tensors."""
    from fusion_bridge.epilogue_tensors import allocate_outputs

    out = allocate_outputs(case.spec, case.tokens, torch.device("cpu"))
    _FakeLog.calls.clear()
    got = strategy.run(inputs, case.variant, out=out)
    same = all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(outputs.named().values(), got.named().values())
    )
    handed = {}
    for _, _, kwargs, _ in _FakeLog.calls:
        for key in ("residual_out", "norm_out", "quant_out", "scale_out"):
            value = kwargs.get(key)
            if isinstance(value, torch.Tensor):
                handed[key] = [n for n, t in out.named().items() if t is value]
    return {"is_out": got is out, "same": same, "handed": handed}


def _run_case(case: Case, rank: int, group) -> dict:
    from fusion_bridge.oracle.synthetic import make_inputs
    from tests.helpers import clone_inputs, inputs_equal

    spec, env = case.spec, env_for(case.sm, case.strategy)
    inputs = make_inputs(
        spec, case.tokens, rank=rank, seed=len(case.name), weight_dtype=case.weight_dtype
    )
    before = clone_inputs(inputs)
    _FakeLog.calls.clear()
    first_workspace = len(_FakeLog.workspaces)
    strategy = strategy_class(case.strategy)(spec, env, group, device=torch.device("cpu"))
    strategy.prepare()
    outputs = strategy.run(inputs, case.variant)
    calls_before_out = list(_FakeLog.calls)
    with_out = _run_into_out(strategy, case, inputs, outputs)
    _FakeLog.calls[:] = calls_before_out
    strategy.close()
    made = _FakeLog.workspaces[first_workspace:]
    named = {f"inputs.{k}": v for k, v in inputs._asdict().items() if v is not None}
    named.update({f"outputs.{k}": v for k, v in outputs.named().items()})
    named.update({f"workspace{w.serial}.workspace_tensor": w.workspace_tensor for w in made})
    calls = []
    for fn, args, kwargs, clones in _FakeLog.calls:
        calls.append(
            {
                "fn": fn,
                "n_args": len(args),
                "kw": {k: _ship(v, named) for k, v in kwargs.items()},
                "at_call": {k: _wire(v) for k, v in clones.items() if isinstance(v, torch.Tensor)},
            }
        )
    return {
        "calls": calls,
        "with_out": with_out,
        "inputs": {k: _wire(v) for k, v in inputs._asdict().items() if v is not None},
        "inputs_unchanged": inputs_equal(before, inputs)
        and inputs.expert_weights.dtype == case.weight_dtype,
        "outputs": {k: _wire(v) for k, v in outputs.named().items()},
        "workspaces": [
            {
                "args": w.args,
                "kwargs": {k: v for k, v in w.kwargs.items() if k != "group"},
                "group_is_ours": w.kwargs.get("group") is group,
                "destroyed": w.destroyed,
            }
            for w in made
        ],
    }


def _workspace_sharing(rank: int, group) -> dict:
    """local_fused_flashinfer and flashinfer_fused on one spec share one workspace; the last close
    frees it."""
    from fusion_bridge.oracle.synthetic import make_inputs

    env, cpu = env_for(90), torch.device("cpu")
    lff_cls, ff_cls = strategy_class(LFF), strategy_class(FF)
    out = {}
    start = len(_FakeLog.workspaces)
    _FakeLog.calls.clear()
    a, b = lff_cls(S_BF16, env, group, device=cpu), ff_cls(S_BF16, env, group, device=cpu)
    a.prepare()
    b.prepare()
    other = lff_cls(
        S_FP16_NO_SHARED, env, group, device=cpu
    )  # another (H, dtype, max_tokens): its own
    other.prepare()
    made = _FakeLog.workspaces[start:]
    out["made_after_prepare"] = len(made)
    inputs = make_inputs(S_BF16, 5, rank=rank, seed=3)
    a.run(inputs, "oneshot")
    b.run(inputs)
    out["ptrs_serials"] = [
        int(kw["workspace_ptrs"].item()) - 1000 for _, _, kw, _ in _FakeLog.calls
    ]
    out["serials"] = [w.serial for w in made]
    try:  # the planner never routes two-shot to T <= world size; a direct run() is refused
        a.run(make_inputs(S_BF16, WORLD, rank=rank, seed=4), "twoshot")
        out["twoshot_at_world"] = None
    except ValueError as exc:
        out["twoshot_at_world"] = str(exc)
    out["calls_after_refusal"] = len(_FakeLog.calls)
    out["bytes"] = (a.workspace_bytes, b.workspace_bytes)
    out["destroyed_after_prepare"] = [w.destroyed for w in made]
    a.close()
    out["destroyed_after_first_close"] = [w.destroyed for w in made]
    b.close()
    out["destroyed_after_second_close"] = [w.destroyed for w in made]
    a.close()
    b.close()
    out["destroyed_after_closing_again"] = [w.destroyed for w in made]
    other.close()
    out["destroyed_after_other_close"] = [w.destroyed for w in made]
    # after the last user left, the next prepare makes a fresh one
    c = ff_cls(S_BF16, env, group, device=cpu)
    c.prepare()
    out["made_after_reprepare"] = len(_FakeLog.workspaces) - start
    c.close()
    out["destroyed_at_end"] = [w.destroyed for w in _FakeLog.workspaces[start:]]
    out["constructor_kwargs"] = [{k: v for k, v in w.kwargs.items() if k != "group"} for w in made]
    return out


def _all_cases(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from tests.helpers import patch_the_interpreter_once_per_launch

    patch_the_interpreter_once_per_launch()  # as tests/conftest.py does in the test process
    install_fake_flashinfer()
    group = dist.new_group(list(range(world_size)), backend="gloo")
    result = {"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"), "cases": {}, "errors": {}}
    for case in CASES:
        try:
            result["cases"][case.name] = _run_case(case, rank, group)
        except Exception as exc:  # one broken case must not hide the others; its tests fail on it
            import traceback

            result["errors"][case.name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    try:
        result["sharing"] = _workspace_sharing(rank, group)
    except Exception as exc:
        import traceback

        result["errors"]["sharing"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    dist.barrier(group)
    return result


# ---------------------------------------------------------------- parent side


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from fusion_bridge.cli.launch import run_distributed
    from tests.helpers import once_per_run

    return once_per_run(  # one spawned group per run: xdist workers share it
        tmp_path_factory,
        "flashinfer_callsites",
        lambda _: run_distributed(_all_cases, WORLD, backend="gloo", timeout_s=RUN_TIMEOUT_S),
    )


def tensor(rec: dict) -> torch.Tensor:
    return rec["data"].view(rec["dtype"]) if rec["dtype"] == torch.float8_e4m3fn else rec["data"]


def the_call(ranks, name: str, rank: int) -> dict:
    out = ranks[rank]
    assert name not in out["errors"], out["errors"][name]
    calls = out["cases"][name]["calls"]
    expected = (
        "trtllm_allreduce_fusion"
        if CASE_BY_NAME[name].strategy == LFF
        else "trtllm_moe_finalize_allreduce_fusion"
    )
    assert [c["fn"] for c in calls] == [expected], (name, rank, [c["fn"] for c in calls])
    assert calls[0]["n_args"] == 0, f"{name}: positional arguments to {expected} (keywords only)"
    return calls[0]


def kw(call: dict, key: str):
    return call["kw"].get(key, MISSING)


def test_ranks_run_triton_under_the_interpreter(ranks):
    """conftest sets TRITON_INTERPRET=1 in the test process; the spawned ranks must inherit it, or
    our
    finalize kernel could not have run on CPU."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert [r["TRITON_INTERPRET"] for r in ranks] == ["1", "1"]


def test_every_case_ran_and_called_flashinfer_once_with_keywords(ranks):
    for rank in range(WORLD):
        assert ranks[rank]["errors"] == {}, ranks[rank]["errors"]
        for name in CASE_BY_NAME:
            the_call(ranks, name, rank)


@pytest.mark.parametrize("name", list(CASE_BY_NAME))
def test_each_case_is_supported_in_its_environment(name):
    """The environments are realistic: the capability checks admit every case we fake."""
    case = CASE_BY_NAME[name]
    assert (
        strategy_class(case.strategy).not_supported_reasons(
            case.spec, env_for(case.sm, case.strategy)
        )
        == []
    )


# ---- local_fused_flashinfer -> trtllm_allreduce_fusion


@pytest.mark.parametrize("name", LFF_CASES)
def test_lff_passes_weight_bias_eps_gamma_and_residual(ranks, name):
    spec = CASE_BY_NAME[name].spec
    for rank in range(WORLD):
        call = the_call(ranks, name, rank)
        assert kw(call, "weight_bias") == spec.weight_bias != 0.0, (
            name,
            rank,
            kw(call, "weight_bias"),
        )
        assert kw(call, "rms_eps") == spec.eps, (name, rank, kw(call, "rms_eps"))
        assert kw(call, "rms_gamma")["is"] == ["inputs.gamma"]
        assert kw(call, "residual_in")["is"] == ["inputs.residual"]
        assert kw(call, "allreduce_out") is None


@pytest.mark.parametrize("name", LFF_CASES)
def test_lff_allreduce_in_is_our_finalize_partial_with_routed_scaling(ranks, name):
    """allreduce_in = routed_scaling * sum_k w * gemm2_out[perm] (+ shared), in the activation
    dtype."""
    spec, tokens = CASE_BY_NAME[name].spec, CASE_BY_NAME[name].tokens
    for rank in range(WORLD):
        call, rec = the_call(ranks, name, rank), ranks[rank]["cases"][name]
        g, perm, w = (
            tensor(rec["inputs"][k])
            for k in ("gemm2_out", "expanded_idx_to_permuted_idx", "expert_weights")
        )
        ref = torch.zeros(tokens, spec.hidden_size, dtype=torch.float64)
        for t in range(tokens):
            for k in range(spec.top_k):
                if perm[t, k] >= 0:
                    ref[t] += float(w[t, k]) * g[perm[t, k]].double()
        ref *= spec.routed_scaling_factor
        if spec.has_shared_output:
            ref += tensor(rec["inputs"]["shared_output"]).double()
        got = tensor(call["at_call"]["allreduce_in"])
        assert got.dtype == spec.dtype and got.shape == (tokens, spec.hidden_size)
        torch.testing.assert_close(got.double(), ref.to(spec.dtype).double(), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("name", LFF_CASES)
def test_lff_sizes_rank_and_flags(ranks, name):
    case = CASE_BY_NAME[name]
    for rank in range(WORLD):
        call, rec = the_call(ranks, name, rank), ranks[rank]["cases"][name]
        assert kw(call, "token_num") == case.tokens
        assert kw(call, "hidden_dim") == case.spec.hidden_size
        assert kw(call, "world_size") == WORLD
        assert kw(call, "world_rank") == rank
        assert kw(call, "launch_with_pdl") is False
        assert kw(call, "trigger_completion_at_end") is True
        assert kw(call, "fp32_acc") is True
        assert len(rec["workspaces"]) == 1
        assert kw(call, "workspace_ptrs")["is"] == [f"workspace{ws_serial(rec)}.workspace_tensor"]


def ws_serial(rec: dict) -> int:
    return int(rec["calls"][0]["at_call"]["workspace_ptrs"]["data"].item()) - 1000


@pytest.mark.parametrize("name", LFF_CASES)
def test_lff_use_oneshot_is_the_variant(ranks, name):
    """ "oneshot" -> True, "twoshot" -> False, whatever T: run() launches the variant it is given
    (two-shot only ever reaches it at T > world size, the range it declares)."""
    case = CASE_BY_NAME[name]
    for rank in range(WORLD):
        assert kw(the_call(ranks, name, rank), "use_oneshot") is (case.variant == "oneshot"), (
            name,
            rank,
        )


def test_lff_cases_cover_both_variants_and_t_at_or_below_the_world_size():
    """The cases above are not all one value: both variants, one-shot at T <= world size and
    above, two-shot above it (its declared range)."""
    seen = {(CASE_BY_NAME[n].variant, CASE_BY_NAME[n].tokens > WORLD) for n in LFF_CASES}
    assert seen == {("oneshot", True), ("oneshot", False), ("twoshot", True)}


def test_lff_refuses_two_shot_at_t_at_or_below_the_world_size(ranks):
    """run() launches the variant it is given or refuses: no silent one-shot instead."""
    for rank in range(WORLD):
        sharing = ranks[rank]["sharing"]
        assert "two-shot needs token_num > world_size" in (sharing["twoshot_at_world"] or "")
        assert sharing["calls_after_refusal"] == 2  # the refused call never reached FlashInfer


def test_lff_declares_two_shot_only_above_the_world_size():
    from fusion_bridge.strategies.local_fused_flashinfer import LocalFusedFlashInferStrategy as L

    ranges = L.variant_tokens(S_BF16, env_for(90))
    assert ranges["twoshot"] == (WORLD + 1, None)
    assert ranges["oneshot"][0] == 1 and ranges["oneshot"][1] >= S_BF16.max_tokens


@pytest.mark.parametrize(
    "name", [n for n in LFF_CASES if CASE_BY_NAME[n].spec.quant.kind is QuantKind.NONE]
)
def test_lff_unquantized_plain_pattern_and_outputs_returned(ranks, name):
    for rank in range(WORLD):
        call, rec = the_call(ranks, name, rank), ranks[rank]["cases"][name]
        assert kw(call, "pattern_code") == AllReduceFusionPattern.kARResidualRMSNorm
        for key in ("quant_out", "scale_out", "scale_factor", "layout_code"):
            assert kw(call, key) is None, key
        assert kw(call, "residual_out")["is"] == ["outputs.residual_out"]
        assert kw(call, "norm_out")["is"] == ["outputs.norm_out"]
        assert set(rec["outputs"]) == {"residual_out", "norm_out"}
        for key, salt in (
            ("residual_out", 1),
            ("norm_out", 2),
        ):  # what the fake wrote, returned as is
            got = tensor(rec["outputs"][key])
            assert torch.equal(got, _pattern(*got.shape, salt).to(got.dtype)), key


@pytest.mark.parametrize(
    "name", [n for n in LFF_CASES if CASE_BY_NAME[n].spec.quant.kind is QuantKind.FP8]
)
def test_lff_fp8_fused_pattern_and_divisor_scale(ranks, name):
    spec = CASE_BY_NAME[name].spec
    for rank in range(WORLD):
        call, rec = the_call(ranks, name, rank), ranks[rank]["cases"][name]
        assert kw(call, "pattern_code") == AllReduceFusionPattern.kARResidualRMSNormOutFP8Quant
        scale = tensor(kw(call, "scale_factor"))
        assert scale.dtype == torch.float32 and scale.shape == (1,)
        assert (
            scale.item() == QuantSpec.fp8(FP8_SCALE).scale == spec.quant.scale == FP8_SCALE
        )  # not 1/scale
        assert kw(call, "layout_code") is None and kw(call, "scale_out") is None
        q = kw(call, "quant_out")
        assert q["dtype"] == torch.float8_e4m3fn and q["data"].shape == (
            CASE_BY_NAME[name].tokens,
            spec.hidden_size,
        )
        assert q["is"] == ["outputs.quant"] and "scale" not in rec["outputs"]
        assert kw(call, "norm_out")["is"] == ["outputs.norm_out"]


def _quant_ref(norm_out: torch.Tensor, spec: EpilogueSpec):
    from fusion_bridge.oracle import quant_ref

    if spec.quant.kind is QuantKind.FP8:
        return quant_ref.quantize_fp8(norm_out, spec.quant.scale), None
    return quant_ref.quantize_nvfp4(norm_out, spec.quant.global_scale, spec.quant.sf_layout)


def _assert_our_kernel_quantized_flashinfers_norm_out(rec: dict, spec: EpilogueSpec, name: str):
    norm_out = tensor(rec["outputs"]["norm_out"])
    assert torch.equal(norm_out, _pattern(*norm_out.shape, 2).to(spec.dtype)), (
        "norm_out is FlashInfer's"
    )
    q_ref, sf_ref = _quant_ref(norm_out, spec)
    q = tensor(rec["outputs"]["quant"])
    assert q.dtype == q_ref.dtype and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), (
        name
    )
    if sf_ref is None:
        assert "scale" not in rec["outputs"]
    else:
        sf = tensor(rec["outputs"]["scale"])
        assert sf.shape == sf_ref.shape and torch.equal(sf, sf_ref), name


@pytest.mark.parametrize(
    "name", [n for n in LFF_CASES if CASE_BY_NAME[n].spec.quant.kind is QuantKind.NVFP4]
)
def test_lff_nvfp4_fused_only_on_sm100_with_global_scale_and_layout(ranks, name):
    case = CASE_BY_NAME[name]
    spec = case.spec
    for rank in range(WORLD):
        call, rec = the_call(ranks, name, rank), ranks[rank]["cases"][name]
        if (
            case.sm < 100
        ):  # FlashInfer's FP4 is compiled only for SM >= 100: plain norm, then our kernel
            assert kw(call, "pattern_code") == AllReduceFusionPattern.kARResidualRMSNorm
            for key in ("quant_out", "scale_out", "scale_factor", "layout_code"):
                assert kw(call, key) is None, key
            _assert_our_kernel_quantized_flashinfers_norm_out(rec, spec, name)
            continue
        assert kw(call, "pattern_code") == AllReduceFusionPattern.kARResidualRMSNormOutFP4Quant
        scale = tensor(kw(call, "scale_factor"))
        assert scale.dtype == torch.float32 and scale.shape == (1,)
        assert torch.equal(scale, torch.tensor([spec.quant.global_scale], dtype=torch.float32))
        expected_layout = {
            SFLayout.SWIZZLED_128x4: QuantizationSFLayout.SWIZZLED_128x4,
            SFLayout.LINEAR: QuantizationSFLayout.LINEAR,
        }[spec.quant.sf_layout]
        assert kw(call, "layout_code") == expected_layout, (name, kw(call, "layout_code"))
        from fusion_bridge.oracle.quant_ref import sf_shape

        q, sf = kw(call, "quant_out"), kw(call, "scale_out")
        assert q["dtype"] == torch.uint8 and q["data"].shape == (case.tokens, spec.hidden_size // 2)
        assert sf["dtype"] == torch.uint8 and sf["data"].shape == sf_shape(
            case.tokens, spec.hidden_size, spec.quant.sf_layout
        )
        assert q["is"] == ["outputs.quant"] and sf["is"] == [
            "outputs.scale"
        ]  # FlashInfer's, returned


# ---- flashinfer_fused -> trtllm_moe_finalize_allreduce_fusion


@pytest.mark.parametrize("name", FF_CASES)
def test_ff_passes_routed_scaling_weight_bias_and_eps(ranks, name):
    spec = CASE_BY_NAME[name].spec
    for rank in range(WORLD):
        call = the_call(ranks, name, rank)
        assert kw(call, "routed_scaling_factor") == spec.routed_scaling_factor != 1.0
        assert kw(call, "weight_bias") == spec.weight_bias != 0.0
        assert kw(call, "eps") == spec.eps
        assert kw(call, "norm_weight")["is"] == ["inputs.gamma"]
        assert kw(call, "residual_in")["is"] == ["inputs.residual"]
        assert kw(call, "allreduce_in")["is"] == ["inputs.gemm2_out"]


@pytest.mark.parametrize("name", FF_CASES)
def test_ff_expert_weights_in_the_activation_dtype_and_callers_untouched(ranks, name):
    """FlashInfer reads expert_scale_factor as the activation dtype without a check: cast first."""
    case = CASE_BY_NAME[name]
    for rank in range(WORLD):
        call, rec = the_call(ranks, name, rank), ranks[rank]["cases"][name]
        got = tensor(call["at_call"]["expert_scale_factor"])
        callers = tensor(rec["inputs"]["expert_weights"])
        assert got.dtype == case.spec.dtype, (name, got.dtype)
        assert got.shape == (case.tokens, case.spec.top_k)
        assert torch.equal(got, callers.to(case.spec.dtype))
        assert callers.dtype == case.weight_dtype and rec["inputs_unchanged"], name


def test_ff_weight_cases_cover_every_dtype_pair():
    pairs = {(CASE_BY_NAME[n].spec.dtype, CASE_BY_NAME[n].weight_dtype) for n in FF_CASES}
    assert pairs >= {
        (a, w) for a in (torch.bfloat16, torch.float16) for w in (torch.float32, torch.bfloat16)
    }


@pytest.mark.parametrize("name", FF_CASES)
def test_ff_index_map_shared_output_rank_and_workspace(ranks, name):
    case = CASE_BY_NAME[name]
    for rank in range(WORLD):
        call, rec = the_call(ranks, name, rank), ranks[rank]["cases"][name]
        perm = kw(call, "expanded_idx_to_permuted_idx")
        assert perm["is"] == [
            "inputs.expanded_idx_to_permuted_idx"
        ]  # top_k comes from its shape [T, K]
        assert perm["dtype"] == torch.int32 and perm["data"].shape == (case.tokens, case.spec.top_k)
        shared = kw(call, "shared_expert_output")
        if case.spec.has_shared_output:
            assert shared["is"] == ["inputs.shared_output"]
        else:
            assert shared is None
        assert kw(call, "world_rank") == rank and kw(call, "world_size") == WORLD
        assert kw(call, "launch_with_pdl") is False
        assert kw(call, "workspace_ptrs")["is"] == [f"workspace{ws_serial(rec)}.workspace_tensor"]
        assert kw(call, "residual_out")["is"] == ["outputs.residual_out"]
        assert kw(call, "norm_out")["is"] == ["outputs.norm_out"]
        res = tensor(rec["outputs"]["residual_out"])
        assert res.shape == (case.tokens, case.spec.hidden_size) and res.dtype == case.spec.dtype
        assert torch.equal(res, _pattern(*res.shape, 1).to(res.dtype))


@pytest.mark.parametrize("name", FF_CASES)
def test_ff_never_hands_quant_buffers_to_flashinfer(ranks, name):
    """flashinfer <= 0.7.4: FlashInfer's fused FP4 in this kernel is broken (never sets the global
    scale)
    and it has no FP8 path; flashinfer_fused quantizes FlashInfer's norm_out with our kernel, on any
    SM."""
    spec = CASE_BY_NAME[name].spec
    for rank in range(WORLD):
        call, rec = the_call(ranks, name, rank), ranks[rank]["cases"][name]
        assert kw(call, "quant_out") is None and kw(call, "scale_out") is None, name
        if spec.quant.kind is QuantKind.NONE:
            assert set(rec["outputs"]) == {"residual_out", "norm_out"}
        else:
            _assert_our_kernel_quantized_flashinfers_norm_out(rec, spec, name)


@pytest.mark.parametrize("name", FF4_CASES)
def test_ff4_hands_flashinfer_the_fp4_buffers_and_returns_what_it_wrote(ranks, name):
    """The point of flashinfer_fused_fp4: FlashInfer quantizes. It gets quant_out [T, H/2] and a
    zeroed
    swizzled scale buffer, and the outputs returned are those buffers."""
    spec, tokens = CASE_BY_NAME[name].spec, CASE_BY_NAME[name].tokens
    for rank in range(WORLD):
        call = the_call(ranks, name, rank)
        q, sf = kw(call, "quant_out"), kw(call, "scale_out")
        assert q is not None and sf is not None, name
        assert tuple(q["data"].shape) == (tokens, spec.hidden_size // 2) and q["is"] == [
            "outputs.quant"
        ]
        assert sf["is"] == ["outputs.scale"] and tuple(sf["data"].shape) == (
            128,
            spec.hidden_size // 16,
        )
        assert not call["at_call"]["scale_out"]["data"].any(), (
            "scale padding not zeroed before FlashInfer"
        )


@pytest.mark.parametrize(
    "version", ["0.7.2.post1", "0.7.4", "0.7.4rc1", "0.7.4.post2", "0.7.3+cu130"]
)
@pytest.mark.parametrize("sm", [90, 100])
def test_flashinfer_fused_fp4_rejected_through_074(version, sm):
    """Only flashinfer_fused_fp4 would hand quant buffers to the MoE-finalize kernel; it is rejected
    for
    flashinfer <= 0.7.4 on every SM, while flashinfer_fused stays admitted for NVFP4 (our kernel
    quantizes)."""
    from fusion_bridge.strategies.flashinfer_fused import FlashInferFusedStrategy
    from fusion_bridge.strategies.flashinfer_fused_fp4 import FlashInferFusedFp4Strategy

    env = env_for(sm).replace(flashinfer_version=version)
    codes = [r.code for r in FlashInferFusedFp4Strategy.not_supported_reasons(S_NVFP4_SW, env)]
    assert "flashinfer_fused_fp4_broken" in codes, codes
    assert ("fp4_needs_sm100" in codes) == (sm < 100), codes
    assert FlashInferFusedStrategy.not_supported_reasons(S_NVFP4_SW, env) == []
    assert FlashInferFusedStrategy.fused_fp4 is False


def test_flashinfer_fused_fp4_gate_is_a_version_gate_not_a_ban():
    """A release after 0.7.4 on SM100 passes the static checks (it must then pass the self-test)."""
    from fusion_bridge.strategies.flashinfer_fused_fp4 import FlashInferFusedFp4Strategy

    env = env_for(100).replace(flashinfer_version="0.7.5")
    assert FlashInferFusedFp4Strategy.not_supported_reasons(S_NVFP4_SW, env) == []


# ---- the workspace


@pytest.mark.parametrize("name", list(CASE_BY_NAME))
def test_workspace_sized_from_the_spec_and_destroyed_on_close(ranks, name):
    spec = CASE_BY_NAME[name].spec
    for rank in range(WORLD):
        rec = ranks[rank]["cases"][name]
        assert len(rec["workspaces"]) == 1, rec["workspaces"]
        (ws,) = rec["workspaces"]
        assert ws["args"] == ()
        assert ws["kwargs"] == {
            "tp_size": WORLD,
            "tp_rank": rank,
            "max_token_num": spec.max_tokens,
            "hidden_dim": spec.hidden_size,
            "dtype": spec.dtype,
        }, ws["kwargs"]
        assert ws["group_is_ours"]
        assert ws["destroyed"] == 1


def test_workspace_shared_between_the_two_strategies_and_freed_by_the_last_close(ranks):
    for rank in range(WORLD):
        assert "sharing" not in ranks[rank]["errors"], ranks[rank]["errors"]["sharing"]
        s = ranks[rank]["sharing"]
        # two workspaces: S_BF16 (shared by local_fused_flashinfer and flashinfer_fused),
        # S_FP16_NO_SHARED
        assert s["made_after_prepare"] == 2, s
        first, second = s["serials"]
        assert s["ptrs_serials"] == [first, first], (
            s
        )  # both strategies call with the same workspace
        assert s["constructor_kwargs"][0]["max_token_num"] == S_BF16.max_tokens
        assert s["constructor_kwargs"][1]["max_token_num"] == S_FP16_NO_SHARED.max_tokens
        assert s["bytes"][0] == s["bytes"][1] > 0
        assert s["destroyed_after_prepare"] == [0, 0]
        assert s["destroyed_after_first_close"] == [0, 0], s  # flashinfer_fused still uses it
        assert s["destroyed_after_second_close"] == [1, 0], s
        assert s["destroyed_after_closing_again"] == [1, 0], s  # close() is idempotent
        assert s["destroyed_after_other_close"] == [1, 1], s
        assert s["made_after_reprepare"] == 3 and s["destroyed_at_end"] == [1, 1, 1], s


# ---- the fake against the installed flashinfer (skipped when it is not installed)


def _real_comm():
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer-python is not installed (the 'flashinfer' extra)")
    import flashinfer.comm

    return flashinfer.comm


def _enum_values(cls) -> dict:
    return {k: v for k, v in vars(cls).items() if not k.startswith("_") and isinstance(v, int)}


def test_fake_enums_match_the_installed_flashinfer():
    real = _real_comm()
    real_patterns = _enum_values(real.AllReduceFusionPattern)
    assert _enum_values(AllReduceFusionPattern).items() <= real_patterns.items()
    real_layouts = _enum_values(real.QuantizationSFLayout)
    assert _enum_values(QuantizationSFLayout).items() <= real_layouts.items()


def test_every_keyword_we_pass_exists_in_flashinfer(ranks):
    """Joins this file to the drift test: what the strategies actually pass (not a list written by
    hand)
    is accepted by the installed signatures, and every parameter without a default is passed."""
    real = _real_comm()
    for fn in ("trtllm_allreduce_fusion", "trtllm_moe_finalize_allreduce_fusion"):
        params = inspect.signature(getattr(real, fn)).parameters
        required = {n for n, p in params.items() if p.default is inspect.Parameter.empty}
        passed = [
            set(c["kw"])
            for r in ranks
            for case in r["cases"].values()
            for c in case["calls"]
            if c["fn"] == fn
        ]
        assert passed, fn
        for keys in passed:
            assert keys <= set(params), (fn, keys - set(params))
            assert required <= keys, (fn, required - keys)
    ws_params = inspect.signature(real.TRTLLMAllReduceFusionWorkspace.__init__).parameters
    for r in ranks:
        for case in r["cases"].values():
            for ws in case["workspaces"]:
                assert set(ws["kwargs"]) | {"group"} <= set(ws_params)


def test_every_flashinfer_case_writes_into_out_and_hands_flashinfer_its_tensors(ranks):
    """`out=` through both FlashInfer strategies: run() returns the caller's out, holding what the
    plain call returned, and FlashInfer writes residual_out and norm_out straight into out's."""
    for rank in range(WORLD):
        for name, rec in ranks[rank]["cases"].items():
            with_out = rec["with_out"]
            assert with_out["is_out"] and with_out["same"], (name, rank, with_out)
            assert with_out["handed"]["residual_out"] == ["residual_out"], (name, with_out)
            assert with_out["handed"]["norm_out"] == ["norm_out"], (name, with_out)
            for key in ("quant_out", "scale_out"):
                if key in with_out["handed"]:
                    want = [key.removesuffix("_out")]  # out.quant / out.scale
                    assert with_out["handed"][key] == want, (name, key, with_out)
