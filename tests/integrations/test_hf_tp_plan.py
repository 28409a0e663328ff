"""fusion_bridge.integrations.transformers on models transformers itself loaded sharded: tiny random
models saved with `save_pretrained` and loaded with `from_pretrained` on 2 gloo ranks (one spawned
group for every family, every mode and every refusal): `tp_plan="auto"` (TP), and on transformers
5.25 `DistributedConfig(tp_size=2, ep_size=2)` (TP + EP) and with `tp_plan={}` (EP alone).

Patched-sharded is judged against unpatched-sharded within the bound test_hf_transformers uses
(hf_moe.compare: forward, greedy generate with a KV cache, unpatch exact); the ranks agree; and the
all-reduces of one forward, counted per decoder layer by wrapping torch.distributed.all_reduce
(transformers' rowwise layers and AllReduceEP reduce through it), are transformers' own in every
layer except the MoE layers, which make exactly one each (the bridge's): the plan-sharded shared
expert's own and AllReduceEP's gone. transformers 5.17's plan shards the routed experts of some
families (`moe_tp_experts`): those are refused, with the version and the plan entry named; its
router-hooked EP is refused by name. Refused too: all-to-all EP, a plan entry on the MoE block
(every such layer named in one error). Parameters replaced or re-sharded after patching are named
at the next call. On 4 gloo ranks (opt-in, TEST_HF_FOUR_RANKS=1): every mode for a plan-sharded and
a replicated shared expert, with heads, KV heads and experts in multiples of 4."""

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
from tests.helpers import once_per_run  # noqa: E402
from tests.integrations.test_hf_transformers import NEW_TOKENS, check_summary  # noqa: E402

# a shared expert the plan shards (DeepSeek-V3, GLM-4-MoE, Qwen3.5-MoE) and one it replicates
# (Qwen2-MoE)
FAMILIES = ("deepseek_v3", "glm4_moe", "qwen3_5_moe", "qwen2_moe")
NEWEST = not transformers.__version__.startswith("5.17.")


def _load(path: str, class_name: str, **kwargs):
    kwargs = kwargs or dict(tp_plan="auto")
    model = getattr(transformers, class_name).from_pretrained(path, dtype=torch.bfloat16, **kwargs)
    return model.eval()


def _all_reduces_per_layer(model, layers, prompt) -> list[int]:
    """One forward of `model` on prompt: how many torch.distributed.all_reduce calls each decoder
    layer made (every caller looks the function up at call time, so wrapping it sees them all)."""
    count, own, per_layer = [0], dist.all_reduce, []

    def all_reduce(*args, **kwargs):
        count[0] += 1
        return own(*args, **kwargs)

    hooks = [
        layer.register_forward_pre_hook(lambda *_: count.__setitem__(0, 0)) for layer in layers
    ]
    hooks += [
        layer.register_forward_hook(lambda *_: per_layer.append(count[0])) for layer in layers
    ]
    dist.all_reduce = all_reduce
    try:
        with torch.no_grad():
            model(prompt)
    finally:
        dist.all_reduce = own
        for hook in hooks:
            hook.remove()
    return per_layer


def _modes(world: int) -> dict:
    """{mode: from_pretrained keyword arguments} this transformers offers (built in the rank)."""
    modes = {"tp_plan": dict(tp_plan="auto")}
    if NEWEST:  # transformers 5.25's expert parallelism: TP + EP, and EP alone (tp_plan={})
        config = transformers.DistributedConfig
        modes["tp_ep"] = dict(distributed_config=config(tp_size=world, ep_size=world))
        modes["ep"] = dict(distributed_config=config(tp_size=world, ep_size=world, tp_plan={}))
    return modes


def _family(family, path, class_name, rank, world, prompt, load=None) -> dict:
    model = _load(path, class_name, **(load or {}))
    routed_sharded = "moe_tp_experts" in (model._tp_plan or {}).values()
    try:
        patch = patch_moe_epilogues(model)
    except UnsupportedModelError as exc:
        return {"family": family, "refused": str(exc), "routed_sharded": routed_sharded}
    layers = [m for m in model.modules() if hasattr(m, "input_layernorm")]
    shared_sharded = {i: p.shared_sharded for i, p in patch.layers.items()}
    experts_sharded = {i: p.experts_sharded for i, p in patch.layers.items()}
    patch.unpatch()
    own_forwards = {n: vars(m)["forward"] for n, m in model.named_modules() if "forward" in vars(m)}
    unpatched = _all_reduces_per_layer(model, layers, prompt)
    patch = patch_moe_epilogues(model)
    patched = _all_reduces_per_layer(model, layers, prompt)
    patch.unpatch()
    summary = compare(model, None, world, prompt, NEW_TOKENS)
    # transformers' own TP forwards are its, before and after: only what the patch set must go
    summary["left_patched"] = [n for n in summary["left_patched"] if n not in own_forwards]
    after = {n: vars(m)["forward"] for n, m in model.named_modules() if "forward" in vars(m)}
    summary["tp_forwards_restored"] = after == own_forwards
    summary.update(family=family, rank=rank, all_reduces=(unpatched, patched))
    summary.update(shared_sharded=shared_sharded, experts_sharded=experts_sharded)
    return summary


def _bad_models(saved: dict, rank: int) -> dict:
    """Rank 1's replicated router weight differs; rank 1's shard has the wrong local shape."""
    from torch.distributed.tensor import DTensor

    out = {}
    path, class_name = saved["qwen2_moe"]  # patched on both transformers releases
    model = _load(path, class_name)
    if rank == 1:
        with torch.no_grad():
            model.model.layers[0].mlp.gate.weight[0, 0] += 1
    out["replicated_differs"] = _refusal(model)
    model = _load(path, class_name)
    if rank == 1:  # a shard of 8 rows where Shard(0) of 64 over 2 ranks gives 32
        linear = model.model.layers[0].self_attn.q_proj
        weight = linear.weight
        short = DTensor.from_local(
            weight.to_local()[:8], weight.device_mesh, weight.placements, run_check=False,
            shape=weight.shape, stride=weight.stride(),
        )  # fmt: skip
        linear._parameters["weight"] = torch.nn.Parameter(short, requires_grad=False)
    out["shard_shape"] = _refusal(model)
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective: every rank
    out["wrong_group"] = _refusal(_load(path, class_name), group=alone[rank])
    if NEWEST:  # transformers 5.25's all-to-all expert parallelism
        ep = transformers.DistributedConfig(tp_size=2, ep_size=2, ep_implementation="all_to_all")
        # a plan entry on every MoE block (layers 0 and 2): each refused layer is named
        plan = transformers.DistributedConfig(
            tp_size=2, tp_plan={"model.layers.*.mlp": "all_reduce"}
        )
        out["unknown_plan"] = _refusal(_load(path, class_name, distributed_config=plan))
    else:  # 5.17's: the plan hooks the router (ep_router)
        ep = transformers.DistributedConfig(tp_plan="auto", enable_expert_parallel=True)
    out["expert_parallel"] = _refusal(_load(*saved["deepseek_v3"], distributed_config=ep))
    return out


def _replaced(saved: dict, rank: int, prompt) -> dict:
    """Parameters changed after patching, alike on both ranks: the next forward's error."""
    from torch.distributed.tensor import Replicate

    def router(model):
        return model.model.layers[0].mlp.gate

    def swap(model):  # a parameter object swapped for an equal one
        weight = router(model).weight
        router(model)._parameters["weight"] = torch.nn.Parameter(weight.detach().clone())

    def reshard(model):  # EP-sharded experts made whole on every rank (re-sharded)
        experts = model.model.layers[0].mlp.experts
        p = experts.gate_up_proj
        whole = p.detach().redistribute(p.device_mesh, [Replicate()])
        experts._parameters["gate_up_proj"] = torch.nn.Parameter(whole, requires_grad=False)

    cases = {
        "swapped": ("tp_plan", swap),
        "assigned": ("tp_plan", lambda m: m.load_state_dict(m.state_dict(), assign=True)),
        "cast": ("tp_plan", lambda m: m.to(torch.float16)),
    }
    if NEWEST:
        cases["resharded"] = ("tp_ep", reshard)
    out = {}
    for case, (mode, change) in cases.items():
        model = _load(*saved["qwen2_moe"], **_modes(2)[mode])
        patch = patch_moe_epilogues(model)
        change(model)
        try:
            with torch.no_grad():
                model(prompt)
            out[case] = "ran"
        except RuntimeError as exc:
            out[case] = str(exc)
        patch.unpatch()
    return out


def _refusal(model, **kwargs) -> str:
    try:
        patch_moe_epilogues(model, **kwargs).unpatch()
        return "patched"
    except ValueError as exc:  # UnsupportedModelError is one
        return f"{type(exc).__name__}: {exc}"


def _rank(rank: int, world: int, saved: dict, refusals: bool = True) -> dict:
    """Every saved family loaded with tp_plan='auto' on this rank (_family), then the refusals."""
    # what torchrun sets, and transformers reads to size its mesh
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    prompt = torch.randint(1, TINY["vocab"], PROMPT, generator=torch.Generator().manual_seed(1))
    out = {}
    for mode, load in _modes(world).items():
        out[mode] = {f: _family(f, *where, rank, world, prompt, load) for f, where in saved.items()}
    if refusals:  # the bad inputs and refusals: on 2 ranks only
        out["bad"] = _bad_models(saved, rank)
        out["replaced"] = _replaced(saved, rank, prompt)
    return out


def _save(root, families, size: dict) -> dict:
    """{family: (path, class name)}: each family this transformers has, saved under root."""
    out = {}
    for family in families:
        if why_skipped(family) is None:
            model = build_model(family, size)
            model.save_pretrained(root / family)
            out[family] = (str(root / family), type(model).__name__)
    return out


def _spawned(world: int, families, size: dict, refusals: bool):
    def compute(root):
        saved = _save(root, families, size)
        # the ranks' results carry no paths: the directory is gone for a worker that loads them
        return {f: None for f in saved}, run_distributed(
            _rank, world, saved, refusals, timeout_s=600
        )

    return compute


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """({family: None} of the families saved, every rank's results): one spawned 2-rank gloo
    group for every mode, family and refusal (once per run under xdist)."""
    return once_per_run(tmp_path_factory, "hf_tp_plan_2", _spawned(2, FAMILIES, TINY, True))


@pytest.fixture(scope="module")
def saved(two):
    return two[0]


@pytest.fixture(scope="module")
def per_rank(two):
    return two[1]


def _check_mode(per_rank, saved, mode: str) -> None:
    """Every family loaded in `mode` on both ranks: refused only where expected (5.17's
    moe_tp_experts), else within the bound, ranks identical, unpatch exact, and one all-reduce
    per MoE layer: the layer's own, less the plan-sharded shared expert's and AllReduceEP's."""
    for family in saved:
        ranks = [per_rank[r][mode][family] for r in range(len(per_rank))]
        if "refused" in ranks[0]:
            # only where transformers' plan shards the routed experts (5.17's moe_tp_experts)
            assert not NEWEST and ranks[0]["routed_sharded"], ranks[0]["refused"]
            for r in ranks:
                assert "cannot be patched under transformers 5.17" in r["refused"]
                assert "'moe_tp_experts'" in r["refused"] and "experts: a replaced" in r["refused"]
            continue
        for r in ranks:
            check_summary(r)
            assert r["tp_forwards_restored"], family
            unpatched, patched = r["all_reduces"]
            print(f"{mode} {family} rank {r['rank']}: all-reduces per decoder layer, unpatched "
                  f"{unpatched}, patched {patched}; MoE layers {r['moe_layers']}")  # fmt: skip
            for i, (own, ours) in enumerate(zip(unpatched, patched)):
                if i not in r["moe_layers"]:
                    assert ours == own, (family, i)
                else:  # the bridge's one, in place of the shared expert's and AllReduceEP's
                    gone = r["shared_sharded"][i] + r["experts_sharded"][i]
                    assert ours == own - gone + 1 and ours >= 1, (family, i)
        # the TP plan shards the shared expert where it names it; Qwen2-MoE's is replicated
        expected = family != "qwen2_moe" and mode != "ep"
        assert set(ranks[0]["shared_sharded"].values()) == {expected}, (mode, family)
        assert set(ranks[0]["experts_sharded"].values()) == {mode != "tp_plan"}, (mode, family)
        for other in ranks[1:]:
            assert other["logits_checksum"] == ranks[0]["logits_checksum"], family
            assert other["sequences"] == ranks[0]["sequences"], family


def test_models_loaded_with_tp_plan_auto_on_two_gloo_ranks(per_rank, saved):
    assert "deepseek_v3" in saved and "qwen2_moe" in saved
    _check_mode(per_rank, saved, "tp_plan")
    for r in range(2):
        bad = per_rank[r]["bad"]
        assert (
            "ValueError: patch_moe_epilogues: every rank of the group must hold the same model"
            in bad["replicated_differs"]
            and "rank 1 differs from rank 0 in parameters ['model.layers.0.mlp.gate.weight']"
            in bad["replicated_differs"]
        ), bad
        assert (
            "on rank 1, 1 do not (first: model.layers.0.self_attn.q_proj.weight: "
            "placements (Shard(dim=0)); global shape (64, 64); local shape (8, 64), expected "
            "(32, 64))" in bad["shard_shape"]
        ), bad["shard_shape"]
        assert "group must be the model's own tensor-parallel group (its device mesh's 'tp' " \
            f"group, ranks [0, 1]), or None to use it; got a group of ranks [{r}]" \
            in bad["wrong_group"], bad["wrong_group"]  # fmt: skip
        if not NEWEST:
            assert (
                "router-hooked expert parallelism (DistributedConfig(enable_expert_parallel="
                "True)) under transformers 5.17" in bad["expert_parallel"]
            ), bad["expert_parallel"]


@pytest.mark.skipif(
    not NEWEST,
    reason=f"transformers {transformers.__version__} has no DistributedConfig(ep_size=...) "
    "expert parallelism (5.25 has; 5.17's router-hooked one is refused, tested above)",
)
@pytest.mark.parametrize("mode", ["tp_ep", "ep"])
def test_models_loaded_with_expert_parallelism_on_two_gloo_ranks(per_rank, saved, mode):
    """DistributedConfig(tp_size=2, ep_size=2) (mode tp_ep) and with tp_plan={} (mode ep)."""
    _check_mode(per_rank, saved, mode)


@pytest.mark.skipif(not NEWEST, reason=f"transformers {transformers.__version__}: no ep_size")
def test_expert_parallelism_the_patch_cannot_take_over_is_refused(per_rank):
    for r in range(2):
        bad = per_rank[r]["bad"]
        assert (
            "expert parallelism (DistributedConfig(ep_size=2)) under transformers "
            f"{transformers.__version__}, which "
            "the patch cannot take over: ep_implementation='all_to_all' exchanges tokens"
            in bad["expert_parallel"]
        ), bad["expert_parallel"]
        # every refused layer is named, each with its reason and plan entry
        unknown = bad["unknown_plan"]
        assert "2 of the sharded model's 2 MoE layers cannot be patched (layers [0, 2])" in unknown
        for i in (0, 2):
            assert (
                f"MoE layer {i} (model.layers.{i}.mlp) of the sharded model cannot be patched "
                f"under transformers {transformers.__version__}: sharded parameters or "
                f"installed forwards the patch does not know (model.layers.{i}.mlp: a "
                "replaced forward" in unknown
            ), unknown
        assert "'model.layers.*.mlp': 'all_reduce'" in unknown, unknown


def test_parameters_replaced_or_resharded_after_patching_are_named_at_the_next_call(per_rank):
    expected = {
        "swapped": "model.layers.0.mlp.gate.weight was replaced by another parameter object",
        "assigned": "model.layers.0.mlp.gate.weight was replaced by another parameter object",
        "cast": "model.layers.0.mlp.gate.weight",
    }
    if NEWEST:
        expected["resharded"] = (
            "model.layers.0.mlp.experts.gate_up_proj was replaced by another parameter object "
            "(local shape, dtype, device, placements ((8, 64, 64), torch.bfloat16"
        )
    for r in range(2):
        replaced = per_rank[r]["replaced"]
        assert sorted(replaced) == sorted(expected), replaced
        for case, text in expected.items():
            assert "a parameter the patched layer reads changed after patching" in replaced[case]
            assert text in replaced[case] and "Call patch.unpatch()" in replaced[case], (
                case,
                replaced[case],
            )


# 4 ranks: attention, KV heads (kv_heads) and routed experts (8) in multiples of 4; a shared expert
# the plan shards (DeepSeek-V3, MLA attention) and one it replicates (Qwen2-MoE, grouped KV heads)
FOUR = dict(TINY, kv_heads=4)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """One spawned 4-rank gloo group for every mode (no refusals: those are the 2-rank group's)."""
    families = ("deepseek_v3", "qwen2_moe")
    return once_per_run(tmp_path_factory, "hf_tp_plan_4", _spawned(4, families, FOUR, False))


@pytest.mark.skipif(
    os.environ.get("TEST_HF_FOUR_RANKS") != "1",
    reason="4 spawned gloo ranks (about 55 s on a 2-core machine, most of it 4 processes "
    "importing torch and transformers): run with TEST_HF_FOUR_RANKS=1",
)
def test_every_mode_on_four_gloo_ranks(four):
    saved, ranks = four
    assert set(saved) == {"deepseek_v3", "qwen2_moe"}
    for mode in ranks[0]:
        _check_mode(ranks, saved, mode)
