"""The logits bound of migration/examples/hf_moe_bound.py on inputs the family tests' random
prompts reach only at some sizes: a prompt holding the padding token (its embedding row is zero,
so the first layer's input has norm 0). Tiny random models, bf16, CPU, one rank."""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from migration.examples.hf_moe import TINY, build_model, compare  # noqa: E402
from migration.examples.hf_moe_bound import Recorder, logits_bound  # noqa: E402
from migration.examples.hf_moe_models import why_skipped  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def test_a_prompt_holding_the_padding_token_gets_a_finite_bound_and_passes_it():
    # Mistral4Config's pad_token_id is 11, inside the one-GPU test's random prompts over a
    # 512-token vocabulary (seed 1: sequence 1, position 8): there the first layer's input row is
    # nn.Embedding's zero padding row, and its bound came out NaN (0/0), which the GPU check
    # reported as a NaN logits error
    if why_skipped("mistral4") is not None:
        pytest.skip(f"mistral4: {why_skipped('mistral4')}")
    model = build_model("mistral4", TINY, seed=0)
    pad = model.config.pad_token_id
    assert pad is not None and 0 < pad < TINY["vocab"], pad
    assert float(model.get_input_embeddings().weight[pad].abs().max()) == 0.0
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, TINY["vocab"], (2, 8), generator=g)
    prompt[1, 3] = pad
    summary = compare(model, None, 1, prompt, 2)
    low, high = summary["bound_range"]
    assert math.isfinite(low) and math.isfinite(high), summary["bound_range"]
    assert summary["clean_tokens"] >= summary["tokens"] // 2, summary["routing_flips"]
    assert summary["max_rel_err_over_bound"] <= 1.0, summary["max_rel_err_over_bound"]


def test_a_zero_value_that_carries_an_error_has_no_bound():
    # two tokens; after an MoE layer 0 every value differs, and layer 1's input of token 1 has norm
    # 0: no relative error bounds it, so the bound is NaN there (a check of it fails) and finite
    # for token 0; token 0's zero-error first-layer input stays a zero relative error
    one, zero = torch.ones(2), torch.tensor([1.0, 0.0])
    magnitudes = {0: (torch.tensor([0.0, 1.0]), one, one, one, one), 1: (zero, one, one, one, one)}
    per_hidden, per_logits = logits_bound(magnitudes, [0], 8, 2, {})
    assert math.isfinite(float(per_logits[0])) and math.isfinite(float(per_hidden[0]))
    assert math.isnan(float(per_logits[1])) and math.isnan(float(per_hidden[1]))


def test_a_per_token_gain_and_the_mixers_roundings_enter_only_where_the_input_differs():
    # layer 0 is the MoE layer (every value differs after it); layer 1's token mixer has a
    # derived gain per token: token 1's gain of 1000 and the roundings (u^2 units) enlarge its
    # bound alone; layer 0's mixer sees identical inputs, so its roundings add nothing
    one = torch.ones(2)
    magnitudes = {0: (one, one, one, one, one), 1: (one, one, one, one, one)}
    base = logits_bound(magnitudes, [0], 8, 2, {})[0]
    gains = {1: torch.tensor([1.0, 1000.0])}
    per_token = logits_bound(magnitudes, [0], 8, 2, gains)[0]
    assert float(per_token[0]) == float(base[0]) and float(per_token[1]) > 10 * float(base[1])
    rounded = logits_bound(magnitudes, [0], 8, 2, {}, {1: torch.tensor([0.0, 500.0])})[0]
    assert float(rounded[0]) == float(base[0]) and float(rounded[1]) > 4 * float(base[1])
    untouched = logits_bound(magnitudes, [0], 8, 2, {}, {0: torch.tensor([500.0, 500.0])})[0]
    assert torch.equal(untouched, base)


def test_the_recorder_bounds_a_delta_rule_layer_with_its_derived_gain():
    # Qwen3-Next: gated DeltaNet layers 0 and 2 around full attention; the recorded call carries
    # each DeltaNet layer's derived gain per token, and the bound uses it (a gain of 1 there, the
    # default of a mixer without a MIXER_GAIN row, with the same roundings, gives a smaller bound)
    if why_skipped("qwen3_next") is not None:
        pytest.skip(f"qwen3_next: {why_skipped('qwen3_next')}")
    model = build_model("qwen3_next", TINY, seed=0)
    recorder = Recorder(model)
    prompt = torch.randint(1, TINY["vocab"], (2, 8), generator=torch.Generator().manual_seed(1))
    recorder.start()
    with torch.no_grad():
        model(prompt)
    recorder.remove()
    call = recorder.calls[0]
    assert sorted(call["gain"]) == sorted(recorder.delta) == [0, 2], sorted(call["gain"])
    for gain, roundings in call["gain"].values():
        assert gain.shape == roundings.shape == (prompt.numel(),)
        assert bool(torch.isfinite(gain).all()) and float(gain.min()) >= 1.0
    derived = recorder.bound(call, model, 1)[1]
    call["gain"] = {i: (torch.ones_like(g), r) for i, (g, r) in call["gain"].items()}
    assert bool((recorder.bound(call, model, 1)[1] < derived).all())
