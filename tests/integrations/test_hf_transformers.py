"""fusion_bridge.integrations.transformers on real transformers models (small random configs, bf16,
CPU): the patched model against the unmodified one on 1 and 2 gloo ranks (real processes), the way
back, and the refusals. The bound is derived in migration/examples/hf_moe_bound.py
(logits_bound)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusion_bridge.cli.launch import run_distributed  # noqa: E402
from fusion_bridge.integrations.transformers import (  # noqa: E402
    UnsupportedModelError,
    patch_moe_epilogues,
    unpatch_moe_epilogues,
)
from migration.examples.hf_moe import SMALL, build_model, run_rank, tainted_positions  # noqa: E402

NEW_TOKENS = 16


def check_summary(r: dict, config: dict = SMALL) -> None:
    """The assertions every (family, rank) result must pass; below-bound steps are only printed.
    config: the model size the result was built with (SMALL on CPU, LARGE on the GPU)."""
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


def test_patched_model_matches_unmodified_on_one_rank():
    for r in run_rank(0, 1, new_tokens=NEW_TOKENS):
        check_summary(r)


def _two_ranks(rank: int, world: int) -> dict:
    results = run_rank(rank, world, new_tokens=NEW_TOKENS)
    # a group whose ranks hold different models is refused on every rank
    other = build_model("qwen3_moe", SMALL, seed=rank)
    try:
        patch_moe_epilogues(other)
        mismatch = None
    except ValueError as exc:
        mismatch = str(exc)
    few = build_model("qwen3_moe", dict(SMALL, experts=1, top_k=1), seed=0)
    try:
        patch_moe_epilogues(few)
        too_few = None
    except ValueError as exc:
        too_few = str(exc)
    return {"results": results, "mismatch": mismatch, "too_few": too_few}


def test_patched_model_matches_unmodified_on_two_gloo_ranks():
    per_rank = run_distributed(_two_ranks, 2, timeout_s=600)
    for family_index in range(2):
        ranks = [per_rank[r]["results"][family_index] for r in range(2)]
        for r in ranks:
            check_summary(r)
        # each rank computes half the experts; after the all-reduce both hold the same outputs
        assert ranks[0]["logits_checksum"] == ranks[1]["logits_checksum"]
        assert ranks[0]["sequences"] == ranks[1]["sequences"]
    for r in range(2):
        assert "every rank of the group must hold the same model" in per_rank[r]["mismatch"]
        assert "at most the number of routed experts (1)" in per_rank[r]["too_few"]


def test_unpatch_restores_the_model_and_refuses_a_second_patch():
    model = build_model("deepseek_v3", SMALL)
    prompt = torch.randint(1, 512, (1, 7), generator=torch.Generator().manual_seed(3))
    keys = list(model.state_dict())
    with torch.no_grad():
        before = model(prompt).logits
        patch = patch_moe_epilogues(model)
        with pytest.raises(ValueError, match="already patched"):
            patch_moe_epilogues(model)
        assert sorted(patch.layers) == [1, 2]
        assert patch.layers[2].next_norm == "norm" and patch.layers[1].next_norm.endswith(
            "layers.2.input_layernorm"
        )
        assert model.model.layers[1].moe_epilogue is patch.layers[1]
        text = patch.explain(7)
        assert "layer 1" in text and "layer 2" in text and "routed experts 0..15" in text
        during = model(prompt).logits
        assert list(model.state_dict()) == keys  # nothing registered as a module or parameter
        unpatch_moe_epilogues(model)
        after = model(prompt).logits
    assert not torch.equal(before, during)  # the patch did change the computation
    assert torch.equal(before, after)
    for module in model.modules():
        assert "forward" not in vars(module) and "moe_epilogue" not in vars(module)


def test_a_hook_that_replaces_an_moe_layers_output_gets_the_norm_of_what_it_returned():
    """The bridge computes the next norm of the tensor the MoE layer returns; a forward hook that
    returns another tensor must get that tensor's norm, not the bridge's. Hooked on the last MoE
    layer, returning a fixed tensor: everything after it (the final norm, lm_head) is then the
    model's own code on the same values, so the logits equal the unmodified model's bit for bit
    (with the bridge's norm of the layer's own output they were 0.134 off, relative)."""
    model = build_model("deepseek_v3", SMALL)
    prompt = torch.randint(1, 512, (1, 7), generator=torch.Generator().manual_seed(5))
    fixed = torch.randn(1, 7, SMALL["hidden"], generator=torch.Generator().manual_seed(6))
    fixed = fixed.to(torch.bfloat16)
    hook = model.model.layers[2].register_forward_hook(lambda module, args, out: fixed.clone())
    try:
        with torch.no_grad():
            unmodified = model(prompt).logits
            # the handoff is the patch's, whatever the strategy: the cheapest one, no self-test
            patch = patch_moe_epilogues(model, strategy="separate", self_test=False)
            try:
                assert patch.layers[2].next_norm == "norm"
                patched = model(prompt).logits
                reused = patch.norms_reused
            finally:
                patch.unpatch()
    finally:
        hook.remove()
    assert reused == 1  # layer 1's norm (layer 2's input norm) still came from the bridge
    assert torch.equal(patched, unmodified)


def test_refuses_an_unsupported_family():
    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    model = transformers.MixtralForCausalLM(config).to(torch.bfloat16)
    with pytest.raises(UnsupportedModelError) as err:
        patch_moe_epilogues(model)
    for name in ("'mixtral'", "'deepseek_v3'", "'qwen3_moe'"):
        assert name in str(err.value)


def test_refuses_a_quantized_expert_layout_and_a_quantized_model():
    model = build_model("qwen3_moe", SMALL)
    experts = model.model.layers[2].mlp.experts
    experts.gate_up_proj = torch.nn.Parameter(
        experts.gate_up_proj.detach().to(torch.float8_e4m3fn), requires_grad=False
    )
    with pytest.raises(
        UnsupportedModelError, match=r"layers\.2\.mlp\.experts\.gate_up_proj.*float8"
    ):
        patch_moe_epilogues(model)
    model = build_model("qwen3_moe", SMALL)
    experts = model.model.layers[0].mlp.experts
    experts.register_buffer("down_proj_scale_inv", torch.ones(SMALL["experts"]))
    with pytest.raises(UnsupportedModelError, match="down_proj_scale_inv"):
        patch_moe_epilogues(model)
    model.config.quantization_config = {"quant_method": "fp8"}
    with pytest.raises(UnsupportedModelError, match="quantization_config: fp8"):
        patch_moe_epilogues(model)
    for module in model.modules():  # a refused patch leaves nothing behind
        assert "forward" not in vars(module)


def test_refuses_a_group_without_torch_distributed_and_a_float32_model():
    model = build_model("deepseek_v3", SMALL)
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        patch_moe_epilogues(model, group=object())
    with pytest.raises(UnsupportedModelError, match="bf16 or fp16"):
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


def test_a_patched_layer_takes_its_arguments_by_position_as_by_keyword_and_needs_eval_mode():
    model = build_model("qwen3_moe", SMALL)
    with pytest.raises(ValueError, match="eval mode"):
        patch_moe_epilogues(model.train())
    model.eval()
    patch = patch_moe_epilogues(model)
    layer = model.model.layers[0]
    hidden = torch.randn(1, 5, SMALL["hidden"]).to(torch.bfloat16)
    position_ids = torch.arange(5).unsqueeze(0)
    rope = model.model.rotary_emb(hidden, position_ids)
    with torch.no_grad():
        by_keyword = layer(hidden, position_ids=position_ids, position_embeddings=rope)
        by_position = layer(hidden, None, position_ids, None, False, rope)
    patch.unpatch()
    assert torch.equal(by_keyword, by_position)


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
