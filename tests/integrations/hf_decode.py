"""A generate's recorded calls beside one forward over the same tokens: what the decode-step tests
of the logits bound (test_hf_causal_bound.py) and of the delta-rule gain (test_hf_delta_gain.py)
compare."""

from __future__ import annotations

import torch

from migration.examples.hf_moe_bound import Recorder
from migration.examples.hf_moe_models import TINY, build_model

PROMPT = (2, 8)
NEW_TOKENS = 5


def decode_steps_and_one_forward(family: str):
    """family's tiny model (seed 0) generates NEW_TOKENS greedily with a KV cache from a PROMPT of
    seed 1 (a prefill call, then one call per new token), then runs one forward without a cache
    over the same tokens (the prompt and every generated token but the last). -> (model, its
    Recorder (hooks removed), the generate's recorded calls, the forward's recorded call)."""
    model = build_model(family, TINY, seed=0)
    recorder = Recorder(model)
    prompt = torch.randint(1, TINY["vocab"], PROMPT, generator=torch.Generator().manual_seed(1))
    try:
        recorder.start()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        steps = recorder.calls
        recorder.start()
        with torch.no_grad():
            model(out[:, :-1], use_cache=False)
        whole = recorder.calls[0]
    finally:
        recorder.remove()
    return model, recorder, steps, whole
