"""The static gate on FlashInfer's fused FP4 (MoE-finalize kernel): rejected for every release
through
0.7.4, whose MoE-finalize sources are byte-identical to the 0.7.2.post1 we measured writing all-zero
FP4 on H200; a later release passes the gate and is left to the self-test. Pure Environment values,
no GPU and no FlashInfer import."""

import pytest

from fusion_bridge.environment import Environment
from fusion_bridge.registry import strategy_class
from fusion_bridge.spec import EpilogueSpec, QuantSpec
from fusion_bridge.strategies.flashinfer_common import (
    FP4_FUSION_BROKEN_THROUGH,
    fp4_fusion_reasons,
    release_of,
)

NVFP4 = EpilogueSpec(hidden_size=7168, top_k=8, quant=QuantSpec.nvfp4(336.0))
B200 = Environment(
    device_type="cuda", sm=100, gpu_name="NVIDIA B200", world_size=2, triton_version="3.6.0"
)
H200 = B200.replace(sm=90, gpu_name="NVIDIA H200")
BROKEN = "flashinfer_fused_fp4_broken"

KNOWN_BROKEN = [
    "0.6.0",
    "0.7.2",
    "0.7.2.post1",
    "0.7.3",
    "0.7.4",
    "0.7.4rc1",
    "0.7.4.dev2",
    "0.7.4.post1",
    "0.7.4+cu130",
    "not-a-version",
]
LATER = ["0.7.5", "0.7.5rc1", "0.8.0", "0.8.1.post1", "1.0.0"]


def codes(reasons):
    return [r.code for r in reasons]


def test_the_gate_reaches_0_7_4():
    assert FP4_FUSION_BROKEN_THROUGH == (0, 7, 4)


@pytest.mark.parametrize("version", KNOWN_BROKEN)
def test_known_broken_releases_are_rejected_on_sm100(version):
    reasons = fp4_fusion_reasons(
        NVFP4, B200.replace(flashinfer_version=version), "flashinfer_fused_fp4"
    )
    assert codes(reasons) == [BROKEN]
    assert "through 0.7.4" in reasons[0].message and version in reasons[0].message
    assert "self-test" in reasons[0].hint


@pytest.mark.parametrize("version", KNOWN_BROKEN)
def test_known_broken_releases_are_rejected_on_sm90_with_both_reasons(version):
    reasons = fp4_fusion_reasons(
        NVFP4, H200.replace(flashinfer_version=version), "flashinfer_fused_fp4"
    )
    assert codes(reasons) == [BROKEN, "fp4_needs_sm100"]


@pytest.mark.parametrize("version", LATER)
def test_later_releases_pass_the_static_gate_on_sm100(version):
    assert (
        fp4_fusion_reasons(NVFP4, B200.replace(flashinfer_version=version), "flashinfer_fused_fp4")
        == []
    )


@pytest.mark.parametrize("version", LATER)
def test_later_releases_still_need_sm100(version):
    assert codes(fp4_fusion_reasons(NVFP4, H200.replace(flashinfer_version=version), "x")) == [
        "fp4_needs_sm100"
    ]


def test_no_flashinfer_is_not_this_gates_business():
    # flashinfer missing is reported by the common checks (flashinfer_missing), not as "broken"
    assert fp4_fusion_reasons(NVFP4, B200, "x") == []


@pytest.mark.parametrize(
    "version,release",
    [
        ("0.7.4", (0, 7, 4)),
        ("0.7.4rc1", (0, 7, 4)),
        ("0.7.4.post1", (0, 7, 4)),
        ("0.7.2.post1", (0, 7, 2)),
        ("0.8", (0, 8, 0)),
        ("1.2.3+cu130", (1, 2, 3)),
        ("dev", None),
    ],
)
def test_release_of(version, release):
    assert release_of(version) == release


def test_the_strategy_uses_the_gate_and_leaves_later_versions_to_the_self_test():
    cls = strategy_class("flashinfer_fused_fp4")
    assert BROKEN in codes(
        cls.not_supported_reasons(NVFP4, B200.replace(flashinfer_version="0.7.4"))
    )
    assert cls.not_supported_reasons(NVFP4, B200.replace(flashinfer_version="0.8.0")) == []
    assert (
        cls.self_tested
    )  # admitted statically, then judged against the oracle when the bridge is built
