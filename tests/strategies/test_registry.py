"""The registry and the shape every strategy declares: its steps cover the epilogue's stages in
order,
each exactly once, whatever the spec and machine."""

import itertools

import pytest

from fusion_bridge import EpilogueSpec, QuantSpec
from fusion_bridge.strategies import REGISTRY, Environment, register
from fusion_bridge.registry import strategy_class, strategy_classes, unregister
from fusion_bridge.strategies.base import required_stages

ENVS = [
    Environment(),
    Environment(
        device_type="cuda",
        sm=90,
        world_size=2,
        flashinfer_version="0.7.2.post1",
        triton_version="3.6.0",
    ),
    Environment(
        device_type="cuda", sm=100, world_size=4, flashinfer_version="0.8.0", triton_version="3.6.0"
    ),
    Environment(device_type="cuda", sm=90, world_size=1, triton_version="3.6.0"),
]
SPECS = [
    EpilogueSpec(hidden_size=h, top_k=8, has_shared_output=s, quant=q)
    for h, s, q in itertools.product(
        (2880, 7168), (True, False), (QuantSpec.none(), QuantSpec.fp8(1.0), QuantSpec.nvfp4(1.0))
    )
]


@pytest.mark.parametrize("env", ENVS)
def test_steps_cover_every_required_stage_once_in_order(env):
    for spec, cls in itertools.product(SPECS, strategy_classes()):
        covered = [stage for step in cls.steps(spec, env) for stage in step.stages]
        assert tuple(covered) == required_stages(spec, env.world_size), (cls.name, spec, env)
        assert all("." in step.name for step in cls.steps(spec, env))


def test_registry_view_is_read_only_and_refuses_silent_overwrite():
    with pytest.raises(TypeError):
        REGISTRY["x"] = "a:b"  # type: ignore[index]
    with pytest.raises(ValueError, match="already registered"):
        register("separate", "fusion_bridge.strategies.separate:SeparateStrategy")
    with pytest.raises(ValueError, match="'module:Class'"):
        register("new", "no_colon")


def test_a_new_strategy_is_one_registry_entry():
    register("separate_again", "tests.strategy_fixture:SeparateAgain")
    try:
        assert strategy_class("separate_again").name == "separate_again"
        assert "separate_again" in REGISTRY
    finally:
        unregister("separate_again")
    assert "separate_again" not in REGISTRY


def test_every_strategy_declares_its_variants_and_a_default_for_every_bucket():
    for spec, env, cls in itertools.product(SPECS, ENVS, strategy_classes()):
        variants = cls.variants(spec, env)
        assert variants and len(set(variants)) == len(variants), cls.name
        for tokens in (1, 2, 7, 64, 4096, None):
            assert cls.default_variant(spec, env, tokens) in variants, (cls.name, tokens)


def test_the_public_surfaces_are_small():
    import fusion_bridge
    import fusion_bridge.strategies

    assert set(fusion_bridge.__all__) == {
        "FusionBridge",
        "EpilogueSpec",
        "QuantSpec",
        "EpilogueOutputs",
        "EpilogueInputError",
        "ConcurrentCallError",
        "NoStrategyAvailable",
        "tensor_digest",  # the digest ranks compare (the Hugging Face adapter's checks use it)
        "check_in",  # the bounded arrival before a collective setup (the adapter's model check)
        "__version__",
    }
    assert {"Strategy", "register", "Reason", "Environment", "EpilogueInputs"} <= set(
        fusion_bridge.strategies.__all__
    )


def test_readme_static_order_is_the_registry_order():
    import re
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    m = re.search(
        r"the static order is the registry order of the strategies auto may pick: ([^(]+)", text
    )
    assert m, "the README's static-order sentence is gone"
    listed = [name.strip() for name in m.group(1).split(",")]
    auto = [c.name for c in strategy_classes() if c.auto_selectable and not c.opt_in]
    assert listed == auto


def test_a_strategy_brings_its_own_environment_probe():
    """One class and one registry line: detect() runs its probe, its checks read the value, and a
    hand-built Environment stands for a machine set up as documented."""
    from fusion_bridge import EpilogueSpec
    from fusion_bridge.environment import detect
    from fusion_bridge.plan.planner import static_statuses
    from fusion_bridge.registry import environment_probes

    spec = EpilogueSpec(hidden_size=64, top_k=2)
    assert "fixture_flag" not in environment_probes()
    register("probed_separate", "tests.strategy_fixture:ProbedSeparate")
    try:
        assert environment_probes()["fixture_flag"].read() == "read from this process"
        env = detect(probe_flashinfer=False)
        assert env.probes["fixture_flag"] == "read from this process"
        assert env.to_dict()["fixture_flag"] == "read from this process"

        def codes(e):
            return next(s for s in static_statuses(spec, e) if s.name == "probed_separate").reasons

        assert [r.code for r in codes(env)] == ["fixture_flag_not_ok"]
        assert codes(Environment()) == ()  # documented value: "ok"
        assert codes(Environment(probes={"fixture_flag": "ok"})) == ()
    finally:
        unregister("probed_separate")


def test_probe_names_cannot_shadow_environment_fields():
    with pytest.raises(ValueError, match="clash with Environment fields"):
        Environment(probes={"world_size": 3})
