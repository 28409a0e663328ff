"""Every MoE model type of the installed transformers is supported or refused at patch time with
the structural difference that keeps it off the bridge (fusion_bridge.integrations.hf_families:
`moe_model_types` derives the set from the modeling sources, `refusal_of` decides). Refused types
are checked without building a model; a supported one must have a tiny random model in
migration/examples/hf_moe_models.py, which test_hf_transformers.py runs against the unmodified
model within the bound on 1 and 2 ranks."""

from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusion_bridge.integrations.hf_families import (  # noqa: E402
    BY_TEXT_TYPE,
    BY_WRAPPER_TYPE,
    moe_model_types,
    norm_weight_offset,
    refusal_of,
)
from fusion_bridge.integrations.transformers import (  # noqa: E402
    UnsupportedModelError,
    patch_moe_epilogues,
)
from migration.examples.hf_moe_models import FAMILIES, build_model, why_skipped  # noqa: E402

# what the issue names for the refusals it knows of (a test expectation; the product decides from
# the structure): model type -> the difference its reason must name
EXPECTED_REFUSALS = {
    "phimoe": "LayerNorm, not RMSNorm",
    "dbrx": "LayerNorm, not RMSNorm",
    "llama4": "routing scales the expert input",
    "deepseek_v4": "hyper-connections",
    "glm5_next": "hyper-connections",
    "hy_v4": "hyper-connections",
    "gemma4": "sandwich norms",
    "muse_spark": "post-expert norm",
    "axk1": "a norm inside the MoE block",
    "axk2": "a norm with modules of its own",
    # types sharing a supported modeling file whose own model class differs (5.25 / both stacks)
    "dots3_note_vision_encoder": "not a decoder stack",
    "qwen3_omni_moe_talker_text": "no causal LM runs it from token ids",
}


class _Unbuilt(torch.nn.Module):
    """A stand-in carrying only a config.model_type: a refusal must come before anything else
    of the model is read."""

    def __init__(self, model_type: str) -> None:
        super().__init__()
        self.config = SimpleNamespace(model_type=model_type)


@pytest.fixture(scope="module")
def decided():
    return {t: refusal_of(t) for t in moe_model_types()}


def _tested_types() -> set:
    """Model types a tiny model of hf_moe_models covers (the family's language-model and wrapper
    types), for the families this transformers has."""
    from fusion_bridge.integrations.hf_families import family_of

    covered = set()
    for name in FAMILIES:
        if why_skipped(name) is None:
            family = BY_WRAPPER_TYPE.get(name) or BY_TEXT_TYPE.get(name)
            if family is None:  # a family key that is not itself a model type (none today)
                family = family_of(build_model(name, _SMALL))[0]
            covered |= set(family.model_types) | set(family.wrappers)
    return covered


_SMALL = dict(hidden=64, inter=128, moe_inter=32, shared_inter=64, experts=8, top_k=4, layers=3)
_SMALL.update(vocab=256, heads=4, head_dim=16)


def test_every_moe_model_type_is_supported_and_tested_or_refused_with_its_difference(decided):
    supported = sorted(t for t, why in decided.items() if why is None)
    refused = {t: why for t, why in decided.items() if why is not None}
    no_row = sorted(t for t, why in refused.items() if why.startswith("no row"))
    print(
        f"transformers {transformers.__version__}: {len(decided)} MoE model types; "
        f"{len(supported)} supported {supported}; {len(refused) - len(no_row)} refused for a "
        f"structural difference; {len(no_row)} without a row {no_row}"
    )
    for t, why in sorted(refused.items()):
        print(f"  {t}: {why}")
    # a type without a row is neither supported nor refused for a difference: every MoE type of
    # the installed transformers must be one or the other (a new release's new type fails here)
    assert not no_row, f"MoE model types without a row and without a structural refusal: {no_row}"
    untested = sorted(set(supported) - _tested_types())
    assert not untested, f"supported without a tiny model in hf_moe_models: {untested}"
    for t, expected in EXPECTED_REFUSALS.items():
        if t in decided:
            assert decided[t] is not None and decided[t].startswith(expected), (t, decided[t])
    # the original ten and the families the table added are MoE and supported where present
    for t in ("deepseek_v3", "mixtral", "gpt_oss", "qwen3_next", "olmoe", "ernie4_5_moe"):
        assert decided.get(t, "absent") is None, (t, decided.get(t))


def _refused_types() -> list[str]:
    """Every MoE model type of the installed transformers the patch refuses (one test each)."""
    return sorted(t for t in moe_model_types() if refusal_of(t) is not None)


@pytest.mark.parametrize("model_type", _refused_types())
def test_a_refused_type_is_refused_at_patch_time_with_its_reason_before_anything_is_built(
    model_type,
):
    why = refusal_of(model_type)
    with pytest.raises(UnsupportedModelError) as err:
        patch_moe_epilogues(_Unbuilt(model_type))
    assert f"model_type={model_type!r}" in str(err.value) and why in str(err.value)
    # the reason names a difference, never only the type, nor the missing row alone
    assert why.split(":")[0] and model_type not in why.split(":")[0], why
    assert not why.startswith("no row"), why


def test_the_structural_checks_see_dbrx_llama4_and_jetmoe_without_the_decorator(decided):
    """dbrx, llama4 and jetmoe have experts without use_experts_implementation: found through the
    decoder layer whose MLP has an `experts` submodule."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    for t in ("dbrx", "llama4", "jetmoe"):
        if t in CONFIG_MAPPING_NAMES:
            assert t in decided, t


def test_norm_weight_offset_reads_plain_and_zero_centred_norms_and_engine_classes():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    assert norm_weight_offset(Qwen3MoeRMSNorm) == 0.0
    assert norm_weight_offset(Qwen3NextRMSNorm(8)) == 1.0
    # an engine's class, by its exact qualified name (vLLM / SGLang `layers.layernorm`)
    module = "vllm.model_executor.layers.layernorm"
    engine = type("GemmaRMSNorm", (torch.nn.Module,), {"__module__": module})
    assert norm_weight_offset(engine) == 1.0
    elsewhere = type("GemmaRMSNorm", (torch.nn.Module,), {"__module__": "someone.else"})
    with pytest.raises(UnsupportedModelError, match="cannot tell whether"):
        norm_weight_offset(elsewhere)  # the name alone says nothing

    class Odd(torch.nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(UnsupportedModelError, match="cannot tell whether .*Odd multiplies"):
        norm_weight_offset(Odd)


def test_a_row_not_verified_on_cuda_is_refused_there_by_name_and_runs_on_the_cpu():
    """Rows whose GPU check has not passed (`Family.cuda_refusal`) are refused on a CUDA device,
    before anything is built, and patch on the CPU as every row does."""
    from fusion_bridge.integrations.hf_families import FAMILIES
    from fusion_bridge.integrations.transformers import UnsupportedModelError

    refused = [row for row in FAMILIES if row.cuda_refusal is not None]
    assert {row.name for row in refused} >= {"Mistral-4", "Qwen3-Next"}
    for row in refused:
        row.check_device(torch.device("cpu"))
        with pytest.raises(UnsupportedModelError, match=f"{row.name} is not supported on CUDA"):
            row.check_device(torch.device("cuda", 0))
    for row in FAMILIES:
        if row.cuda_refusal is None:
            row.check_device(torch.device("cuda", 0))
