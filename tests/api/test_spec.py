"""EpilogueSpec / QuantSpec check types and finiteness, name the field, expected and actual value,
and
normalise numbers so to_dict() is the same JSON on every rank."""

import json
import math

import pytest
import torch

from fusion_bridge.spec import EpilogueSpec, QuantKind, QuantSpec, SFLayout

OK = dict(hidden_size=64, top_k=2)
RSF = (
    "routed_scaling_factor must be a positive float <= 1024 (models scale the routed sum by a "
    "small positive factor; a larger one overflows bf16/fp16 partials), got "
)
EPS = (
    "eps must be a positive float in [1.18e-38, 1] (a normal fp32 number; an eps that is 0 in "
    "fp32 turns an all-zero row into NaN, one above 1 outweighs the mean square it regularises), "
    "got "
)

BAD_SPECS = [
    (
        dict(routed_scaling_factor="2"),
        RSF + "'2' (a str)",
    ),
    (
        dict(routed_scaling_factor=float("nan")),
        RSF + "nan",
    ),
    (
        dict(routed_scaling_factor=float("-inf")),
        RSF + "-inf",
    ),
    (
        dict(routed_scaling_factor=True),
        RSF + "True (a bool)",
    ),
    (
        dict(eps=float("inf")),
        EPS + "inf",
    ),
    (
        dict(eps=float("nan")),
        EPS + "nan",
    ),
    (
        dict(eps=0.0),
        EPS + "0.0",
    ),
    (
        dict(eps=-1e-6),
        EPS + "-1e-06",
    ),
    (
        dict(eps="1e-6"),
        EPS + "'1e-6' (a str)",
    ),
    (dict(eps=1.5), EPS + "1.5"),
    (dict(eps=3.4e38), EPS + "3.4e+38"),
    (dict(routed_scaling_factor=-3.4e38), RSF + "-3.4e+38"),
    (dict(routed_scaling_factor=0.0), RSF + "0.0"),
    (dict(routed_scaling_factor=2000), RSF + "2000"),
    (dict(eps=10**400), EPS + "an int of 1329 bits (too large for a float)"),
    (
        dict(weight_bias=float("inf")),
        "weight_bias must be a float of magnitude <= 3.4e+38 (finite in fp32), got inf",
    ),
    (
        dict(weight_bias=None),
        "weight_bias must be a float of magnitude <= 3.4e+38 (finite in fp32), got None (a "
        "NoneType)",
    ),
    (dict(hidden_size=True), "hidden_size must be a positive int, got True (a bool)"),
    (dict(hidden_size=64.0), "hidden_size must be a positive int, got 64.0 (a float)"),
    (dict(hidden_size="64"), "hidden_size must be a positive int, got '64' (a str)"),
    (dict(top_k=False), "top_k must be a positive int, got False (a bool)"),
    (dict(top_k=-2), "top_k must be a positive int, got -2"),
    (dict(max_tokens=8192.0), "max_tokens must be a positive int, got 8192.0 (a float)"),
    (dict(has_shared_output=1), "has_shared_output must be a bool (True or False), got 1 (an int)"),
    (dict(dtype="bf16"), "dtype must be torch.bfloat16 or torch.float16, got 'bf16'"),
    (dict(dtype=torch.float32), "dtype must be torch.bfloat16 or torch.float16, got torch.float32"),
    (dict(quant="fp8"), "quant must be a QuantSpec, got 'str'"),
]


@pytest.mark.parametrize(
    "change,message", BAD_SPECS, ids=[m.split(" must")[0] + ":" + repr(c) for c, m in BAD_SPECS]
)
def test_a_bad_spec_value_names_the_field_expected_and_actual(change, message):
    with pytest.raises(ValueError) as err:
        EpilogueSpec(**{**OK, **change})
    assert str(err.value) == f"EpilogueSpec: {message}"


BAD_QUANTS = [
    (
        lambda: QuantSpec.fp8("2"),
        "quant.scale must be a positive float in [1.18e-38, 3.4e+38] (a normal fp32 number) for "
        "fp8, got '2' (a str)",
    ),
    (
        lambda: QuantSpec.fp8(float("inf")),
        "quant.scale must be a positive float in [1.18e-38, 3.4e+38] (a normal fp32 number) for "
        "fp8, got inf",
    ),
    (
        lambda: QuantSpec.fp8(float("nan")),
        "quant.scale must be a positive float in [1.18e-38, 3.4e+38] (a normal fp32 number) for "
        "fp8, got nan",
    ),
    (
        lambda: QuantSpec.fp8(0.0),
        "quant.scale must be a positive float in [1.18e-38, 3.4e+38] (a normal fp32 number) for "
        "fp8, got 0.0",
    ),
    (
        lambda: QuantSpec.fp8(True),
        "quant.scale must be a positive float in [1.18e-38, 3.4e+38] (a normal fp32 number) for "
        "fp8, got True (a bool)",
    ),
    (
        lambda: QuantSpec.nvfp4(-448.0),
        "quant.global_scale must be a positive float in [1.18e-38, 3.4e+38] (a normal fp32 number) "
        "for nvfp4, got -448.0",
    ),
    (
        lambda: QuantSpec.nvfp4(float("inf")),
        "quant.global_scale must be a positive float in [1.18e-38, 3.4e+38] (a normal fp32 number) "
        "for nvfp4, got inf",
    ),
    (
        lambda: QuantSpec.nvfp4(448.0, "rowwise"),
        "quant.sf_layout must be one of 'swizzled_128x4', 'linear', got 'rowwise'",
    ),
    (
        lambda: QuantSpec("int8"),
        (
            "quant.kind must be one of 'none', 'fp8', 'nvfp4', 'fp8_per_token_group', "
            "'fp8_per_token', got 'int8'"
        ),
    ),
    (
        lambda: QuantSpec(QuantKind.NONE, scale=0.5),
        "quant.scale must be None for kind 'none', got 0.5",
    ),
    (
        lambda: QuantSpec(QuantKind.FP8, scale=0.5, global_scale=448.0),
        "quant.global_scale must be None for kind 'fp8', got 448.0",
    ),
]


@pytest.mark.parametrize("make,message", BAD_QUANTS, ids=[m.split(",")[0] for _, m in BAD_QUANTS])
def test_a_bad_quant_value_names_the_field_expected_and_actual(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert str(err.value) == f"EpilogueSpec: {message}"


def test_numbers_are_normalised_so_to_dict_is_the_same_json_for_2_and_2_0():
    a = EpilogueSpec(
        hidden_size=64,
        top_k=2,
        routed_scaling_factor=2,
        weight_bias=1,
        eps=1,
        quant=QuantSpec.fp8(1),
    )
    b = EpilogueSpec(
        hidden_size=64,
        top_k=2,
        routed_scaling_factor=2.0,
        weight_bias=1.0,
        eps=1.0,
        quant=QuantSpec.fp8(1.0),
    )
    assert a == b and json.dumps(a.to_dict()) == json.dumps(b.to_dict())
    assert type(a.routed_scaling_factor) is float and type(a.quant.scale) is float


def test_to_dict_is_stable():
    spec = EpilogueSpec(
        hidden_size=7168,
        top_k=8,
        dtype=torch.float16,
        eps=1e-5,
        weight_bias=1.0,
        routed_scaling_factor=2.5,
        has_shared_output=False,
        quant=QuantSpec.nvfp4(336.0, SFLayout.LINEAR),
        max_tokens=256,
    )
    assert spec.to_dict() == {
        "hidden_size": 7168,
        "top_k": 8,
        "dtype": "fp16",
        "eps": 1e-5,
        "weight_bias": 1.0,
        "routed_scaling_factor": 2.5,
        "has_shared_output": False,
        "max_tokens": 256,
        "shared_output_replicated": False,
        "quant": {"kind": "nvfp4", "scale": None, "global_scale": 336.0, "sf_layout": "linear"},
    }
    assert EpilogueSpec(hidden_size=64, top_k=2).to_dict()["quant"] == {
        "kind": "none",
        "scale": None,
        "global_scale": None,
        "sf_layout": "swizzled_128x4",
    }


def test_good_values_of_other_numeric_types_are_accepted():
    import fractions

    spec = EpilogueSpec(
        hidden_size=torch.tensor(64).item(), top_k=2, routed_scaling_factor=fractions.Fraction(5, 2)
    )
    assert spec.routed_scaling_factor == 2.5 and not math.isnan(spec.eps)
