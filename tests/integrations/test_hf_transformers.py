"""fusion_bridge.integrations.transformers on real transformers models (tiny random configs of every
supported family, bf16, CPU): the patched model against the unmodified one on 1 rank (in this
process) and on 2 gloo ranks (one spawned group running every family), greedy generate with a KV
cache, the way back, and the refusals. The bound is derived in migration/examples/hf_moe_bound.py
(logits_bound). Whatever transformers release is installed is the one tested (CI runs both ends of
the supported range)."""

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusion_bridge.cli.launch import run_distributed  # noqa: E402
from fusion_bridge.integrations.transformers import (  # noqa: E402
    UnsupportedModelError,
    patch_moe_epilogues,
    unpatch_moe_epilogues,
)
from migration.examples.hf_moe import (  # noqa: E402
    FAMILIES,
    PROMPT,
    TINY,
    build_model,
    compare,
    run_rank,
)
from migration.examples.hf_moe_bound import Recorder, tainted_positions  # noqa: E402
from migration.examples.hf_moe_models import why_skipped  # noqa: E402

NEW_TOKENS = 6


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def check_summary(r: dict, config: dict = TINY) -> None:
    """The assertions every (family, rank) result must pass; below-bound steps are only printed.
    config: the model size the result was built with (TINY on CPU, LARGE on the GPU)."""
    where = f"{r['family']} rank {r['rank']}"
    # the first MoE layer sees identical inputs in both models, so it must route identically
    assert r["first_moe_layer_routing_equal"], where
    print(
        f"{where}: max rel err / bound {r['max_rel_err_over_bound']:.2f} on "
        f"{r['clean_tokens']}/{r['tokens']} tokens; routing flips (layer, seq, pos) "
        f"{r['routing_flips']}; generate: {r['generate_covered_steps']} steps asserted, "
        f"reported (gap below the bound) {r['generate_reported_steps']}"
    )
    # a flip taints only tokens the bound does not cover; most tokens must stay covered (a broken
    # patch that routes differently everywhere would otherwise assert nothing)
    assert r["clean_tokens"] >= r["tokens"] // 2, where
    assert r["max_rel_err_over_bound"] <= 1.0, where
    assert not r["generate_covered_disagree"], where
    # every MoE layer's norm came from the bridge, on every forward call (none computed twice)
    assert r["norms_reused"] == len(r["moe_layers"]) * r["patched_calls"], where
    assert sorted(r["strategies"]) == r["moe_layers"], r["strategies"]
    for layer, strategy in r["strategies"].items():  # each layer's report names its plan
        section = r["explain"].split(f"layer {layer} (")[1].split("\nlayer ")[0]
        assert f"spec: H={config['hidden']} K={config['top_k']} bf16" in section
        assert isinstance(strategy, str) and strategy in section
    # unpatch() gave the model back exactly: its own logits, bit for bit, no attribute left
    assert r["unpatch_restores_logits"] and not r["left_patched"], (where, r["left_patched"])


# a tiny model's weights stay below this: the largest TINY family holds about 0.5 MB; a config
# default left at the released size (dots.3-note's sliding-window layers: 64 heads at rank 1024,
# 77 MB) makes every patch's model check and the shared 2-rank group slow for no coverage
TINY_WEIGHT_BYTES = 4 << 20


def test_every_family_on_one_rank():
    results = run_rank(0, 1, new_tokens=NEW_TOKENS)
    assert [r["family"] for r in results] == list(FAMILIES)
    for r in results:
        if "skipped" in r:  # a family this transformers release does not have
            print(r["family"], r["skipped"])
            continue
        check_summary(r)
        assert r["weight_bytes"] <= TINY_WEIGHT_BYTES, (r["family"], r["weight_bytes"])


def _refusal(build) -> str:
    try:
        patch_moe_epilogues(build())
    except ValueError as exc:
        return str(exc)
    return "patched"


SHARDS = 3  # the families over this many 2-rank groups, so xdist workers share the work


def _two_ranks(rank: int, world: int, shard: int) -> list:
    """Every SHARDS-th family from `shard` on, on this rank of a 2-rank group."""
    torch.set_num_threads(1)  # as one_torch_thread: tiny models, two processes on a shared CPU
    return run_rank(rank, world, families=FAMILIES[shard::SHARDS], new_tokens=NEW_TOKENS)


def _two_rank_refusals(rank: int, world: int) -> dict:
    """What a 2-rank group refuses: different models, too few experts, different prompts."""
    torch.set_num_threads(1)
    out = {}
    # a group whose ranks hold different models is refused on every rank
    out["mismatch"] = _refusal(lambda: build_model("qwen3_moe", TINY, seed=rank))
    out["too_few"] = _refusal(lambda: build_model("qwen3_moe", dict(TINY, experts=1, top_k=1)))
    # ranks fed different prompts: check_same_inputs says so on every rank; debug mode says, at
    # the first MoE layer, that the ranks are on the same call with different inputs
    model = build_model("qwen3_moe", TINY)
    prompt = torch.randint(1, TINY["vocab"], (2, 8), generator=torch.Generator().manual_seed(rank))
    patch = patch_moe_epilogues(model, debug=True)
    try:
        patch.check_same_inputs(prompt)
        out["check_same_inputs"] = "passed"
    except ValueError as exc:
        out["check_same_inputs"] = str(exc)
    patch.check_same_inputs(torch.arange(6))  # equal on both ranks: passes
    try:
        with torch.no_grad():
            model(prompt)
        out["debug"] = "ran"
    except Exception as exc:  # noqa: BLE001 - the parent asserts on type and text
        out["debug"] = f"{type(exc).__name__}: {exc}"
    patch.unpatch()
    return out


@pytest.mark.parametrize("shard", range(SHARDS))
def test_every_family_on_two_gloo_ranks(shard):
    per_rank = run_distributed(_two_ranks, 2, shard, timeout_s=600)
    families = FAMILIES[shard::SHARDS]
    assert [r["family"] for r in per_rank[0]] == list(families)
    for family_index, family in enumerate(families):
        ranks = [per_rank[r][family_index] for r in range(2)]
        if "skipped" in ranks[0]:
            continue
        for r in ranks:
            check_summary(r)
        # each rank computes half the experts; after the all-reduce both hold the same outputs
        assert ranks[0]["logits_checksum"] == ranks[1]["logits_checksum"], family
        assert ranks[0]["sequences"] == ranks[1]["sequences"], family


def test_two_gloo_ranks_refuse_different_models_too_few_experts_and_different_prompts():
    per_rank = run_distributed(_two_rank_refusals, 2, timeout_s=600)
    for r in range(2):
        out = per_rank[r]
        assert "every rank of the group must hold the same model" in out["mismatch"]
        # rank 0's model is the one compared against; the other rank is the one named
        assert "; rank 1 differs from rank 0 in " in out["mismatch"], out["mismatch"]
        assert "at most the number of routed experts (1)" in out["too_few"]
        assert "argument 0 must be identical on every rank" in out["check_same_inputs"]
        assert "rank(s) [1] differ from rank 0" in out["check_same_inputs"]
        assert out["debug"].startswith("GroupInputError"), out["debug"]
        assert re.search(
            r"on the same call \(bridge \d+ call 1\) but with different replicated inputs",
            out["debug"],
        ), out["debug"]
        assert "the residual differs on rank 1 from rank 0" in out["debug"]


def test_unpatch_restores_the_model_and_refuses_a_second_patch():
    model = build_model("deepseek_v3", TINY)
    prompt = torch.randint(1, 256, (1, 7), generator=torch.Generator().manual_seed(3))
    keys = list(model.state_dict())
    with torch.no_grad():
        before = model(prompt).logits
        patch = patch_moe_epilogues(model)
        with pytest.raises(ValueError, match="already patched"):
            patch_moe_epilogues(model)
        assert sorted(patch.layers) == [1, 2]
        assert patch.layers[2].next_norm == "model.norm"
        assert patch.layers[1].next_norm == "model.layers.2.input_layernorm"
        assert model.model.layers[1].moe_epilogue is patch.layers[1]
        text = patch.explain(7)
        assert "layer 1" in text and "layer 2" in text and "routed experts 0..7" in text
        during = model(prompt).logits
        assert list(model.state_dict()) == keys  # nothing registered as a module or parameter
        unpatch_moe_epilogues(model)
        after = model(prompt).logits
    assert not torch.equal(before, during)  # the patch did change the computation
    assert torch.equal(before, after)
    for module in model.modules():
        assert "forward" not in vars(module) and "moe_epilogue" not in vars(module)


def test_a_deepseek_v3_model_whose_config_says_kimi_k2_is_patched():
    """Kimi-K2's config.json says model_type 'kimi_k2' with the DeepSeek-V3 architecture; built
    through DeepseekV3Config it keeps that type."""
    model = build_model("deepseek_v3", TINY)
    model.config.model_type = "kimi_k2"
    prompt = torch.randint(1, 256, (2, 8), generator=torch.Generator().manual_seed(5))
    recorder = Recorder(model)
    with torch.no_grad():
        ref = model(prompt).logits.float()
        patch = patch_moe_epilogues(model)
        assert patch.family.name == "DeepSeek-V3" and sorted(patch.layers) == [1, 2]
        new = model(prompt).logits.float()
        patch.unpatch()
    bound = recorder.bound(recorder.calls[0], model, 1)[1].view(2, 8)
    tainted, _ = tainted_positions(
        [recorder.calls[0]["routing"]], [recorder.calls[1]["routing"]], recorder, 2
    )
    recorder.remove()
    rel = (new - ref).norm(dim=-1) / ref.norm(dim=-1)
    clean = torch.tensor([[p not in tainted[b] for p in range(8)] for b in range(2)])
    assert int(clean.sum()) >= 8 and float((rel / bound)[clean].max()) <= 1.0


def test_refuses_an_unsupported_family_naming_its_difference_and_the_supported_types():
    config = transformers.PhimoeConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    model = transformers.PhimoeForCausalLM(config).to(torch.bfloat16).eval()
    with pytest.raises(UnsupportedModelError) as err:
        patch_moe_epilogues(model)
    assert "model_type='phimoe'" in str(err.value)
    assert "LayerNorm, not RMSNorm: PhimoeDecoderLayer's norms are LayerNorm" in str(err.value)
    for name in (
        "'deepseek_v3'",
        "'kimi_k2'",
        "'kimi_k25'",
        "'deepseek_v2'",
        "'glm4_moe'",
        "'qwen2_moe'",
        "'qwen3_moe'",
        "'qwen3_5_moe'",
        "'mixtral'",
        "'minimax_m2'",
        "'gpt_oss'",
        "'olmoe'",
    ):
        assert name in str(err.value), name


def test_refuses_remote_code_a_quantized_expert_layout_and_a_quantized_model():
    model = build_model("deepseek_v3", TINY)
    block = model.model.layers[1].mlp
    # what trust_remote_code=True loads: the repository's own classes, not transformers'
    remote = type(type(block).__name__, (type(block),), {"__module__": "transformers_modules.kimi"})
    block.__class__ = remote
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.mlp must be transformers"):
        patch_moe_epilogues(model)
    model = build_model("qwen3_moe", TINY)
    experts = model.model.layers[2].mlp.experts
    experts.gate_up_proj = torch.nn.Parameter(
        experts.gate_up_proj.detach().to(torch.float8_e4m3fn), requires_grad=False
    )
    with pytest.raises(
        UnsupportedModelError, match=r"layers\.2\.mlp\.experts\.gate_up_proj.*float8"
    ):
        patch_moe_epilogues(model)
    model = build_model("qwen3_moe", TINY)
    experts = model.model.layers[0].mlp.experts
    experts.register_buffer("down_proj_scale_inv", torch.ones(TINY["experts"]))
    with pytest.raises(UnsupportedModelError, match="down_proj_scale_inv"):
        patch_moe_epilogues(model)
    model.config.quantization_config = {"quant_method": "fp8"}
    with pytest.raises(UnsupportedModelError, match="quantization_config: fp8"):
        patch_moe_epilogues(model)
    for module in model.modules():  # a refused patch leaves nothing behind
        assert "forward" not in vars(module)


def test_refuses_a_group_without_torch_distributed_and_a_float32_model_naming_fp32():
    model = build_model("deepseek_v3", TINY)
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        patch_moe_epilogues(model, group=object())
    with pytest.raises(UnsupportedModelError, match=r"torch\.float32 \(fp32\).*model\.to"):
        patch_moe_epilogues(model.float())


def test_a_routing_flip_taints_its_token_and_before_the_last_layer_every_later_one():
    class Layers:  # what tainted_positions reads from a Recorder
        last_layer = 2

    same = torch.arange(8).view(4, 2)  # 2 sequences x 2 positions, top-2
    flipped = same.clone()
    flipped[1] = torch.tensor([2, 7])  # sequence 0, position 1
    prefill = ({1: same, 2: same}, {1: same, 2: flipped})  # flip in the last layer
    decode = ({1: same[:2], 2: same[:2]}, {1: same[:2].flip(0), 2: same[:2]})  # layer 1, step 1
    tainted, flips = tainted_positions(
        [prefill[0], decode[0]], [prefill[1], decode[1]], Layers, batch=2
    )
    assert flips == [(2, 0, 1), (1, 0, 2), (1, 1, 2)]
    assert [p in tainted[0] for p in range(5)] == [False, True, True, True, True]
    assert [p in tainted[1] for p in range(5)] == [False, False, True, True, True]


def test_eval_mode_only_arguments_by_position_and_a_layer_that_misuses_the_block_output():
    model = build_model("qwen3_moe", TINY)
    with pytest.raises(ValueError, match="eval mode"):
        patch_moe_epilogues(model.train())
    model.eval()
    patch = patch_moe_epilogues(model)
    layer = model.model.layers[0]
    hidden = torch.randn(1, 5, TINY["hidden"]).to(torch.bfloat16)
    position_ids = torch.arange(5).unsqueeze(0)
    rope = model.model.rotary_emb(hidden, position_ids)
    with torch.no_grad():
        by_keyword = layer(hidden, position_ids=position_ids, position_embeddings=rope)
        by_position = layer(hidden, None, position_ids, None, False, rope)
        assert torch.equal(by_keyword, by_position)
        # the block's output is the bridge's handoff: anything but `residual + it` is refused
        out = layer.mlp(hidden)
        with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.mlp used its MoE "):
            out * 2
    # model.train() after patching: the patched block refuses to run, saying what to do
    model.train()
    with pytest.raises(RuntimeError, match=r"training mode \(model\.train\(\) was called after"):
        model(torch.arange(1, 6).unsqueeze(0))
    patch.unpatch()
    model(torch.arange(1, 6).unsqueeze(0)).logits.sum().backward()  # their own code again


def test_a_handoff_added_to_the_residual_twice_is_refused_and_runs_the_bridge_once():
    """The block's handoff stands for one output: the first `residual + it` runs the bridge, a
    second add (a layer structure the patch does not know) raises instead of running the bridge's
    call, and its collective, again."""
    model = build_model("qwen3_moe", TINY)
    patch = patch_moe_epilogues(model)
    layer_patch = patch.layers[0]
    calls = []
    bridge_call = layer_patch.bridge.finalize_epilogue
    layer_patch.bridge.finalize_epilogue = lambda *a, **k: calls.append(1) or bridge_call(*a, **k)
    hidden = torch.randn(1, 5, TINY["hidden"]).to(torch.bfloat16)
    try:
        with torch.no_grad():
            out = model.model.layers[0].mlp(hidden)
            first = hidden + out
            assert first.shape == hidden.shape and len(calls) == 1
            with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.mlp used its MoE"):
                hidden + out
    finally:
        del layer_patch.bridge.finalize_epilogue
        patch.unpatch()
    assert len(calls) == 1, "the second add ran the bridge again"


def test_the_bridge_takes_the_norm_s_own_eps():
    """A model whose RMSNorms have eps 1e-2 (its hidden states' mean square is well below that, so
    eps changes every norm): the patched model's logits stay within the bound of the unmodified
    one's, and every bridge's spec carries the eps of the norm it computes."""
    model = build_model("qwen3_moe", TINY)
    norms = [m for m in model.modules() if hasattr(m, "variance_epsilon")]
    assert norms
    for norm in norms:
        norm.variance_epsilon = 1e-2
    patch = patch_moe_epilogues(model)
    assert {layer.bridge.spec.eps for layer in patch.layers.values()} == {1e-2}
    patch.unpatch()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, TINY["vocab"], PROMPT, generator=g)
    r = {"family": "qwen3_moe", "rank": 0, **compare(model, None, 1, prompt, NEW_TOKENS)}
    check_summary(r)


def test_the_model_check_names_the_rank_that_differs():
    """The model check compares every rank's model with rank 0's and names the first that differs:
    the fingerprints of a group of 3 ranks whose rank 2 holds other weights, compared as every
    rank compares the gathered list."""
    from fusion_bridge.integrations import hf_model_check

    model, other = build_model("qwen3_moe", TINY), build_model("qwen3_moe", TINY, seed=1)
    moe = [0, 1, 2]
    gathered = [hf_model_check.fingerprint(m, moe) for m in (model, model, other)]
    with pytest.raises(ValueError, match="must hold the same model") as err:
        hf_model_check.compare_ranks(gathered)
    assert "; rank 2 differs from rank 0 in parameters [" in str(err.value), str(err.value)
    gathered[2] = gathered[0]
    hf_model_check.compare_ranks(gathered)  # the same model everywhere: no error


def test_the_families_this_transformers_has():
    """The ten families of the first adapter run from transformers 5.17 on; a family added with
    the table may be missing from an older release, or differ there from what the patch moves
    (granitemoe's router at 5.17): skipped by the tests above with its reason, counted here in one
    line."""
    skipped = {f: why_skipped(f) for f in FAMILIES if why_skipped(f) is not None}
    print(
        f"transformers {transformers.__version__}: {len(FAMILIES) - len(skipped)} of "
        f"{len(FAMILIES)} families tested, {len(skipped)} skipped: {skipped}"
    )
    assert not [f for f in FAMILIES[:10] if f in skipped], skipped
    # a family the installed release has is skipped only where that release's code differs from
    # what the patch moves, as known for the older releases: anything else the patch refuses is a
    # broken row, never a skip
    refused = {f for f, why in skipped.items() if why != "not in this transformers"}
    older = tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 25)
    assert refused <= (REFUSED_BEFORE_5_25 if older else set()), refused


# families whose transformers 5.17 code differs from what the patch moves (the refusal says how)
REFUSED_BEFORE_5_25 = {"granitemoe", "granitemoeshared", "aria_text", "aria"}


def test_the_package_never_imports_transformers_itself():
    import subprocess
    import sys

    code = (
        "import sys, fusion_bridge, fusion_bridge.integrations.transformers\n"
        "from fusion_bridge import FusionBridge, EpilogueSpec\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_residual_multiplier_is_taken_exactly_once_and_only_as_the_family_states():
    """granitemoe's layer adds residual + h * residual_multiplier: the handoff accepts exactly
    that product once (the bridge folded m into both partials), and refuses any other factor or
    an add without it, rather than compute something else."""
    if why_skipped("granitemoe") is not None:
        pytest.skip(f"granitemoe: {why_skipped('granitemoe')}")
    model = build_model("granitemoe", TINY)
    patch = patch_moe_epilogues(model)
    layer = model.model.layers[0]
    hidden = torch.randn(1, 5, TINY["hidden"]).to(torch.bfloat16)
    with torch.no_grad():
        for misuse in (lambda h: h * 3.0, lambda h: hidden + h, lambda h: h * 0.5 * 0.5):
            with pytest.raises(UnsupportedModelError, match=r"block_sparse_moe used its MoE"):
                misuse(layer.block_sparse_moe(hidden))
        residual_out = hidden + layer.block_sparse_moe(hidden) * layer.residual_multiplier
    patch.unpatch()
    with torch.no_grad():
        own = hidden + layer.block_sparse_moe(hidden) * layer.residual_multiplier
    rel = float((residual_out.float() - own.float()).norm() / own.float().norm())
    assert rel < 0.02, rel  # the same sum up to bf16 roundings (the bound is the family test's)
