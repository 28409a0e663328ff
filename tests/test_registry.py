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
        "NoStrategyAvailable",
        "__version__",
    }
    assert {"Strategy", "register", "Reason", "Environment", "EpilogueInputs"} <= set(
        fusion_bridge.strategies.__all__
    )
