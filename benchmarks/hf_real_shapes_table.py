"""The rows of hf_real_shapes.REAL for the families the family table had first, and LAYOUT, the
per-layer kinds of every family whose config would put all the few timed layers in one kind.

A row is family -> (the config key of the routed expert count, the experts kept, the language
model's config as "key=value" Python literals). Each row's comment names the public model it was
read from and its real routed expert count; a value not known from the public config says so and
is the transformers config class's own default. The rows of the families added last are in
hf_real_shapes_late.py (same format); hf_real_shapes.py builds models from both.
"""

from __future__ import annotations

from typing import Callable

# DeepSeek-V3 attention (MLA): also DeepSeek-V3.2's and Kimi-K2's
MLA = "q_lora_rank=1536 kv_lora_rank=512 qk_rope_head_dim=64 qk_nope_head_dim=128 v_head_dim=128"
V3 = (
    "hidden_size=7168 intermediate_size=18432 moe_intermediate_size=2048 num_experts_per_tok=8 "
    "num_attention_heads=128 num_key_value_heads=128 n_shared_experts=1 first_k_dense_replace=1 "
)
GRANITE = (  # granite-3.0-3b-a800m
    "hidden_size=1536 intermediate_size=512 vocab_size=49155 num_attention_heads=24 "
    "num_key_value_heads=8 num_experts_per_tok=8 embedding_multiplier=12.0 "
    "attention_multiplier=0.015625 residual_multiplier=0.22 logits_scaling=6.0 "
)
QWEN3 = "num_experts_per_tok=8 norm_topk_prob=True vocab_size=151936 head_dim=128 "
FIRST_REAL = {
    # DeepSeek-V3 (256 experts)
    "deepseek_v3": ("n_routed_experts", 32, V3 + MLA + " vocab_size=129280 n_group=8 topk_group=4 "
                    "routed_scaling_factor=2.5"),
    # Kimi-K2.5's language model (384)
    "kimi_k25": ("n_routed_experts", 32, V3.replace("heads=128", "heads=64") + MLA
                 + " vocab_size=163840 n_group=1 topk_group=1 routed_scaling_factor=2.827"),
    # DeepSeek-V2 (160)
    "deepseek_v2": ("n_routed_experts", 32,
                    "hidden_size=5120 intermediate_size=12288 moe_intermediate_size=1536 "
                    "vocab_size=102400 num_attention_heads=128 num_key_value_heads=128 "
                    "num_experts_per_tok=6 n_group=8 topk_group=3 routed_scaling_factor=16.0 "
                    "n_shared_experts=2 topk_method='group_limited_greedy' first_k_dense_replace=1 "
                    + MLA),
    # GLM-4.5 (160)
    "glm4_moe": ("n_routed_experts", 32,
                 "hidden_size=5120 intermediate_size=12288 moe_intermediate_size=1536 "
                 "vocab_size=151552 num_attention_heads=96 num_key_value_heads=8 head_dim=128 "
                 "num_experts_per_tok=8 n_group=1 topk_group=1 routed_scaling_factor=2.5 "
                 "n_shared_experts=1 first_k_dense_replace=1 use_qk_norm=True"),
    # Qwen2-57B-A14B (64)
    "qwen2_moe": ("num_experts", 64,
                  "hidden_size=3584 intermediate_size=18944 moe_intermediate_size=2560 "
                  "vocab_size=151936 shared_expert_intermediate_size=20480 num_attention_heads=28 "
                  "num_key_value_heads=4 num_experts_per_tok=8 norm_topk_prob=False"),
    # Qwen3-30B-A3B (128)
    "qwen3_moe": ("num_experts", 128, QWEN3 + "hidden_size=2048 intermediate_size=6144 "
                  "moe_intermediate_size=768 num_attention_heads=32 num_key_value_heads=4"),
    # Qwen3.5-397B-A17B's language model (512)
    "qwen3_5_moe": ("num_experts", 64,
                    "hidden_size=4096 moe_intermediate_size=1024 "
                    "shared_expert_intermediate_size=1024 vocab_size=248320 "
                    "num_attention_heads=32 num_key_value_heads=2 head_dim=256 "
                    "num_experts_per_tok=10 linear_num_key_heads=16 linear_num_value_heads=64 "
                    "linear_key_head_dim=128 linear_value_head_dim=128"),
    # Mixtral-8x7B (8)
    "mixtral": ("num_local_experts", 8,
                "hidden_size=4096 intermediate_size=14336 vocab_size=32000 num_attention_heads=32 "
                "num_key_value_heads=8 num_experts_per_tok=2"),
    # MiniMax-M2 (256)
    "minimax_m2": ("num_local_experts", 64,
                   "hidden_size=3072 intermediate_size=1536 vocab_size=200064 "
                   "num_attention_heads=48 num_key_value_heads=8 head_dim=128 "
                   "num_experts_per_tok=8"),
    # gpt-oss-120b (128)
    "gpt_oss": ("num_local_experts", 32,
                "hidden_size=2880 intermediate_size=2880 vocab_size=201088 num_attention_heads=64 "
                "num_key_value_heads=8 head_dim=64 num_experts_per_tok=4 sliding_window=128"),
    # DeepSeek-V3.2 (256): V3 with the DSA indexer (64 heads of 128, top 2048 tokens)
    "deepseek_v32": ("n_routed_experts", 32, V3 + MLA + " vocab_size=129280 n_group=8 topk_group=4 "
                     "routed_scaling_factor=2.5 index_n_heads=64 index_head_dim=128 "
                     "index_topk=2048"),
    # GLM-4.7-Flash (64)
    "glm4_moe_lite": ("n_routed_experts", 64,
                      "hidden_size=2048 intermediate_size=10240 moe_intermediate_size=1536 "
                      "vocab_size=154880 num_attention_heads=20 num_key_value_heads=20 "
                      "num_experts_per_tok=4 n_shared_experts=1 routed_scaling_factor=1.8 "
                      "n_group=1 topk_group=1 q_lora_rank=768 kv_lora_rank=512 "
                      "qk_rope_head_dim=64 qk_nope_head_dim=192 v_head_dim=256"),
    # GLM-5 (256); unsure of every value: transformers' GlmMoeDsaConfig defaults
    "glm_moe_dsa": ("n_routed_experts", 32,
                    "hidden_size=6144 intermediate_size=12288 moe_intermediate_size=2048 "
                    "vocab_size=154880 num_attention_heads=64 num_key_value_heads=64 "
                    "num_experts_per_tok=8 n_shared_experts=1 routed_scaling_factor=2.5 n_group=1 "
                    "topk_group=1 q_lora_rank=2048 kv_lora_rank=512 qk_rope_head_dim=64 "
                    "qk_nope_head_dim=192 v_head_dim=256 index_n_heads=32 index_head_dim=128 "
                    "index_topk=2048 first_k_dense_replace=1"),
    # Mistral-4 (128); unsure of every value: transformers' Mistral4Config defaults
    "mistral4": ("n_routed_experts", 32,
                 "hidden_size=4096 intermediate_size=12288 moe_intermediate_size=2048 "
                 "vocab_size=131072 num_attention_heads=32 num_key_value_heads=32 "
                 "num_experts_per_tok=4 n_shared_experts=1 routed_scaling_factor=1.0 n_group=1 "
                 "topk_group=1 q_lora_rank=1024 kv_lora_rank=256 qk_rope_head_dim=64 "
                 "qk_nope_head_dim=64 v_head_dim=128"),
    # Mistral-Large-4's language model (128, experts of 6144); unsure of every value:
    # transformers' MistralLarge4TextConfig defaults (5.25 only)
    "mistral_large4": ("n_routed_experts", 16,
                       "hidden_size=6144 intermediate_size=24576 moe_intermediate_size=6144 "
                       "vocab_size=204800 num_attention_heads=64 num_key_value_heads=64 "
                       "num_experts_per_tok=4 n_shared_experts=1 routed_scaling_factor=1.0 "
                       "n_group=1 topk_group=1 kv_lora_rank=512 qk_rope_head_dim=64 "
                       "qk_nope_head_dim=64 v_head_dim=128 index_n_heads=32 index_head_dim=128 "
                       "index_topk=2048"),
    # Kimi-Linear-48B-A3B (256): KDA layers 3 to 1 with MLA (no q LoRA)
    "kimi_linear": ("num_local_experts", 64,
                    "hidden_size=2304 intermediate_size=9216 moe_intermediate_size=1024 "
                    "vocab_size=163840 num_attention_heads=32 num_key_value_heads=32 "
                    "num_experts_per_tok=8 n_shared_experts=1 routed_scaling_factor=2.446 "
                    "n_group=1 topk_group=1 q_lora_rank=None kv_lora_rank=512 qk_rope_head_dim=64 "
                    "qk_nope_head_dim=128 v_head_dim=128 linear_head_dim=128 linear_num_heads=32 "
                    "linear_conv_kernel_dim=4"),
    # Qwen3-Next-80B-A3B (512): gated DeltaNet layers 3 to 1 with gated attention
    "qwen3_next": ("num_experts", 128,
                   "hidden_size=2048 intermediate_size=5632 moe_intermediate_size=512 "
                   "shared_expert_intermediate_size=512 vocab_size=151936 num_attention_heads=16 "
                   "num_key_value_heads=2 head_dim=256 num_experts_per_tok=10 norm_topk_prob=True "
                   "linear_num_key_heads=16 linear_num_value_heads=32 linear_key_head_dim=128 "
                   "linear_value_head_dim=128 linear_conv_kernel_dim=4"),
    # Qwen3-VL-235B-A22B's language model (128)
    "qwen3_vl_moe": ("num_experts", 64, QWEN3 + "hidden_size=4096 intermediate_size=12288 "
                     "moe_intermediate_size=1536 num_attention_heads=64 num_key_value_heads=4"),
    # Qwen3-Omni-30B-A3B's thinker language model (128)
    "qwen3_omni_moe": ("num_experts", 128, QWEN3.replace("151936", "152064")
                       + "hidden_size=2048 intermediate_size=6144 moe_intermediate_size=768 "
                       "num_attention_heads=32 num_key_value_heads=4"),
    # OLMoE-1B-7B (64)
    "olmoe": ("num_experts", 64,
              "hidden_size=2048 intermediate_size=1024 vocab_size=50304 num_attention_heads=16 "
              "num_key_value_heads=16 num_experts_per_tok=8 norm_topk_prob=False"),
    # ERNIE-4.5-21B-A3B (64): MoE from layer 1
    "ernie4_5_moe": ("moe_num_experts", 64,
                     "hidden_size=2560 intermediate_size=12288 moe_intermediate_size=1536 "
                     "vocab_size=103424 num_attention_heads=20 num_key_value_heads=4 moe_k=6 "
                     "moe_num_shared_experts=2 moe_layer_start_index=1 moe_layer_interval=1"),
    # granite-3.0-3b-a800m (40)
    "granitemoe": ("num_local_experts", 40, GRANITE),
    # Granite-MoE with a shared MLP: granite-3.0-3b-a800m's shapes; the shared MLP's width is
    # unsure (no public config known here): 1024
    "granitemoeshared": ("num_local_experts", 40, GRANITE + "shared_intermediate_size=1024"),
    # MiniMax-M3's language model (128); unsure of every value: transformers' defaults
    "minimax_m3_vl": ("num_local_experts", 32,
                      "hidden_size=6144 intermediate_size=3072 shared_intermediate_size=3072 "
                      "dense_intermediate_size=12288 vocab_size=200064 num_attention_heads=64 "
                      "num_key_value_heads=4 head_dim=128 rotary_dim=64 num_experts_per_tok=4 "
                      "routed_scaling_factor=2.0"),
    # dots.llm1 (128)
    "dots1": ("n_routed_experts", 64,
              "hidden_size=4096 intermediate_size=10944 moe_intermediate_size=1408 "
              "vocab_size=152064 num_attention_heads=32 num_key_value_heads=32 "
              "num_experts_per_tok=6 n_shared_experts=2 routed_scaling_factor=2.5 n_group=1 "
              "topk_group=1 norm_topk_prob=True first_k_dense_replace=1"),
    # Solar-Open-100B (128); unsure of every value: transformers' SolarOpenConfig defaults
    "solar_open": ("n_routed_experts", 64,
                   "hidden_size=4096 moe_intermediate_size=1280 vocab_size=196608 "
                   "num_attention_heads=64 num_key_value_heads=8 head_dim=128 "
                   "num_experts_per_tok=8 n_shared_experts=1 routed_scaling_factor=1.0 n_group=1 "
                   "topk_group=1"),
    # K-EXAONE (64 in the default); unsure of every value: transformers' ExaoneMoeConfig defaults
    "exaone_moe": ("num_experts", 64,
                   "hidden_size=4096 intermediate_size=16384 moe_intermediate_size=1024 "
                   "vocab_size=102400 num_attention_heads=32 num_key_value_heads=32 "
                   "num_experts_per_tok=8 num_shared_experts=1 routed_scaling_factor=2.5 "
                   "n_group=1 topk_group=1 first_k_dense_replace=1 sliding_window=4096"),
    # Hunyuan-A13B (64): every layer MoE, experts and shared MLP of intermediate_size
    "hunyuan_v1_moe": ("num_experts", 32,
                       "hidden_size=4096 intermediate_size=3072 vocab_size=128167 "
                       "num_attention_heads=32 num_key_value_heads=8 head_dim=128 moe_topk=8"),
    # MiMo-V2-Flash (256): sliding-window layers between full ones (the config's default order)
    "mimo_v2_flash": ("n_routed_experts", 32,
                      "hidden_size=4096 intermediate_size=16384 moe_intermediate_size=2048 "
                      "vocab_size=152576 num_attention_heads=64 num_key_value_heads=4 head_dim=192 "
                      "v_head_dim=128 num_experts_per_tok=8 sliding_window=128 n_group=1 "
                      "topk_group=1"),
    # HY-V3 (192); unsure of every value: transformers' HYV3Config defaults
    "hy_v3": ("num_experts", 64,
              "hidden_size=4096 intermediate_size=13312 moe_intermediate_size=1536 "
              "vocab_size=120832 num_attention_heads=64 num_key_value_heads=8 head_dim=128 "
              "num_experts_per_tok=8 num_shared_experts=1 router_scaling_factor=2.826 "
              "enable_moe_fp32_combine=True"),
    # GLM-4.5V's language model, GLM-4.5-Air's shape (128); its multimodal rope on half of head_dim
    "glm4v_moe": ("n_routed_experts", 64,
                  "hidden_size=4096 intermediate_size=10944 moe_intermediate_size=1408 "
                  "vocab_size=151552 num_attention_heads=96 num_key_value_heads=8 head_dim=128 "
                  "num_experts_per_tok=8 n_shared_experts=1 routed_scaling_factor=1.0 n_group=1 "
                  "topk_group=1 first_k_dense_replace=1 attention_bias=True rope_parameters="
                  "{'rope_type':'default','rope_theta':10000.0,'partial_rotary_factor':0.5,"
                  "'mrope_section':[8,12,12]}"),
    # MiniCPM5-MoE (160, top 16); unsure of every value: transformers' defaults (5.25 only)
    "minicpm5_moe": ("n_routed_experts", 160,
                     "hidden_size=2048 intermediate_size=8192 moe_intermediate_size=512 "
                     "vocab_size=130560 num_attention_heads=32 num_key_value_heads=2 head_dim=128 "
                     "num_experts_per_tok=16 n_shared_experts=1 routed_scaling_factor=3.66 "
                     "n_group=1 topk_group=1"),
    # Mellum (64); unsure of every value: transformers' MellumConfig defaults
    "mellum": ("num_experts", 64,
               "hidden_size=2304 intermediate_size=7168 moe_intermediate_size=896 vocab_size=98304 "
               "num_attention_heads=32 num_key_value_heads=4 head_dim=128 num_experts_per_tok=8 "
               "norm_topk_prob=True sliding_window=1024"),
    # Flint (256); unsure of every value: transformers' FlintConfig defaults (5.25 only)
    "flint": ("num_experts", 128,
              "hidden_size=2048 intermediate_size=6144 moe_intermediate_size=512 "
              "shared_expert_intermediate_size=1024 vocab_size=150144 num_attention_heads=32 "
              "num_key_value_heads=4 head_dim=128 num_experts_per_tok=6 norm_topk_prob=True "
              "sliding_window=513 mlp_only_layers=[0]"),
}  # fmt: skip

LIN, FULL, SLIDING = "linear_attention", "full_attention", "sliding_attention"


def _cycle(*kinds) -> Callable[[int], list]:
    return lambda layers: [kinds[i % len(kinds)] for i in range(layers)]


def _dense_first(layers: int) -> list:
    return ["dense"] + ["sparse"] * (layers - 1)


# per-layer lists, for `layers` decoder layers, where the config's own would put every timed
# layer in one kind (the real patterns, begun where they mix within four layers)
LAYOUT: dict[str, dict[str, Callable[[int], list]]] = {
    "qwen3_5_moe": dict(layer_types=_cycle(LIN, LIN, LIN, FULL)),
    "qwen3_next": dict(layer_types=_cycle(LIN, LIN, LIN, FULL)),
    "kimi_linear": dict(layer_types=_cycle(LIN, LIN, LIN, FULL), mlp_layer_types=_dense_first),
    "gpt_oss": dict(layer_types=_cycle(SLIDING, FULL)),
    "mimo_v2_flash": dict(
        layer_types=_cycle(FULL, SLIDING, SLIDING, SLIDING, SLIDING),
        mlp_layer_types=_dense_first,
    ),
    "exaone_moe": dict(layer_types=_cycle(SLIDING, SLIDING, SLIDING, FULL)),
    "glm4_moe_lite": dict(mlp_layer_types=_dense_first),
    "glm_moe_dsa": dict(mlp_layer_types=_dense_first),
    "mistral_large4": dict(mlp_layer_types=_dense_first),
    "hy_v3": dict(mlp_layer_types=_dense_first),
    "minicpm5_moe": dict(mlp_layer_types=_dense_first),
    "deepseek_ocr2": dict(mlp_layer_types=_dense_first),  # its config derives none
    "laguna": dict(
        layer_types=_cycle(FULL, SLIDING, SLIDING, SLIDING),
        num_attention_heads_per_layer=_cycle(48, 64, 64, 64),
    ),
    "bailing_hybrid": dict(
        layer_types=_cycle(LIN, LIN, LIN, FULL, LIN, LIN), mlp_layer_types=_dense_first
    ),
}
