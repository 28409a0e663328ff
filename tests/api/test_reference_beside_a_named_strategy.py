"""The oracle strategy `reference` is prepared whatever strategy the bridge was asked for, so a
named-strategy bridge can still run it (`run_strategy("reference", ...)`, what parity checks and
shadow mode compare against)."""

from fusion_bridge import EpilogueSpec, FusionBridge
from fusion_bridge.oracle.synthetic import make_inputs
from tests import oracle64


def test_a_bridge_built_for_separate_runs_the_reference_too():
    spec = EpilogueSpec(hidden_size=96, top_k=3, routed_scaling_factor=2.0)
    inputs = make_inputs(spec, 5, seed=4)
    with FusionBridge(spec, strategy="separate") as bridge:
        assert "reference" in bridge.prepared
        got = bridge.run_strategy("reference", inputs)
    residual_exact, norm_exact = oracle64.epilogue64_from(spec, [inputs])
    # fp32 throughout, one rounding at each output: within a few bf16 ulps' share of the norm
    assert oracle64.normwise_rel_err(got.residual_out, residual_exact) < 2.0**-8
    assert oracle64.normwise_rel_err(got.norm_out, norm_exact) < 2.0**-8
