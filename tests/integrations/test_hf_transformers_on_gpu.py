"""One GPU: transformers MoE models (hidden 2048, bf16, transformers' default grouped_mm experts)
on the bridge against the unmodified model, eager (forward + greedy generate, the bound of
migration/examples/hf_moe_bound.py) and under CUDA graphs (a captured forward replayed on a new
prompt)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusion_bridge.integrations.transformers import patch_moe_epilogues  # noqa: E402
from migration.examples.hf_moe import (  # noqa: E402
    FAMILIES,
    LARGE,
    build_model,
    compare,
    epilogue_roundings,
    logits_bound,
    Recorder,
    tainted_positions,
)
from tests.integrations.test_hf_transformers import check_summary  # noqa: E402


def _captured_forward(model, prompt: torch.Tensor):
    """A CUDA graph of model(prompt) (no cache); returns (static input, static logits, graph)."""
    static = prompt.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            model(static, use_cache=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        logits = model(static, use_cache=False).logits
    return static, logits, graph


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_large_model_on_the_bridge_eager_and_under_cuda_graphs(family):
    print("transformers", transformers.__version__, "torch", torch.__version__)
    device = torch.device("cuda", 0)
    model = build_model(family, LARGE, seed=0, device=device)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 512, (2, 12), generator=g).to(device)
    summary = compare(model, None, 1, prompt, 16)
    summary.update(family=family, rank=0)
    check_summary(summary, LARGE)
    print(summary["strategies"], "max rel err / bound", summary["max_rel_err_over_bound"])

    # CUDA graphs: capture the unmodified and the patched forward, replay both on a new prompt.
    # The recorder's hooks copy to the host, so they are removed before any capture.
    new_prompt = torch.randint(1, 512, (2, 12), generator=g).to(device)
    with torch.no_grad():
        recorder = Recorder(model)
        recorder.start()
        eager_ref = model(new_prompt, use_cache=False).logits.float()
        ref_call = recorder.calls[0]
        recorder.remove()
        static, ref_logits, ref_graph = _captured_forward(model, prompt)
        static.copy_(new_prompt)
        ref_graph.replay()
        torch.cuda.synchronize()
        replay_ref = ref_logits.float().clone()  # the unmodified model replays as it ran
        patch = patch_moe_epilogues(model)
        try:
            patched_recorder = Recorder(model)
            patched_recorder.start()
            eager_new = model(new_prompt, use_cache=False).logits.float()
            new_call = patched_recorder.calls[0]
            patched_recorder.remove()
            static, new_logits, new_graph = _captured_forward(model, prompt)
            static.copy_(new_prompt)
            new_graph.replay()
            torch.cuda.synchronize()
            print("captured plan:", patch.strategies(new_prompt.numel()))
        finally:
            patch.unpatch()
    bound = logits_bound(
        recorder.magnitudes(ref_call), recorder.moe_layers, epilogue_roundings(model, 1)
    )[1].view(2, 12)
    tainted, flips = tainted_positions(
        [ref_call["routing"]], [new_call["routing"]], recorder, batch=2
    )
    clean = torch.tensor([[p not in tainted[b] for p in range(12)] for b in range(2)])

    def rel(a, b):
        return ((a - b).norm(dim=-1) / b.norm(dim=-1)).cpu() / bound

    replayed, eager = rel(new_logits.float(), eager_ref), rel(eager_new, eager_ref)
    assert float(rel(replay_ref, eager_ref).max()) <= 1.0
    print(
        f"vs unmodified, max rel err / bound: CUDA graph replay {float(replayed[clean].max()):.2f},"
        f" eager {float(eager[clean].max()):.2f} ({int(clean.sum())}/24 tokens; flips {flips})"
    )
    assert int(clean.sum()) >= 12
    assert float(replayed[clean].max()) <= 1.0 and float(eager[clean].max()) <= 1.0
