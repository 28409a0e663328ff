"""The dynamic FP8 kinds of QuantSpec: their constructors, the fields each kind uses, the refusals
(UE8M0 / MXFP8 with the reason, H % group_size at EpilogueSpec construction) and to_dict."""

from __future__ import annotations

import pytest
import torch

from fusion_bridge.spec import EpilogueSpec, QuantKind, QuantSpec, ScaleLayout


def test_constructors_and_defaults() -> None:
    q = QuantSpec.fp8_per_token_group()
    assert q.kind is QuantKind.FP8_PER_TOKEN_GROUP and q.kind.value == "fp8_per_token_group"
    assert q.group_size == 128 and q.scale_layout is ScaleLayout.ROW_MAJOR
    assert q.scale is None and q.global_scale is None
    q = QuantSpec.fp8_per_token_group(64, "column_major_tma")
    assert q.group_size == 64 and q.scale_layout is ScaleLayout.COLUMN_MAJOR_TMA
    p = QuantSpec.fp8_per_token()
    assert p.kind is QuantKind.FP8_PER_TOKEN and p.kind.value == "fp8_per_token"
    assert p.group_size is None and p.scale_layout is None
    assert [m.value for m in ScaleLayout] == ["row_major", "column_major", "column_major_tma"]
    assert QuantSpec("fp8_per_token_group", group_size=16, scale_layout="column_major") == (
        QuantSpec.fp8_per_token_group(16, ScaleLayout.COLUMN_MAJOR)
    )


@pytest.mark.parametrize(
    "fields,named,expected",
    [
        (dict(kind="fp8_per_token", group_size=128), "quant.group_size", "None for kind"),
        (dict(kind="fp8_per_token", scale_layout="row_major"), "quant.scale_layout", "None"),
        (dict(kind="fp8", scale=1.0, group_size=128), "quant.group_size", "None for kind 'fp8'"),
        (dict(kind="none", scale_layout="column_major"), "quant.scale_layout", "None for kind"),
        (
            dict(kind="fp8_per_token_group", group_size=100, scale_layout="row_major"),
            "quant.group_size",
            "a power of two",
        ),
        (
            dict(kind="fp8_per_token_group", group_size=True, scale_layout="row_major"),
            "quant.group_size",
            "a power of two",
        ),
        (
            dict(kind="fp8_per_token_group", group_size=128, scale_layout="diagonal"),
            "quant.scale_layout",
            "'row_major', 'column_major', 'column_major_tma'",
        ),
        (
            dict(kind="fp8_per_token_group", group_size=128, scale_layout=None),
            "quant.scale_layout",
            "one of",
        ),
        (dict(kind="fp8_per_token_group", scale_layout="row_major"), "quant.group_size", "power"),
        (dict(kind="fp8_per_token", scale=2.0), "quant.scale", "None for kind"),
    ],
)
def test_fields_a_kind_does_not_use_or_bad_values(fields: dict, named: str, expected: str) -> None:
    with pytest.raises(ValueError) as e:
        QuantSpec(**fields)
    assert named in str(e.value) and expected in str(e.value) and "got" in str(e.value)


@pytest.mark.parametrize(
    "fields",
    [
        dict(kind="mxfp8"),
        dict(kind="MXFP8"),
        dict(kind="fp8_per_token_group", group_size=128, scale_layout="column_major_tma_ue8m0"),
        dict(kind="fp8_per_token_group", group_size=128, scale_layout="ue8m0_packed"),
        dict(kind="fp8_per_token", scale_layout="ue8m0"),
    ],
)
def test_blackwell_formats_refused_with_the_reason(fields: dict) -> None:
    with pytest.raises(ValueError, match="Blackwell formats with no Hopper consumer"):
        QuantSpec(**fields)


def test_hidden_size_not_a_multiple_of_the_group_is_refused() -> None:
    with pytest.raises(ValueError) as e:
        EpilogueSpec(hidden_size=192, top_k=2, quant=QuantSpec.fp8_per_token_group(128))
    text = str(e.value)
    assert "hidden_size" in text and "group_size" in text and "192" in text and "128" in text
    EpilogueSpec(hidden_size=192, top_k=2, quant=QuantSpec.fp8_per_token_group(64))
    EpilogueSpec(hidden_size=192, top_k=2, quant=QuantSpec.fp8_per_token())  # any H


def test_to_dict_carries_the_new_fields() -> None:
    spec = EpilogueSpec(
        hidden_size=256, top_k=2, dtype=torch.float16, quant=QuantSpec.fp8_per_token_group(64)
    )
    quant = spec.to_dict()["quant"]
    assert spec.to_dict()["dtype"] == "fp16"
    assert quant["kind"] == "fp8_per_token_group"
    assert quant["group_size"] == 64 and quant["scale_layout"] == "row_major"
    quant = EpilogueSpec(hidden_size=256, top_k=2).to_dict()["quant"]
    assert "group_size" not in quant and "scale_layout" not in quant  # the dict it had before
