"""fusion_bridge.integrations.transformers on models transformers itself loaded sharded: tiny random
models saved with `save_pretrained` and loaded with `from_pretrained(path, tp_plan="auto")` on 2
gloo ranks (one spawned group for every family and refusal). Patched-sharded is judged against
unpatched-sharded within the bound test_hf_transformers uses (hf_moe.compare: forward, greedy
generate with a KV cache, unpatch exact); the ranks agree; and the all-reduces of one forward,
counted by wrapping torch.distributed.all_reduce (transformers 5.25's rowwise layers reduce
through it), are transformers' own minus the shared expert's, plus one per MoE layer (the
bridge's). transformers 5.17's plan shards the routed experts (`moe_tp_experts`): refused there,
with the version named."""

import os

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' TP loading needs it

from fusion_bridge.cli.launch import run_distributed  # noqa: E402
from fusion_bridge.integrations.transformers import (  # noqa: E402
    UnsupportedModelError,
    patch_moe_epilogues,
)
from migration.examples.hf_moe import PROMPT, TINY, build_model, compare  # noqa: E402
from migration.examples.hf_moe_models import why_skipped  # noqa: E402
from tests.integrations.test_hf_transformers import check_summary  # noqa: E402

# a shared expert the plan shards (DeepSeek-V3, GLM-4-MoE, Qwen3.5-MoE) and one it replicates
# (Qwen2-MoE)
FAMILIES = ("deepseek_v3", "glm4_moe", "qwen3_5_moe", "qwen2_moe")
SHARDED_SHARED = {"deepseek_v3": True, "glm4_moe": True, "qwen3_5_moe": True, "qwen2_moe": False}
ROUTED_SHARDED = transformers.__version__.startswith("5.17.")  # its plan: moe_tp_experts


def _load(path: str, class_name: str):
    model = getattr(transformers, class_name).from_pretrained(
        path, tp_plan="auto", dtype=torch.bfloat16
    )
    return model.eval()


def _count_all_reduces():
    """Wrap torch.distributed.all_reduce (every caller looks it up at call time): [count]."""
    count, own = [0], dist.all_reduce

    def all_reduce(*args, **kwargs):
        count[0] += 1
        return own(*args, **kwargs)

    dist.all_reduce = all_reduce
    return count, own


def _rank(rank: int, world: int, saved: dict) -> dict:
    """Every saved family loaded with tp_plan='auto' on this rank: compare(...) patched against
    unpatched, the all-reduce counts of one forward, and the refusals."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world))  # what torchrun sets; transformers reads it
    torch.set_num_threads(1)
    out = {}
    prompt = torch.randint(1, TINY["vocab"], PROMPT, generator=torch.Generator().manual_seed(1))
    for family, (path, class_name) in saved.items():
        model = _load(path, class_name)
        if ROUTED_SHARDED:
            try:
                patch_moe_epilogues(model)
                out[family] = {"refused": None}
            except UnsupportedModelError as exc:
                out[family] = {"refused": str(exc)}
            continue
        count, own = _count_all_reduces()
        try:
            with torch.no_grad():
                model(prompt)
                unpatched = count[0]
                patch = patch_moe_epilogues(model)
                count[0] = 0
                model(prompt)
                patched, moe_layers = count[0], len(patch.layers)
                explain = patch.explain()
                patch.unpatch()
        finally:
            dist.all_reduce = own
        summary = compare(model, None, world, prompt, 6)
        out[family] = dict(summary, family=family, rank=rank, explain_held=explain)
        out[family].update(all_reduces=(unpatched, patched, moe_layers))
    out["wrong_group"] = _wrong_group(saved)
    return out


def _wrong_group(saved: dict) -> str:
    """A group that is not the model's TP group is refused, naming both."""
    path, class_name = saved["qwen2_moe"]
    model = _load(path, class_name)
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective: every rank
    try:
        patch_moe_epilogues(model, group=alone[dist.get_rank()]).unpatch()
        return "patched"
    except (ValueError, UnsupportedModelError) as exc:
        return str(exc)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_plan")
    out = {}
    for family in FAMILIES:
        if why_skipped(family) is None:
            model = build_model(family, TINY)
            model.save_pretrained(root / family)
            out[family] = (str(root / family), type(model).__name__)
    return out


def test_tp_plan_models_on_two_gloo_ranks(saved):
    per_rank = run_distributed(_rank, 2, saved, timeout_s=600)
    for family in saved:
        ranks = [per_rank[r][family] for r in range(2)]
        print(family, {k: v for k, v in ranks[0].items() if k in ("refused", "all_reduces")})
        print({k: v for k, v in ranks[0].items() if k not in ("explain",)})
    print(per_rank[0]["wrong_group"], per_rank[1]["wrong_group"])
