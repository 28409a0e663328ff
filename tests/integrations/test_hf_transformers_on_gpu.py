"""One GPU: every supported transformers MoE family (hidden 2048, bf16, transformers' default
grouped_mm experts) on the bridge against the unmodified model, eager (forward + greedy generate,
the bound of migration/examples/hf_moe_bound.py) and under CUDA graphs (a captured forward replayed
on a new prompt) wherever the unmodified model itself captures."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusion_bridge.integrations.hf_families import family_of  # noqa: E402
from fusion_bridge.integrations.transformers import (  # noqa: E402
    UnsupportedModelError,
    patch_moe_epilogues,
)
from migration.examples.hf_moe import FAMILIES, LARGE, build_model, compare  # noqa: E402
from migration.examples.hf_moe_bound import Recorder, tainted_positions  # noqa: E402
from migration.examples.hf_moe_models import why_skipped  # noqa: E402
from tests.integrations.test_hf_transformers import check_summary  # noqa: E402

PROMPT = (2, 12)


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


def _recorded_forward(model, prompt: torch.Tensor):
    """(logits, the Recorder's call) of one eager forward; the hooks copy to the host, so they are
    removed before any capture."""
    recorder = Recorder(model)
    recorder.start()
    with torch.no_grad():
        logits = model(prompt, use_cache=False).logits.float()
    recorder.remove()
    return logits, recorder.calls[0], recorder


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_large_model_on_the_bridge_eager_and_under_cuda_graphs(family):
    if why_skipped(family) is not None:
        pytest.skip(f"{family}, transformers {transformers.__version__}: {why_skipped(family)}")
    print("transformers", transformers.__version__, "torch", torch.__version__)
    device = torch.device("cuda", 0)
    model = build_model(family, LARGE, seed=0, device=device)
    row, _ = family_of(model)
    if row.cuda_refusal is not None:  # not verified on CUDA yet: refused there, by name
        with pytest.raises(UnsupportedModelError, match=f"{row.name} is not supported on CUDA"):
            patch_moe_epilogues(model)
        return
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, LARGE["vocab"], PROMPT, generator=g).to(device)
    summary = compare(model, None, 1, prompt, 16)
    summary.update(family=family, rank=0)
    check_summary(summary, LARGE)
    print(summary["strategies"], "max rel err / bound", summary["max_rel_err_over_bound"])

    # CUDA graphs: capture the unmodified and the patched forward, replay both on a new prompt
    new_prompt = torch.randint(1, LARGE["vocab"], PROMPT, generator=g).to(device)
    eager_ref, ref_call, recorder = _recorded_forward(model, new_prompt)
    try:
        static, ref_logits, ref_graph = _captured_forward(model, prompt)
    except Exception as exc:  # noqa: BLE001 - the unmodified model's own limit, not the bridge's
        pytest.skip(f"the unmodified {family} model does not capture: {type(exc).__name__}: {exc}")
    static.copy_(new_prompt)
    ref_graph.replay()
    torch.cuda.synchronize()
    replay_ref = ref_logits.float().clone()  # the unmodified model replays as it ran
    patch = patch_moe_epilogues(model)
    try:
        eager_new, new_call, _ = _recorded_forward(model, new_prompt)
        static, new_logits, new_graph = _captured_forward(model, prompt)
        static.copy_(new_prompt)
        new_graph.replay()
        torch.cuda.synchronize()
        print("captured plan:", patch.strategies(new_prompt.numel()))
    finally:
        patch.unpatch()
    batch, seq = PROMPT
    bound = recorder.bound(ref_call, model, 1)[1].view(batch, seq)
    tainted, flips = tainted_positions(
        [ref_call["routing"]], [new_call["routing"]], recorder, batch=batch
    )
    clean = torch.tensor([[p not in tainted[b] for p in range(seq)] for b in range(batch)])

    def rel(a, b):
        return ((a - b).norm(dim=-1) / b.norm(dim=-1)).cpu() / bound

    replayed, eager = rel(new_logits.float(), eager_ref), rel(eager_new, eager_ref)
    assert float(rel(replay_ref, eager_ref).max()) <= 1.0
    print(
        f"vs unmodified, max rel err / bound: CUDA graph replay {float(replayed[clean].max()):.2f},"
        f" eager {float(eager[clean].max()):.2f} ({int(clean.sum())}/{batch * seq} tokens; flips "
        f"{flips})"
    )
    assert int(clean.sum()) >= batch * seq // 2
    assert float(replayed[clean].max()) <= 1.0 and float(eager[clean].max()) <= 1.0
