"""fusion_bridge.integrations.transformers on models transformers itself loaded sharded: tiny random
models saved with `save_pretrained` and loaded with `from_pretrained` on gloo ranks (one spawned
group per world size for every family, every mode and every refusal): `tp_plan="auto"` (TP), and
on transformers 5.25 `DistributedConfig(tp_size=W, ep_size=W)` (TP + EP) and with `tp_plan={}`
(EP alone).

Patched-sharded is judged against unpatched-sharded within the bound test_hf_transformers uses
(hf_moe.compare: forward, greedy generate with a KV cache, unpatch exact); the ranks agree; and the
all-reduces of one forward, counted per decoder layer by wrapping torch.distributed.all_reduce
(transformers' rowwise layers and AllReduceEP reduce through it), are transformers' own in every
layer except the MoE layers, which make exactly one each (the bridge's): the plan-sharded shared
expert's own and AllReduceEP's gone. transformers 5.17's plan shards the routed experts of some
families (`moe_tp_experts`): those are refused, with the version and the plan entry named; its
router-hooked EP is refused by name. Refused too: all-to-all EP, an EP group that is not the TP
group, DeepGEMM Mega MoE experts, a plan entry on the MoE block (every such layer named in one
error). Parameters replaced or re-sharded after patching are named at the next call.

Which families and world sizes. TEST_HF_SHARDED_ALL=1: every family the patch supports in the
installed transformers, every mode it offers, on 2 and on 4 ranks (on 2 cores about 40 s on
5.17, 5 minutes on 5.25), printing one MATRIX line per family, mode and world size. Otherwise (CI):
DEFAULT_FAMILIES on 2 ranks, and on 4 with TEST_HF_FOUR_RANKS=1. The rule for DEFAULT_FAMILIES:
the first family in hf_moe_models.FAMILIES order of each behaviour row (hf_sharded.behaviour:
refused or not and why; shared expert plan-sharded, replicated or absent, gated, the decoder
layer's; routed experts EP-sharded or replicated; expert biases; or transformers' own failure at
load or in its forward) that the exhaustive run finds on either supported transformers release;
the exhaustive run checks that the subset still covers every row it sees. transformers' own
failures are listed with their reason in hf_sharded.TRANSFORMERS_FAILS, never skipped silently.
On 4 ranks the attention heads, KV heads and routed experts are multiples of 4."""

import os
import time

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' TP loading needs it

from fusion_bridge.cli.launch import run_distributed  # noqa: E402
from fusion_bridge.integrations.transformers import patch_moe_epilogues  # noqa: E402
from migration.examples.hf_moe import FAMILIES, PROMPT, TINY, build_model  # noqa: E402
from migration.examples.hf_moe_models import why_skipped  # noqa: E402
from tests.helpers import once_per_run  # noqa: E402
from tests.integrations.hf_sharded import (  # noqa: E402
    check_ep_refusals,
    check_mode,
    ep_refusals,
    family_result,
    kv_heads_multiple_of,
    load,
    modes,
    print_matrix,
    refusal,
    row_of,
)

# TEST_HF_SHARDED_ALL=1: every family this transformers has and the patch supports, every mode,
# on 2 and on 4 ranks (one spawned group each); otherwise DEFAULT_FAMILIES on 2 ranks
ALL = os.environ.get("TEST_HF_SHARDED_ALL") == "1"
# the CI subset: the first family in table order of each behaviour row (hf_sharded.behaviour)
# the exhaustive run finds, on either stack (test_the_ci_subset_covers_every_behaviour_row
# checks it whenever TEST_HF_SHARDED_ALL=1)
DEFAULT_FAMILIES = (
    "deepseek_v3",  # shared expert plan-sharded (5.25); 5.17: refused, moe_tp_experts
    "kimi_k25",  # transformers fails at load (its plan names k_proj)
    "qwen2_moe",  # shared expert replicated and gated
    "qwen3_moe",  # no shared expert (5.25)
    "qwen3_5_moe",  # shared expert plan-sharded and gated (5.25)
    "gpt_oss",  # expert biases
    "glm4_moe_lite",  # transformers' own sharded forward fails (TP plan modes)
    "qwen3_vl_moe",  # 5.25: transformers fails at load under EP; 5.17: no shared expert
    "granitemoeshared",  # the shared expert is the decoder layer's (5.25)
    "minimax_m3_vl",  # shared expert replicated, ungated (5.25)
    "exaone_moe",  # shared expert replicated, ungated (5.17)
)
NEWEST = not transformers.__version__.startswith("5.17.")
_load, _modes = load, modes


def _families(default: tuple) -> tuple:
    """The families a group runs: all of FAMILIES with TEST_HF_SHARDED_ALL=1, else `default`."""
    return tuple(f for f in FAMILIES if f in default or ALL)


def _bad_models(saved: dict, rank: int) -> dict:
    """Rank 1's replicated router weight differs; rank 1's shard has the wrong local shape."""
    from torch.distributed.tensor import DTensor

    out = {}
    path, class_name = saved["qwen2_moe"]  # patched on both transformers releases
    model = _load(path, class_name)
    if rank == 1:
        with torch.no_grad():
            model.model.layers[0].mlp.gate.weight[0, 0] += 1
    out["replicated_differs"] = refusal(model)
    model = _load(path, class_name)
    if rank == 1:  # a shard of 8 rows where Shard(0) of 64 over 2 ranks gives 32
        linear = model.model.layers[0].self_attn.q_proj
        weight = linear.weight
        short = DTensor.from_local(
            weight.to_local()[:8], weight.device_mesh, weight.placements, run_check=False,
            shape=weight.shape, stride=weight.stride(),
        )  # fmt: skip
        linear._parameters["weight"] = torch.nn.Parameter(short, requires_grad=False)
    out["shard_shape"] = refusal(model)
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective: every rank
    out["wrong_group"] = refusal(_load(path, class_name), group=alone[rank])
    if NEWEST:  # transformers 5.25's all-to-all expert parallelism
        ep = transformers.DistributedConfig(tp_size=2, ep_size=2, ep_implementation="all_to_all")
        # a plan entry on every MoE block (layers 0 and 2): each refused layer is named
        plan = transformers.DistributedConfig(
            tp_size=2, tp_plan={"model.layers.*.mlp": "all_reduce"}
        )
        out["unknown_plan"] = refusal(_load(path, class_name, distributed_config=plan))
    else:  # 5.17's: the plan hooks the router (ep_router)
        ep = transformers.DistributedConfig(tp_plan="auto", enable_expert_parallel=True)
    out["expert_parallel"] = refusal(_load(*saved["deepseek_v3"], distributed_config=ep))
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
        except Exception as exc:  # the watch's RuntimeError; anything else is a finding
            out[case] = f"{type(exc).__name__}: {exc}"
        patch.unpatch()
    return out


def _rank(rank: int, world: int, saved: dict, refusals: bool = True) -> dict:
    """Every saved family in every mode on this rank (hf_sharded.family_result), then the
    refusals and bad inputs."""
    # what torchrun sets, and transformers reads to size its mesh
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    prompt = torch.randint(1, TINY["vocab"], PROMPT, generator=torch.Generator().manual_seed(1))
    out, times = {}, {}
    for mode, kwargs in _modes(world).items():
        out[mode] = {}
        for f, where in saved.items():
            start = time.perf_counter()
            out[mode][f] = family_result(f, *where, rank, world, prompt, kwargs)
            times[mode, f] = time.perf_counter() - start
    out["seconds"] = times
    if NEWEST:  # expert parallelism refused as a whole, on every world size
        out["ep_refusals"] = ep_refusals(saved, world)
    if refusals:  # the bad inputs and refusals: on 2 ranks only
        out["bad"] = _bad_models(saved, rank)
        out["replaced"] = _replaced(saved, rank, prompt)
    dist.barrier()  # no rank ends (and takes the store down) while a peer still makes groups
    return out


def _save(root, families, size: dict, world: int) -> dict:
    """{family: (path, class name)}: each family this transformers has and the patch supports,
    saved under root with its KV heads a multiple of `world` (hf_sharded.kv_heads_multiple_of)."""
    out = {}
    with kv_heads_multiple_of(world):
        for family in families:
            if why_skipped(family) is None:
                model = build_model(family, size)
                model.save_pretrained(root / family)
                out[family] = (str(root / family), type(model).__name__)
    return out


def _spawned(world: int, families, size: dict, refusals: bool):
    def compute(root):
        saved = _save(root, families, size, world)
        start = time.perf_counter()
        # the ranks' results carry no paths: the directory is gone for a worker that loads them
        # every family on 4 ranks takes minutes (4 on a quiet 2-core machine): a longer bound
        per_rank = run_distributed(_rank, world, saved, refusals, timeout_s=1800 if ALL else 600)
        return {f: None for f in saved}, per_rank, time.perf_counter() - start

    return compute


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """({family: None} of the families saved, every rank's results, seconds): one spawned 2-rank
    gloo group for every mode, family and refusal (once per run under xdist)."""
    name = "hf_tp_plan_2_all" if ALL else "hf_tp_plan_2"
    return once_per_run(
        tmp_path_factory, name, _spawned(2, _families(DEFAULT_FAMILIES), TINY, True)
    )


@pytest.fixture(scope="module")
def saved(two):
    return two[0]


@pytest.fixture(scope="module")
def per_rank(two):
    return two[1]


def test_models_loaded_with_tp_plan_auto_on_two_gloo_ranks(per_rank, saved):
    assert "deepseek_v3" in saved and "qwen2_moe" in saved
    check_mode(per_rank, saved, "tp_plan")
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
    check_mode(per_rank, saved, mode)


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
    check_ep_refusals(per_rank)


def test_parameters_replaced_or_resharded_after_patching_are_named_at_the_next_call(per_rank):
    expected = {
        "swapped": "model.layers.0.mlp.gate.weight was replaced by another parameter object",
        "assigned": "model.layers.0.mlp.gate.weight was replaced by another parameter object",
        # the same object, cast in place by Module.to: its dtype is named
        "cast": "model.layers.0.mlp.gate.weight changed its local shape, dtype, device or "
        "placements from ((8, 64), torch.bfloat16, device(type='cpu'), None) to ((8, 64), "
        "torch.float16",
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
            assert replaced[case].startswith(
                "RuntimeError: patch_moe_epilogues: a parameter the patched layer reads changed "
                "after patching: "
            ), (case, replaced[case])
            assert text in replaced[case] and "Call patch.unpatch()" in replaced[case], (
                case,
                replaced[case],
            )


# 4 ranks: attention, KV heads and routed experts (8) in multiples of 4 (the KV heads of every
# family: hf_sharded.kv_heads_multiple_of)
FOUR = dict(TINY, kv_heads=4)
FOUR_RANKS = ALL or os.environ.get("TEST_HF_FOUR_RANKS") == "1"


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """One spawned 4-rank gloo group for every mode (no refusals: those are the 2-rank group's)."""
    name = "hf_tp_plan_4_all" if ALL else "hf_tp_plan_4"
    families = _families(DEFAULT_FAMILIES)
    return once_per_run(tmp_path_factory, name, _spawned(4, families, FOUR, False))


@pytest.mark.skipif(
    not FOUR_RANKS,
    reason="4 spawned gloo ranks (the CI subset: about 45 s on a 2-core machine): run "
    "with TEST_HF_FOUR_RANKS=1 (the CI subset) or TEST_HF_SHARDED_ALL=1 (every family)",
)
def test_every_mode_on_four_gloo_ranks(four):
    saved, ranks, seconds = four
    print_matrix(ranks, saved, 4, seconds)
    assert set(saved) == {f for f in _families(DEFAULT_FAMILIES) if why_skipped(f) is None}
    for mode in _modes(4):
        check_mode(ranks, saved, mode)
    if NEWEST:
        check_ep_refusals(ranks)


@pytest.mark.skipif(not ALL, reason="the exhaustive matrix: run with TEST_HF_SHARDED_ALL=1")
def test_the_ci_subset_covers_every_behaviour_row(two, four):
    """Every behaviour row (hf_sharded.behaviour; refusals and transformers' own failures
    included) any family shows in any mode on 2 or 4 ranks is shown by a DEFAULT_FAMILIES family
    too, so the CI run goes through every path the exhaustive run does. Also prints the matrix."""
    print_matrix(two[1], two[0], 2, two[2])
    rows = {}
    for world, (saved, per_rank, _) in ((2, two), (4, four)):
        for mode in _modes(world):
            for family in saved:
                rows.setdefault(row_of(per_rank[0][mode][family], mode), []).append(family)
    uncovered = {row: fams for row, fams in rows.items() if not set(fams) & set(DEFAULT_FAMILIES)}
    for row, fams in sorted(rows.items()):
        print(f"ROW {row}: {fams}")
    assert not uncovered, f"add the first family of each row to DEFAULT_FAMILIES: {uncovered}"
