"""Issue 54 items 4 and 5 on one rank, in this process, with real tiny transformers models, and
FusionBridge.fail_call on one rank:

  4  a forward hook that edits an MoE layer's output in place (activation steering, `out.add_(v)`)
     is seen by the next norm, which computes itself again from what the tensor holds now (the
     handoff compares the tensor's version counter; under torch.inference_mode the bridge writes
     into tensors made outside it, which have one);
  5  autograd through a patched model is refused before any work, saying how to run, unless
     nothing the bridge would see requires grad.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")

from fusion_bridge import EpilogueSpec, FusionBridge  # noqa: E402
from fusion_bridge.integrations.transformers import patch_moe_epilogues  # noqa: E402
from migration.examples.hf_moe import TINY, build_model  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _prompt(seed: int = 2) -> torch.Tensor:
    return torch.randint(1, TINY["vocab"], (2, 6), generator=torch.Generator().manual_seed(seed))


def _output(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_4_the_next_norm_sees_an_in_place_edit_by_a_forward_hook(mode):
    model = build_model("qwen3_moe", TINY)  # MoE layers 0 and 2; layer 0 feeds layer 1's norm
    patch = patch_moe_epilogues(model)
    steer = (0.5 * torch.randn(TINY["hidden"], generator=torch.Generator().manual_seed(9))).to(
        torch.bfloat16
    )
    layer = model.model.layers[0]
    grad_mode = torch.no_grad if mode == "no_grad" else torch.inference_mode

    def run(hook):
        handle = layer.register_forward_hook(hook)
        try:
            with grad_mode():
                before = patch.norms_reused
                logits = model(_prompt()).logits
                return logits, patch.norms_reused - before
        finally:
            handle.remove()

    def steer_in_place(module, args, output):
        _output(output).add_(steer)  # returns None: the output stays the same tensor object

    in_place, reused_in_place = run(steer_in_place)
    out_of_place, _ = run(lambda m, args, output: _output(output) + steer)
    plain, reused_plain = run(lambda m, args, output: None)
    patch.unpatch()
    # the same values either way: the in-place edit is computed with, not the norm of before it
    assert torch.equal(in_place, out_of_place)
    assert not torch.equal(in_place, plain)  # the steering does change the logits
    # layer 2's norm still comes from its bridge; layer 0's is computed again
    assert (reused_plain, reused_in_place) == (2, 1)


def test_5_autograd_through_a_patched_model_is_refused_saying_how_to_run():
    model = build_model("qwen3_moe", TINY)
    patch = patch_moe_epilogues(model)
    how = r"torch\.no_grad\(\) or torch\.inference_mode\(\), or call model\.requires_grad_\(False\)"
    with pytest.raises(RuntimeError, match=r"called with autograd recording") as err:
        model(_prompt())  # parameters require grad, autograd on: refused
    assert "its input requires grad (a parameter or input before it does)" in str(err.value)
    assert re.search(how, str(err.value)), str(err.value)
    with torch.no_grad():
        reference = model(_prompt()).logits  # and the next forward runs
    model.requires_grad_(False)
    # nothing requires grad: it runs (with autograd on, attention may take another kernel than
    # under no_grad: not compared bit for bit)
    assert torch.isfinite(model(_prompt()).logits).all()
    model.model.layers[2].mlp.requires_grad_(True)  # the block's own weights (fine-tuning it)
    with pytest.raises(RuntimeError, match=r"the parameters of \w+ require grad"):
        model(_prompt())
    model.requires_grad_(False)
    # saliency over the input embeddings, parameters frozen: the input requires grad
    embeds = model.model.embed_tokens(_prompt()).detach().requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"its input requires grad"):
        model(inputs_embeds=embeds)
    with torch.inference_mode():
        assert torch.equal(model(_prompt()).logits, reference)
    patch.unpatch()
    model.requires_grad_(True)
    model(_prompt()).logits.sum().backward()  # the model's own code again: gradients are its own


def test_fail_call_on_one_rank_raises_the_error_or_returns_and_names_a_bad_token_count():
    bridge = FusionBridge(EpilogueSpec(hidden_size=64, top_k=2), self_test=False, tuning="off")
    with pytest.raises(ValueError, match="the router failed"):
        bridge.fail_call(3, ValueError("the router failed"))
    assert bridge.fail_call(3) is None
    with pytest.raises(TypeError, match=r"fail_call: tokens must be an int .* 1\.5"):
        bridge.fail_call(1.5)
    assert bridge.calls == 2 and bridge.unusable is None
    bridge.mark_out_of_step("a test skipped a call")
    assert "a test skipped a call" in bridge.unusable
    bridge.close()
