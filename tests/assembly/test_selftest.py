"""The self-test, called directly on CPU (the bridge runs it only on CUDA): a correct strategy
passes,
a strategy computing another function is rejected with `self_test_mismatch`, one that raises with
`self_test_error`."""

import dataclasses

import pytest
import torch

from fusion_bridge import EpilogueSpec, QuantSpec
from fusion_bridge.environment import Environment
from fusion_bridge.assembly.selftest import self_test
from fusion_bridge.strategies.separate import SeparateStrategy

SPECS = [
    EpilogueSpec(hidden_size=96, top_k=2, weight_bias=0.5, routed_scaling_factor=2.5),
    EpilogueSpec(hidden_size=96, top_k=2, quant=QuantSpec.nvfp4(448.0)),
    EpilogueSpec(hidden_size=96, top_k=2, quant=QuantSpec.fp8(0.02)),
]


class DropsWeightBias(SeparateStrategy):
    """`separate` normalizing with gamma instead of gamma + weight_bias."""

    name = "drops_weight_bias"

    def run(self, inputs):
        spec = self.spec
        self.spec = dataclasses.replace(spec, weight_bias=0.0)
        try:
            return super().run(inputs)
        finally:
            self.spec = spec


class ZeroQuant(SeparateStrategy):
    """Writes all-zero quantized output (what FlashInfer's fused FP4 does on SM90)."""

    name = "zero_quant"

    def run(self, inputs):
        out = super().run(inputs)
        return (
            dataclasses.replace(out, quant=torch.zeros_like(out.quant))
            if out.quant is not None
            else out
        )


class SlightlyOff(SeparateStrategy):
    """norm_out 5% too large: small, but far above separate's bound (sqrt(3)*2^-8 = 6.8e-3)."""

    name = "slightly_off"

    def run(self, inputs):
        out = super().run(inputs)
        return dataclasses.replace(out, norm_out=out.norm_out * 1.05)


class Raises(SeparateStrategy):
    name = "raises"

    def run(self, inputs):
        raise RuntimeError("kernel exploded")


def _run(cls, spec):
    return self_test(cls(spec, Environment()), spec, rank=0)


@pytest.mark.parametrize("spec", SPECS, ids=["plain", "nvfp4", "fp8"])
def test_a_correct_strategy_passes(spec):
    result = _run(SeparateStrategy, spec)
    assert result.passed and result.reason is None
    assert 0 < result.worst_rel_err <= max(SeparateStrategy.error_bound(spec, Environment()), 0.2)


@pytest.mark.parametrize(
    "cls,spec",
    [
        (DropsWeightBias, SPECS[0]),
        (SlightlyOff, SPECS[0]),
        (ZeroQuant, SPECS[1]),
        (ZeroQuant, SPECS[2]),
    ],
    ids=["drops_weight_bias", "slightly_off", "zero_nvfp4", "zero_fp8"],
)
def test_a_wrong_strategy_is_rejected_with_the_measured_error(cls, spec):
    result = _run(cls, spec)
    assert not result.passed and result.reason.code == "self_test_mismatch"
    assert "rel_err" in result.reason.message and "bound" in result.reason.message
    assert result.worst_rel_err > 0.04


def test_a_strategy_that_raises_is_rejected_not_propagated():
    result = _run(Raises, SPECS[0])
    assert not result.passed and result.reason.code == "self_test_error"
    assert "kernel exploded" in result.reason.message
