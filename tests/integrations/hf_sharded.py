"""What the sharded-model tests (test_hf_tp_plan.py) run on each rank and check afterwards: a saved
tiny model loaded the way a mode says, transformers' own forward with its all-reduces counted per
decoder layer, the patch, the comparison, and the family's behaviour row.

A family's behaviour row in a mode (`behaviour`) is what decides which code of the patch it goes
through: refused or not (and why), its shared expert plan-sharded, replicated or absent, gated by
a sigmoid or not, the block's or the decoder layer's, its routed experts EP-sharded or replicated,
with biases or without; and for a family transformers itself cannot load or run in that mode, the
stage and the exception. The CI subset (test_hf_tp_plan.DEFAULT_FAMILIES) is the first family in
table order of every row the exhaustive run (TEST_HF_SHARDED_ALL=1) finds.
"""

from __future__ import annotations

import contextlib
import re
from typing import Optional

import torch
import torch.distributed as dist
import transformers

from fusion_bridge.integrations.transformers import UnsupportedModelError, patch_moe_epilogues
from migration.examples import hf_moe_models
from migration.examples.hf_moe import compare
from tests.integrations.test_hf_transformers import check_summary

NEW_TOKENS = 6  # as test_hf_transformers

# transformers' own failures on our tiny models, each with the reason: {(transformers minor,
# family, mode): (stage, texts)}: the stage ("load": from_pretrained raised; "forward": its own
# sharded forward raised, unpatched, before any patch) and the exception text, one of `texts`
# (it differs between world sizes). mode "*": every mode. A failure not listed here fails the test
# (a finding); one listed that does not happen fails it too.
_KIMI = ("load", ("DeepseekV3Attention has no attribute `k_proj`",))
_LITE = ("forward", ("The size of tensor a (4) must match the size of tensor b (2)",
                     "mat1 and mat2 shapes cannot be multiplied"))  # fmt: skip
TRANSFORMERS_FAILS = {
    # Kimi-K2.5 (a DeepSeek-V3 MLA text model in its wrapper): a sharded load looks up a k_proj
    # in the text model's attention, which MLA does not have (the unsharded load is fine)
    ("5.25", "kimi_k25", "*"): _KIMI,
    ("5.17", "kimi_k25", "*"): _KIMI,
    # GLM-4-MoE-Lite's own sharded forward raises in its MLA attention: on 2 ranks a head count
    # mismatch in SDPA, on 4 a matmul of mismatched shapes
    ("5.25", "glm4_moe_lite", "tp_plan"): _LITE,
    ("5.25", "glm4_moe_lite", "tp_ep"): _LITE,
    ("5.17", "glm4_moe_lite", "tp_plan"): _LITE,
    # Qwen3-VL-MoE under expert parallelism: the load report finds each rank's down_proj shard
    # of the checkpoint [4, 32, 64] where the model holds [4, 64, 32] (the checkpoint stores the
    # experts transposed; the transpose made on a whole load is missing) and stops the load
    ("5.25", "qwen3_vl_moe", "tp_ep"): ("load", ("ignore_mismatched_sizes",)),
    ("5.25", "qwen3_vl_moe", "ep"): ("load", ("ignore_mismatched_sizes",)),
    # transformers 5.17's own sharded forward meets a plain tensor beside the DTensors its plan
    # made (Qwen3-Omni-MoE in its experts' grouped_mm, MiMo-V2-Flash in a cat of its attention)
    ("5.17", "qwen3_omni_moe", "tp_plan"): ("forward", ("got mixed torch.Tensor and DTensor",)),
    ("5.17", "mimo_v2_flash", "tp_plan"): ("forward", ("got mixed torch.Tensor and DTensor",)),
}


def load(path: str, class_name: str, **kwargs) -> torch.nn.Module:
    """The model saved at `path` loaded by transformers with `kwargs` (default: tp_plan="auto"),
    bf16, in eval mode."""
    kwargs = kwargs or dict(tp_plan="auto")
    model = getattr(transformers, class_name).from_pretrained(path, dtype=torch.bfloat16, **kwargs)
    return model.eval()


def all_reduces_per_layer(model, layers, prompt) -> list[int]:
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


def newest() -> bool:
    """Whether the installed transformers has DistributedConfig(ep_size=...) (5.25)."""
    return hasattr(transformers.DistributedConfig(), "ep_size")


def modes(world: int) -> dict:
    """{mode: from_pretrained keyword arguments} this transformers offers (built in the rank)."""
    out = {"tp_plan": dict(tp_plan="auto")}
    if newest():  # transformers 5.25's expert parallelism: TP + EP, and EP alone (tp_plan={})
        config = transformers.DistributedConfig
        out["tp_ep"] = dict(distributed_config=config(tp_size=world, ep_size=world))
        out["ep"] = dict(distributed_config=config(tp_size=world, ep_size=world, tp_plan={}))
    return out


def behaviour(patch) -> tuple:
    """The family's behaviour row as its patch found it (see the module docstring)."""
    layers = list(patch.layers.values())
    shared = sorted(
        {("sharded" if p.shared_sharded else "replicated") if p.shared is not None else "none"
         for p in layers}
    )  # fmt: skip
    family = patch.family
    gated = family.shared_gate_attr is not None and any(p.shared is not None for p in layers)
    biases = any(n.endswith("bias") for p in layers for n, _ in p.block.experts.named_parameters())
    return (
        "patched",
        f"shared expert {'/'.join(shared)}"
        + (", gated" if gated else "")
        + (", on the decoder layer" if family.shared_on_layer else ""),
        "routed experts " + ("EP-sharded" if layers[0].experts_sharded else "replicated"),
        "expert biases" if biases else "no expert biases",
    )


def _groups() -> set:
    """The process groups this process holds now (torch.distributed's own registry)."""
    return set(dist.distributed_c10d._world.pg_map)


@contextlib.contextmanager
def own_groups():
    """Inside: a model's load makes its device meshes' process groups (transformers makes new
    ones at every from_pretrained; each gloo group keeps threads of its own). On leaving, after a
    barrier, the groups made inside are destroyed, so one process can load every family in every
    mode without piling up thousands of threads. Nothing is destroyed when the body raises."""
    before = _groups()
    yield  # a rank that raised inside ends with its groups (no barrier its peers would not reach)
    dist.barrier()  # every rank is done with them
    for group in _groups() - before:
        dist.destroy_process_group(group)


def family_result(family, path, class_name, rank, world, prompt, kwargs) -> dict:
    """One family in one mode on this rank: transformers' own sharded forward (its all-reduces
    counted), then patched (counted), compared with hf_moe.compare, unpatched. A failure of
    transformers' own loading or forward is returned with its stage (`transformers_failed`); a
    refusal with its text; anything else raised from the patch propagates. The groups the load
    made are destroyed on the way out (own_groups)."""
    with own_groups():
        return _family_result(family, path, class_name, rank, world, prompt, kwargs)


def _family_result(family, path, class_name, rank, world, prompt, kwargs) -> dict:
    stage = "load"
    try:
        model = load(path, class_name, **kwargs)
        routed_sharded = "moe_tp_experts" in (model._tp_plan or {}).values()
        layers = [m for m in model.modules() if hasattr(m, "input_layernorm")]
        own_forwards = {
            n: vars(m)["forward"] for n, m in model.named_modules() if "forward" in vars(m)
        }
        stage = "forward"  # transformers' own sharded forward, before any patch
        unpatched = all_reduces_per_layer(model, layers, prompt)
    except Exception as exc:  # transformers' own: the test compares it with TRANSFORMERS_FAILS
        return {"family": family, "rank": rank, "transformers_failed": stage,
                "error": f"{type(exc).__name__}: {str(exc)[:600]}"}  # fmt: skip
    try:
        patch = patch_moe_epilogues(model)
    except UnsupportedModelError as exc:
        return {"family": family, "rank": rank, "refused": str(exc),
                "routed_sharded": routed_sharded}  # fmt: skip
    row = behaviour(patch)
    paths = {id(m): n for n, m in model.named_modules()}
    plan_shards_shared = {
        i: p.shared is not None and _plan_names(model, paths[id(p.shared)])
        for i, p in patch.layers.items()
    }
    shared_sharded = {i: p.shared_sharded for i, p in patch.layers.items()}
    experts_sharded = {i: p.experts_sharded for i, p in patch.layers.items()}
    patched = all_reduces_per_layer(model, layers, prompt)
    patch.unpatch()
    summary = compare(model, None, world, prompt, NEW_TOKENS)
    # transformers' own TP forwards are its, before and after: only what the patch set must go
    summary["left_patched"] = [n for n in summary["left_patched"] if n not in own_forwards]
    after = {n: vars(m)["forward"] for n, m in model.named_modules() if "forward" in vars(m)}
    summary["tp_forwards_restored"] = after == own_forwards
    summary.update(family=family, rank=rank, all_reduces=(unpatched, patched), behaviour=row)
    summary.update(shared_sharded=shared_sharded, experts_sharded=experts_sharded)
    summary["plan_shards_shared"] = plan_shards_shared
    return summary


def _plan_names(model, shared: str) -> bool:
    """Whether the model's TP plan has an entry for the shared expert's down_proj at `shared`
    ('*' in a key: one path component), the test's own reading of the plan."""
    for key in getattr(model, "_tp_plan", None) or {}:
        if re.fullmatch(re.escape(key).replace(r"\*", r"[^.]+"), f"{shared}.down_proj"):
            return True
    return False


def row_of(result: dict, mode: str) -> tuple:
    """The behaviour row of one rank's result (patched, refused or transformers' failure)."""
    if "transformers_failed" in result:
        return (mode, f"transformers fails at {result['transformers_failed']}",
                result["error"].split(":")[0])  # fmt: skip
    if "refused" in result:
        kind = "moe_tp_experts" if result["routed_sharded"] else "other"
        return (mode, "refused", kind)
    return (mode, *result["behaviour"])


def expected_failure(version: str, family: str, mode: str) -> Optional[tuple]:
    """TRANSFORMERS_FAILS' (stage, text) for this family and mode, or None."""
    minor = ".".join(version.split(".")[:2])
    for key in ((minor, family, mode), (minor, family, "*")):
        if key in TRANSFORMERS_FAILS:
            return TRANSFORMERS_FAILS[key]
    return None


# the head counts of a config a TP plan may split: KV heads, linear attention's key / value heads
_HEAD_COUNTS = ("num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads")


@contextlib.contextmanager
def kv_heads_multiple_of(world: int):
    """Inside: hf_moe_models builds every config with its KV heads and linear attention's heads a
    multiple of `world` (`world` of them where a family's config hard-codes 2; the attention
    heads are 4 already), so transformers' TP plan can split them over `world` ranks; models
    built outside keep their sizes."""
    original = hf_moe_models._configs

    def configs(family: str, s: dict, common: dict):
        class_name, kwargs = original(family, s, common)
        for where in (kwargs, kwargs.get("text_config")):
            for key in _HEAD_COUNTS:
                heads = (where or {}).get(key)
                if heads is not None and heads % world:
                    where[key] = world
                    if family == "mimo_v2_flash":  # its sliding-window layers hold twice the
                        where["num_attention_heads"] = 2 * world  # KV heads: as many queries
        return class_name, kwargs

    hf_moe_models._configs = configs
    try:
        yield
    finally:
        hf_moe_models._configs = original


def ep_refusals(saved: dict, world: int) -> dict:
    """transformers 5.25 models whose expert parallelism the patch refuses as a whole, loaded for
    real: an EP group that is not the TP group (FSDP over the ranks makes room for it:
    DistributedConfig(tp_size=W/2, fsdp_size=2, ep_size=W), the mesh transformers builds; AutoEP
    then exchanges tokens all-to-all) and DeepGEMM Mega MoE experts (the load-time choice
    experts_implementation="deepgemm_megamoe": the refusal comes before any forward, so no
    DeepGEMM kernel is needed on CPU)."""
    config, where = transformers.DistributedConfig, saved["qwen2_moe"]
    apart = config(tp_size=world // 2, fsdp_size=2, ep_size=world)
    mega = dict(distributed_config=config(tp_size=world, ep_size=world))
    return {
        "ep_not_tp": refusal(load(*where, distributed_config=apart)),
        "megamoe": refusal(load(*where, experts_implementation="deepgemm_megamoe", **mega)),
    }


def check_ep_refusals(per_rank: list) -> None:
    """Every rank refused both models of ep_refusals, naming the groups / the experts."""
    world = len(per_rank)
    for rank, r in enumerate(per_rank):
        ep_ranks, tp_ranks = list(range(world)), [rank - rank % (world // 2) + i
                                                    for i in range(world // 2)]  # fmt: skip
        refused = r["ep_refusals"]
        head = (
            f"UnsupportedModelError: patch_moe_epilogues: the model was loaded with expert "
            f"parallelism (DistributedConfig(ep_size={world})) under transformers "
            f"{transformers.__version__}, which the patch cannot take over: "
        )
        assert refused["ep_not_tp"].startswith(
            head + f"its EP group (ranks {ep_ranks}) is not its TP group (ranks {tp_ranks})"
        ), refused["ep_not_tp"]
        assert refused["megamoe"].startswith(
            head + "DeepGEMM Mega MoE experts exchange tokens inside their kernel"
        ), refused["megamoe"]


def refusal(model, **kwargs) -> str:
    try:
        patch_moe_epilogues(model, **kwargs).unpatch()
        return "patched"
    except ValueError as exc:  # UnsupportedModelError is one
        return f"{type(exc).__name__}: {exc}"


def check_mode(per_rank, saved, mode: str) -> None:
    """Every family loaded in `mode` on every rank: transformers' own failures only where
    TRANSFORMERS_FAILS lists them, with their reason; refused only where expected (5.17's
    moe_tp_experts); else within the bound, ranks identical, unpatch exact, and one all-reduce
    per MoE layer: the layer's own, less the plan-sharded shared expert's and AllReduceEP's."""
    for family in saved:
        ranks = [per_rank[r][mode][family] for r in range(len(per_rank))]
        known = expected_failure(transformers.__version__, family, mode)
        if known is not None or "transformers_failed" in ranks[0]:
            for r in ranks:  # listed with its reason, and failing for that reason
                assert known is not None, (mode, family, r.get("transformers_failed"), r)
                assert r.get("transformers_failed") == known[0], (mode, family, r)
                assert any(text in r["error"] for text in known[1]), (mode, family, r["error"])
            continue
        if "refused" in ranks[0]:
            # only where transformers' plan shards the routed experts (5.17's moe_tp_experts)
            assert not newest() and ranks[0]["routed_sharded"], ranks[0]["refused"]
            for r in ranks:
                assert "cannot be patched under transformers 5.17" in r["refused"]
                assert "'moe_tp_experts'" in r["refused"] and "experts: a replaced" in r["refused"]
            continue
        for r in ranks:
            assert "refused" not in r and "transformers_failed" not in r, (family, r)
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
        # the shared expert is the plan's shard exactly where the TP plan names it
        assert ranks[0]["shared_sharded"] == ranks[0]["plan_shards_shared"], (mode, family)
        assert set(ranks[0]["experts_sharded"].values()) == {mode != "tp_plan"}, (mode, family)
        for other in ranks[1:]:
            assert other["logits_checksum"] == ranks[0]["logits_checksum"], family
            assert other["sequences"] == ranks[0]["sequences"], family


def print_matrix(per_rank, saved, world: int, seconds: float) -> None:
    """One line per family and mode: the outcome, all-reduces per decoder layer (transformers'
    own -> patched), worst error / bound; then the group's wall time."""
    for mode in modes(world):
        for family in saved:
            r = per_rank[0][mode][family]
            took = max(p["seconds"][mode, family] for p in per_rank)
            if "transformers_failed" in r:
                what = f"transformers fails at {r['transformers_failed']}: {r['error'][:120]}"
            elif "refused" in r:
                what = "refused: " + r["refused"].splitlines()[0][:160]
            else:
                unpatched, patched = r["all_reduces"]
                what = (f"pass; all-reduces {unpatched} -> {patched} (MoE layers "
                        f"{r['moe_layers']}); worst error/bound {r['max_rel_err_over_bound']:.2f}"
                        f"; {' / '.join(r['behaviour'][1:])}")  # fmt: skip
            print(f"MATRIX W={world} {mode} {family}: {what} ({took:.1f} s)")
    print(f"MATRIX W={world}: {len(saved)} families, group wall time {seconds:.0f} s")
