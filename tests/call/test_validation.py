"""Bad inputs get a clear error naming the argument, the expected and the actual value, and the
caller's tensors are left unchanged."""

import re
import dataclasses

import pytest
import torch

from fusion_bridge import EpilogueInputError, EpilogueSpec, FusionBridge, QuantSpec
from fusion_bridge.oracle.synthetic import make_inputs
from tests.helpers import clone_inputs, inputs_equal
from fusion_bridge.call.validation import input_check

SPEC = EpilogueSpec(hidden_size=64, top_k=2)


def _perm_with(value):
    def change(i):
        p = i.expanded_idx_to_permuted_idx.clone()
        p[1, 0] = value
        return {"expanded_idx_to_permuted_idx": p}

    return change


def _strided(t):
    """The same values, every other element of a twice-as-wide last dimension."""
    return torch.stack([t, t], -1).flatten(-2)[..., ::2]


BAD_INPUTS = [
    ("gemm2_out fp32", lambda i: {"gemm2_out": i.gemm2_out.float()}, "gemm2_out.dtype"),
    (
        "gemm2_out wrong hidden",
        lambda i: {"gemm2_out": i.gemm2_out[:, :32].contiguous()},
        "gemm2_out.shape",
    ),
    ("gemm2_out 1-D", lambda i: {"gemm2_out": i.gemm2_out.reshape(-1)}, "gemm2_out must be a 2-D"),
    (
        "gemm2_out not a tensor",
        lambda i: {"gemm2_out": i.gemm2_out.tolist()},
        "gemm2_out must be a 2-D",
    ),
    (
        "index map int64",
        lambda i: {"expanded_idx_to_permuted_idx": i.expanded_idx_to_permuted_idx.long()},
        "expanded_idx_to_permuted_idx.dtype",
    ),
    (
        "index map wrong top_k",
        lambda i: {"expanded_idx_to_permuted_idx": torch.zeros(5, 3, dtype=torch.int32)},
        "top_k",
    ),
    (
        "index map 1-D",
        lambda i: {"expanded_idx_to_permuted_idx": i.expanded_idx_to_permuted_idx.reshape(-1)},
        "2-D [T, top_k]",
    ),
    ("index past gemm2_out rows", _perm_with(10_000), "in [-1, 13)"),
    ("index equal to P (one past the last row)", _perm_with(13), "in [-1, 13)"),
    ("index below -1", _perm_with(-2), "in [-1, 13)"),
    (
        "weights wrong T",
        lambda i: {"expert_weights": i.expert_weights[:4].contiguous()},
        "expert_weights.shape",
    ),
    (
        "weights int",
        lambda i: {"expert_weights": i.expert_weights.to(torch.int32)},
        "expert_weights.dtype",
    ),
    # strided tensors: the kernels index every input as contiguous (mutants killed: the hot-path
    # check forgetting one tensor's contiguity, which would read the wrong elements)
    ("gemm2_out strided", lambda i: {"gemm2_out": _strided(i.gemm2_out)}, "contiguous"),
    (
        "index map strided",
        lambda i: {"expanded_idx_to_permuted_idx": _strided(i.expanded_idx_to_permuted_idx)},
        "contiguous",
    ),
    ("weights strided", lambda i: {"expert_weights": _strided(i.expert_weights)}, "contiguous"),
    (
        "weights transposed layout",
        lambda i: {"expert_weights": i.expert_weights.t().contiguous().t()},
        "contiguous",
    ),
    ("shared strided", lambda i: {"shared_output": _strided(i.shared_output)}, "contiguous"),
    ("shared fp32", lambda i: {"shared_output": i.shared_output.float()}, "shared_output.dtype"),
    ("gamma strided", lambda i: {"gamma": _strided(i.gamma)}, "contiguous"),
    ("gamma fp32", lambda i: {"gamma": i.gamma.float()}, "gamma.dtype"),
    ("shared missing", lambda i: {"shared_output": None}, "shared_output must be a tensor"),
    (
        "shared wrong T",
        lambda i: {"shared_output": i.shared_output[:3].contiguous()},
        "shared_output.shape",
    ),
    ("residual fp16", lambda i: {"residual": i.residual.half()}, "residual.dtype"),
    (
        "residual strided",
        lambda i: {"residual": _strided(i.residual)},
        "contiguous",
    ),
    (  # T is what most [T, ...] inputs agree on: the one odd tensor is named
        "residual wrong T",
        lambda i: {"residual": i.residual[:4].contiguous()},
        "residual.shape must be [5,",
    ),
    (
        "residual on another device",
        lambda i: {"residual": i.residual.to("meta")},
        "residual.device",
    ),
    ("gamma wrong length", lambda i: {"gamma": i.gamma[:63].contiguous()}, "gamma.shape"),
    ("gamma not a tensor", lambda i: {"gamma": 1.0}, "gamma must be a torch.Tensor"),
]


@pytest.fixture(scope="module")
def bridge():
    """The default path: no debug mode (conftest clears FUSION_BRIDGE_DEBUG). On CPU the index
    values
    are checked anyway."""
    with FusionBridge(SPEC) as b:
        assert not b.debug
        yield b


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_clearly_and_changes_nothing(bridge, case):
    _, change, message = case
    good = make_inputs(SPEC, 5, padding_rows=3)
    bad = good._replace(**change(good))
    before = clone_inputs(good)
    with pytest.raises(EpilogueInputError, match="finalize_epilogue: ") as err:
        bridge.finalize_epilogue(
            bad.gemm2_out,
            bad.expanded_idx_to_permuted_idx,
            bad.expert_weights,
            bad.shared_output,
            bad.residual,
            bad.gamma,
        )
    assert message in str(err.value) and "got" in str(err.value)
    assert inputs_equal(good, before)


@pytest.mark.parametrize(
    "case",
    [c for c in BAD_INPUTS if not c[0].startswith("index ")],
    ids=[c[0] for c in BAD_INPUTS if not c[0].startswith("index ")],
)
def test_the_hot_path_check_rejects_every_bad_metadata_case(case):
    good = make_inputs(SPEC, 5, padding_rows=3)
    check = input_check(SPEC, torch.device("cpu"))
    assert check(good)
    bad = good._replace(**case[1](good))
    if "strided" in case[0]:
        assert inputs_equal(bad, good)  # the same values: only the layout is wrong
    assert not check(bad)


def test_shared_output_given_when_spec_has_none():
    spec = dataclasses.replace(SPEC, has_shared_output=False)
    inp = make_inputs(SPEC, 2)
    with (
        FusionBridge(spec) as b,
        pytest.raises(EpilogueInputError, match="shared_output must be None"),
    ):
        b.finalize_epilogue(
            inp.gemm2_out,
            inp.expanded_idx_to_permuted_idx,
            inp.expert_weights,
            inp.shared_output,
            inp.residual,
            inp.gamma,
        )


def test_a_good_call_leaves_every_input_unchanged(bridge):
    good = make_inputs(SPEC, 7)
    before = clone_inputs(good)
    out = bridge.finalize_epilogue(
        good.gemm2_out,
        good.expanded_idx_to_permuted_idx,
        good.expert_weights,
        good.shared_output,
        good.residual,
        good.gamma,
    )
    assert inputs_equal(good, before) and out.residual_out.data_ptr() != good.residual.data_ptr()


BAD_SPECS = [
    (dict(hidden_size=0, top_k=8), "hidden_size must be a positive int, got 0"),
    (dict(hidden_size=64, top_k=0), "top_k must be a positive int, got 0"),
    (
        dict(hidden_size=64, top_k=2, dtype=torch.float32),
        "dtype must be torch.bfloat16 or torch.float16",
    ),
    (
        dict(hidden_size=72, top_k=2, quant=QuantSpec.nvfp4(1.0)),
        "a multiple of 16 for nvfp4, got 72",
    ),
    (dict(hidden_size=64, top_k=2, max_tokens=0), "max_tokens must be a positive int, got 0"),
    (dict(hidden_size=64, top_k=2, eps=0.0), "eps must be a positive float"),
]


@pytest.mark.parametrize("kwargs,message", BAD_SPECS)
def test_bad_spec_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match="EpilogueSpec: ") as err:
        EpilogueSpec(**kwargs)
    assert message in str(err.value)


def test_bad_quant_scales_and_strategy_names():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "quant.scale must be a positive float in [1.18e-38, 3.4e+38] (a normal fp32 number) "
            "for fp8, got -1.0"
        ),
    ):
        QuantSpec.fp8(-1.0)
    with pytest.raises(ValueError, match="quant.global_scale"):
        QuantSpec.nvfp4(float("nan"))
    with pytest.raises(ValueError, match="strategy must be 'auto' or one of"):
        FusionBridge(SPEC, strategy="fastest")
    with pytest.raises(TypeError, match="spec must be an EpilogueSpec"):
        FusionBridge({"hidden_size": 64})


def test_index_bounds_are_inclusive_of_minus_one_and_p_minus_one(bridge):
    """-1 (skip) and P-1 (the last row) are valid; P and -2 are not (the cases above)."""
    good = make_inputs(SPEC, 5, padding_rows=3)
    rows = good.gemm2_out.shape[0]
    perm = good.expanded_idx_to_permuted_idx.clone()
    perm[0, 0], perm[0, 1] = -1, rows - 1
    gemm2_out = good.gemm2_out.clone()
    gemm2_out[rows - 1] = 1.0  # was padding (NaN); now read
    out = bridge(
        gemm2_out, perm, good.expert_weights, good.shared_output, good.residual, good.gamma
    )
    assert torch.isfinite(out.norm_out).all()


def test_debug_mode_comes_from_the_argument_or_the_variable(monkeypatch):
    with FusionBridge(SPEC) as b:
        assert not b.debug
    with FusionBridge(SPEC, debug=True) as b:
        assert b.debug
    monkeypatch.setenv("FUSION_BRIDGE_DEBUG", "1")
    with FusionBridge(SPEC) as b:
        assert b.debug
        good = make_inputs(SPEC, 5, padding_rows=3)  # debug mode checks index values too
        bad = good._replace(**_perm_with(13)(good))
        with pytest.raises(EpilogueInputError, match=r"in \[-1, 13\)"):
            b(*bad)
    monkeypatch.setenv("FUSION_BRIDGE_DEBUG", "0")
    with FusionBridge(SPEC) as b:
        assert not b.debug
