"""Random-weight transformers models of every family the adapter supports, from transformers' own
config and model classes (no download), at a size the caller picks.

`build_model(family, size)` builds one in eval mode, bf16. A size is a dict: hidden, inter (dense
MLP), moe_inter (one expert), shared_inter (the shared expert where the family has one), experts,
top_k, layers, vocab, heads, head_dim. Each family keeps its own structure: DeepSeek-V3 / -V2 and
GLM-4-MoE a dense first layer, a shared expert, routed scaling and grouped routing; Qwen2-MoE and
Qwen3-MoE a dense layer between MoE layers (Qwen2 with its gated shared expert); Qwen3.5-MoE linear
attention around a full-attention layer and a gated shared expert; Mixtral, MiniMax-M2 and gpt-oss
MoE in every layer (gpt-oss with sliding-window layers and expert biases). Kimi-K2.5 and Qwen3.5-MoE
are their vision-language wrappers with a one-layer vision tower. The families added with the
family table (issue 47) keep theirs too: DSA / MLA attention (DeepSeek-V3.2, GLM-MoE-DSA,
GLM-4-MoE-Lite, Mistral-4, Mistral-Large-4 in its Pixtral wrapper), linear attention (Kimi-Linear's
KDA, Qwen3-Next's gated DeltaNet), wrappers (Qwen3-VL-MoE, Qwen3-Omni-MoE's thinker), a dense first
layer where the family has one, Granite's multipliers and MiniMax-M3's own scaling and shared GLU;
HunYuan-MoE-V1 (every layer MoE, a shared MLP), MiMo-V2-Flash (no shared expert, sliding windows),
HY-V3 (its router's own factor name), GLM-4.5V in its wrapper (multimodal rope), MiniCPM5-MoE
(gated attention), Mellum and Flint (a dense first layer, Flint's ungated shared expert). The
families added last (Aria, dots.3-note, Laguna, the OCR models, Bailing-Hybrid, Lara-mini) are in
hf_moe_models_late.py.
"""

from __future__ import annotations

import torch

from migration.examples.hf_moe_models_late import LATE_CONFIG_CLASS, LATE_FAMILIES, late_configs

FAMILIES = (
    "deepseek_v3",
    "kimi_k25",
    "deepseek_v2",
    "glm4_moe",
    "qwen2_moe",
    "qwen3_moe",
    "qwen3_5_moe",
    "mixtral",
    "minimax_m2",
    "gpt_oss",
    "deepseek_v32",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "mistral4",
    "mistral_large4",
    "kimi_linear",
    "qwen3_next",
    "qwen3_vl_moe",
    "qwen3_omni_moe",
    "olmoe",
    "ernie4_5_moe",
    "granitemoe",
    "granitemoeshared",
    "minimax_m3_vl",
    "dots1",
    "solar_open",
    "exaone_moe",
    "hunyuan_v1_moe",
    "mimo_v2_flash",
    "hy_v3",
    "glm4v_moe",
    "minicpm5_moe",
    "mellum",
    "flint",
) + LATE_FAMILIES
# the transformers config class each family needs (a family whose class this transformers lacks
# is not built: `available` says so)
CONFIG_CLASS = {
    "deepseek_v3": "DeepseekV3Config",
    "kimi_k25": "Kimi_K25Config",
    "deepseek_v2": "DeepseekV2Config",
    "glm4_moe": "Glm4MoeConfig",
    "qwen2_moe": "Qwen2MoeConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "qwen3_5_moe": "Qwen3_5MoeConfig",
    "mixtral": "MixtralConfig",
    "minimax_m2": "MiniMaxM2Config",
    "gpt_oss": "GptOssConfig",
    "deepseek_v32": "DeepseekV32Config",
    "glm4_moe_lite": "Glm4MoeLiteConfig",
    "glm_moe_dsa": "GlmMoeDsaConfig",
    "mistral4": "Mistral4Config",
    "mistral_large4": "MistralLarge4Config",
    "kimi_linear": "KimiLinearConfig",
    "qwen3_next": "Qwen3NextConfig",
    "qwen3_vl_moe": "Qwen3VLMoeConfig",
    "qwen3_omni_moe": "Qwen3OmniMoeThinkerConfig",
    "olmoe": "OlmoeConfig",
    "ernie4_5_moe": "Ernie4_5_MoeConfig",
    "granitemoe": "GraniteMoeConfig",
    "granitemoeshared": "GraniteMoeSharedConfig",
    "minimax_m3_vl": "MiniMaxM3VLTextConfig",
    "dots1": "Dots1Config",
    "solar_open": "SolarOpenConfig",
    "exaone_moe": "ExaoneMoeConfig",
    "hunyuan_v1_moe": "HunYuanMoEV1Config",
    "mimo_v2_flash": "MiMoV2FlashConfig",
    "hy_v3": "HYV3Config",
    "glm4v_moe": "Glm4vMoeConfig",
    "minicpm5_moe": "MiniCPM5MoeConfig",
    "mellum": "MellumConfig",
    "flint": "FlintConfig",
    **LATE_CONFIG_CLASS,
}

# CPU tests: small enough that every family builds and generates in well under a second
TINY = dict(hidden=64, inter=128, moe_inter=32, shared_inter=64, experts=8, top_k=4, layers=3)
TINY.update(vocab=256, heads=4, head_dim=16)
# the one-GPU test (hidden 2048)
LARGE = dict(hidden=2048, inter=4096, moe_inter=256, shared_inter=512, experts=16, top_k=4)
LARGE.update(layers=3, vocab=512, heads=16, head_dim=128)


def available(family: str) -> bool:
    """Whether the installed transformers has this family's model code."""
    import transformers

    return hasattr(transformers, CONFIG_CLASS[family])


def why_skipped(family: str):
    """Why this transformers release cannot run `family` on the bridge (it lacks the model code,
    or its release of the code differs from what the patch moves: the patch's own refusal), or
    None."""
    if not available(family):
        return "not in this transformers"
    from fusion_bridge.integrations.hf_families import refusal_of

    why = refusal_of(family)
    return None if why is None else f"refused by the patch in this transformers: {why}"


def _deepseek(s: dict, **extra) -> dict:
    """DeepSeek-V3 / -V2 shape: MLA attention, a dense first layer, one shared expert, grouped
    routing (4 groups, the best 2), routed scaling."""
    return dict(
        intermediate_size=s["inter"],
        moe_intermediate_size=s["moe_inter"],
        num_key_value_heads=s["heads"],
        n_routed_experts=s["experts"],
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        q_lora_rank=None,
        kv_lora_rank=s["head_dim"] * 2,
        qk_rope_head_dim=s["head_dim"] // 2,
        qk_nope_head_dim=s["head_dim"],
        v_head_dim=s["head_dim"],
        **extra,
    )


def _configs(family: str, s: dict, common: dict) -> tuple[str, dict]:
    """(model class name, config keyword arguments) of `family` at size s."""
    heads = dict(num_key_value_heads=s.get("kv_heads", 2), head_dim=s["head_dim"])
    qwen = dict(heads, moe_intermediate_size=s["moe_inter"], num_experts=s["experts"])
    if family == "deepseek_v3":
        return "DeepseekV3ForCausalLM", dict(common, **_deepseek(s))
    if family == "kimi_k25":
        text = dict(common, model_type="kimi_k2", **_deepseek(s))
        vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
        vision.update(intermediate_size=32)
        return "Kimi_K25ForConditionalGeneration", dict(text_config=text, vision_config=vision)
    if family == "deepseek_v2":
        return "DeepseekV2ForCausalLM", dict(
            common, **_deepseek(s, topk_method="group_limited_greedy")
        )
    if family == "glm4_moe":
        glm = dict(heads, intermediate_size=s["inter"], moe_intermediate_size=s["moe_inter"])
        glm.update(n_routed_experts=s["experts"], n_group=4, topk_group=2)
        glm.update(first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5)
        return "Glm4MoeForCausalLM", dict(common, **glm)
    if family == "qwen2_moe":
        return "Qwen2MoeForCausalLM", dict(
            common,
            **qwen,
            intermediate_size=s["inter"],
            shared_expert_intermediate_size=s["shared_inter"],
            mlp_only_layers=[1],
            norm_topk_prob=False,
        )
    if family == "qwen3_moe":
        return "Qwen3MoeForCausalLM", dict(
            common, **qwen, intermediate_size=s["inter"], mlp_only_layers=[1], norm_topk_prob=True
        )
    if family == "qwen3_5_moe":
        text = dict(common, **qwen, shared_expert_intermediate_size=s["shared_inter"])
        text.update(layer_types=["linear_attention", "full_attention", "linear_attention"])
        text.update(linear_num_key_heads=2, linear_num_value_heads=2)
        text.update(linear_key_head_dim=s["head_dim"], linear_value_head_dim=s["head_dim"])
        vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32)
        vision.update(out_hidden_size=s["hidden"])
        return "Qwen3_5MoeForConditionalGeneration", dict(text_config=text, vision_config=vision)
    every = dict(heads, intermediate_size=s["moe_inter"], num_local_experts=s["experts"])
    if family == "mixtral":
        return "MixtralForCausalLM", dict(common, **every)
    if family == "minimax_m2":
        return "MiniMaxM2ForCausalLM", dict(common, **every)
    if family == "gpt_oss":
        kinds = ["sliding_attention", "full_attention", "sliding_attention"]
        return "GptOssForCausalLM", dict(common, **every, layer_types=kinds, sliding_window=4)
    return _newer_configs(family, s, common, qwen)


def _newer_configs(family: str, s: dict, common: dict, qwen: dict) -> tuple[str, dict]:
    """The families added with the family table (issue 47)."""
    dense_first = ["dense"] + ["sparse"] * (s["layers"] - 1)
    # DSA's indexer keeps index_topk tokens per query: more than any test sequence, so the
    # sparse attention attends to every token as dense attention does (no selection to flip)
    dsa = dict(q_lora_rank=s["head_dim"] * 2, index_topk=64, index_head_dim=s["head_dim"])
    dsa.update(index_n_heads=2)
    if family == "deepseek_v32":
        return "DeepseekV32ForCausalLM", dict(common, **dict(_deepseek(s), **dsa))
    if family == "glm_moe_dsa":
        glm = dict(common, **dict(_deepseek(s), **dsa), mlp_layer_types=dense_first)
        return "GlmMoeDsaForCausalLM", glm
    if family == "glm4_moe_lite":
        lite = dict(common, **_deepseek(s), mlp_layer_types=dense_first)
        lite.pop("first_k_dense_replace")
        return "Glm4MoeLiteForCausalLM", lite
    if family == "mistral4":
        return "Mistral4ForCausalLM", dict(common, **_deepseek(s))
    if family == "mistral_large4":
        text = dict(common, **dict(_deepseek(s), **dsa), mlp_layer_types=dense_first)
        for key in ("first_k_dense_replace", "q_lora_rank", "experts_implementation"):
            text.pop(key)
        vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1)
        vision.update(num_attention_heads=2, image_size=32, patch_size=16)
        kwargs = dict(text_config=text, vision_config=vision, image_token_index=1 << 20)
        return "MistralLarge4ForConditionalGeneration", kwargs
    if family == "kimi_linear":
        kimi = dict(common, **_deepseek(s), mlp_layer_types=dense_first)
        kimi.pop("first_k_dense_replace")
        kimi["num_local_experts"] = kimi.pop("n_routed_experts")
        kimi.update(layer_types=["linear_attention", "full_attention", "linear_attention"])
        kimi.update(linear_head_dim=s["head_dim"], linear_num_heads=2)
        kimi.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # defaults: Kimi's vocabulary
        return "KimiLinearForCausalLM", kimi
    if family == "qwen3_next":
        text = dict(common, **qwen, shared_expert_intermediate_size=s["shared_inter"])
        text.update(layer_types=["linear_attention", "full_attention", "linear_attention"])
        text.update(linear_num_key_heads=2, linear_num_value_heads=2, intermediate_size=s["inter"])
        text.update(linear_key_head_dim=s["head_dim"], linear_value_head_dim=s["head_dim"])
        return "Qwen3NextForCausalLM", text
    if family == "qwen3_vl_moe":
        text = dict(common, **qwen, intermediate_size=s["inter"])
        vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32)
        vision.update(out_hidden_size=s["hidden"], deepstack_visual_indexes=[])
        return "Qwen3VLMoeForConditionalGeneration", dict(text_config=text, vision_config=vision)
    if family == "qwen3_omni_moe":
        text = dict(common, **qwen, intermediate_size=s["inter"], mlp_only_layers=[1])
        vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32)
        vision.update(out_hidden_size=s["hidden"], deepstack_visual_indexes=[])
        audio = dict(encoder_layers=1, d_model=32, encoder_attention_heads=2)
        audio.update(encoder_ffn_dim=32, output_dim=s["hidden"], downsample_hidden_size=16)
        kwargs = dict(text_config=text, vision_config=vision, audio_config=audio)
        # generate's rope index reads it; no prompt token (all below the vocabulary) matches
        kwargs.update(vision_start_token_id=1 << 20)
        return "Qwen3OmniMoeThinkerForConditionalGeneration", kwargs
    if family == "olmoe":
        return "OlmoeForCausalLM", dict(common, **qwen, intermediate_size=s["moe_inter"])
    if family == "ernie4_5_moe":
        ernie = dict(common, num_key_value_heads=2, intermediate_size=s["inter"])
        ernie.update(moe_intermediate_size=s["moe_inter"], moe_num_experts=s["experts"])
        ernie.update(moe_k=s["top_k"], moe_num_shared_experts=1, moe_layer_start_index=1)
        ernie.update(moe_layer_interval=1)
        return "Ernie4_5_MoeForCausalLM", ernie
    if family == "granitemoe":
        granite = dict(common, num_key_value_heads=2, intermediate_size=s["moe_inter"])
        granite.update(num_local_experts=s["experts"], residual_multiplier=0.5)
        granite.update(embedding_multiplier=2.0, attention_multiplier=0.25, logits_scaling=2.0)
        return "GraniteMoeForCausalLM", granite
    if family == "granitemoeshared":
        granite = dict(common, num_key_value_heads=2, intermediate_size=s["moe_inter"])
        granite.update(num_local_experts=s["experts"], residual_multiplier=0.5)
        granite.update(shared_intermediate_size=s["shared_inter"], embedding_multiplier=2.0)
        return "GraniteMoeSharedForCausalLM", granite
    if family == "minimax_m3_vl":  # its text model (MiniMaxM3VLForCausalLM)
        m3 = dict(common, num_key_value_heads=2, head_dim=s["head_dim"])
        m3.update(num_local_experts=s["experts"], intermediate_size=s["moe_inter"])
        m3.update(shared_intermediate_size=s["shared_inter"], dense_intermediate_size=s["inter"])
        m3.update(routed_scaling_factor=2.5, rotary_dim=s["head_dim"] // 2)
        m3.update(mlp_layer_types=dense_first, layer_types=["full_attention"] * s["layers"])
        m3.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # defaults: its vocabulary
        return "MiniMaxM3VLForCausalLM", m3
    grouped = dict(common, num_key_value_heads=2, head_dim=s["head_dim"], n_group=4, topk_group=2)
    grouped.update(moe_intermediate_size=s["moe_inter"], n_routed_experts=s["experts"])
    grouped.update(n_shared_experts=1, routed_scaling_factor=2.5)
    if family == "dots1":
        grouped.pop("head_dim")
        return "Dots1ForCausalLM", dict(
            grouped, intermediate_size=s["inter"], first_k_dense_replace=1
        )
    if family == "solar_open":
        return "SolarOpenForCausalLM", dict(grouped, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "exaone_moe":
        exaone = {
            k: v for k, v in grouped.items() if k not in ("n_routed_experts", "n_shared_experts")
        }
        exaone.update(num_experts=s["experts"], num_shared_experts=1, intermediate_size=s["inter"])
        exaone.update(first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        return "ExaoneMoeForCausalLM", exaone
    return _later_configs(family, s, common, grouped, dense_first)


def _later_configs(family: str, s: dict, common: dict, grouped: dict, dense_first) -> tuple:
    """HunYuan-MoE-V1, MiMo-V2-Flash, HY-V3 and GLM-4.5V's text model (in its wrapper)."""
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # defaults: their vocabularies
    if family == "hunyuan_v1_moe":  # every layer MoE; the shared MLP at intermediate_size
        hunyuan = dict(common, num_key_value_heads=2, head_dim=s["head_dim"], **ids)
        hunyuan.update(intermediate_size=s["moe_inter"], num_experts=s["experts"])
        return "HunYuanMoEV1ForCausalLM", hunyuan
    if family == "mimo_v2_flash":  # no shared expert; sliding-window layers
        mimo = {k: v for k, v in grouped.items() if k != "n_shared_experts"}
        mimo.update(intermediate_size=s["inter"], mlp_layer_types=dense_first, **ids)
        mimo.update(v_head_dim=s["head_dim"], sliding_window=4)
        mimo.update(layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        return "MiMoV2FlashForCausalLM", mimo
    if family == "hy_v3":  # the router's own factor name, the block's correction bias
        hy = dict(common, num_key_value_heads=2, head_dim=s["head_dim"], **ids)
        hy.update(moe_intermediate_size=s["moe_inter"], num_experts=s["experts"])
        hy.update(intermediate_size=s["inter"], num_shared_experts=1, router_scaling_factor=2.5)
        hy.update(mlp_layer_types=dense_first, enable_moe_fp32_combine=True)
        return "HYV3ForCausalLM", hy
    if family == "glm4v_moe":
        text = dict(grouped, intermediate_size=s["inter"], first_k_dense_replace=1)
        # its multimodal rope: a section per axis, summing to half the rotated head_dim / 2
        rotary = s["head_dim"] // 4
        text["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0)
        text["rope_parameters"].update(partial_rotary_factor=0.5)
        text["rope_parameters"]["mrope_section"] = [rotary - 2 * (rotary // 4)] + [rotary // 4] * 2
        vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32)
        vision.update(out_hidden_size=s["hidden"])
        kwargs = dict(text_config=text, vision_config=vision)
        # generate's rope index reads them; no prompt token (all below the vocabulary) matches
        for key in ("image_token_id", "video_token_id", "image_start_token_id"):
            kwargs[key] = (1 << 20) + len(kwargs)
        kwargs.update(video_start_token_id=1 << 21, image_end_token_id=1 << 22)
        kwargs.update(video_end_token_id=1 << 23)
        return "Glm4vMoeForConditionalGeneration", kwargs
    return _grouped_and_softmax_configs(family, s, common, grouped, dense_first)


def _grouped_and_softmax_configs(family, s, common, grouped, dense_first) -> tuple:
    """MiniCPM5-MoE (DeepSeek-V3's block), Mellum and Flint (softmax / sigmoid top-k blocks)."""
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # defaults: their vocabularies
    if family == "minicpm5_moe":
        cpm = dict(grouped, intermediate_size=s["inter"], mlp_layer_types=dense_first, **ids)
        return "MiniCPM5MoeForCausalLM", cpm
    qwen = dict(common, num_key_value_heads=2, head_dim=s["head_dim"], **ids)
    qwen.update(moe_intermediate_size=s["moe_inter"], num_experts=s["experts"])
    qwen.update(intermediate_size=s["inter"], sliding_window=4)
    if family == "mellum":
        return "MellumForCausalLM", dict(qwen, mlp_layer_types=dense_first)
    if family == "flint":
        flint = dict(qwen, shared_expert_intermediate_size=s["shared_inter"], mlp_only_layers=[0])
        return "FlintForCausalLM", flint
    return late_configs(family, s, common, _deepseek(s), dense_first)


def build_model(family: str, size: dict, seed: int = 0, device="cpu") -> torch.nn.Module:
    """A random-weight bf16 model of `family` in eval mode. Norm weights, routing correction biases
    and expert biases are randomised too (their defaults, ones and zeros, would hide a wrong gamma
    or bias)."""
    import transformers

    torch.manual_seed(seed)
    device = torch.device(device)
    common = dict(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_experts_per_tok=size["top_k"],
        max_position_embeddings=256,
        # transformers' default experts path (grouped_mm) is CUDA-graph safe but slow on CPU
        experts_implementation="batched_mm" if device.type == "cpu" else None,
    )
    class_name, kwargs = _configs(family, size, common)
    if "text_config" in kwargs:  # a wrapper: its model sets the experts path of every sub-model
        kwargs["experts_implementation"] = common["experts_implementation"]
    config = getattr(transformers, CONFIG_CLASS[family])(**kwargs)
    model = getattr(transformers, class_name)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape))
            elif name.endswith("proj_bias"):  # gpt-oss expert biases
                p.copy_(0.5 * torch.randn(p.shape))
            elif name.endswith("e_score_correction_bias"):  # laguna's is a parameter
                p.copy_(0.05 * torch.randn(p.shape))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape))
    return model.to(device=device, dtype=torch.bfloat16).eval()
