"""hf_real_shapes.REAL's rows (same format) for the families the family table added last
(migration/examples/hf_moe_models_late.py): Aria (its text model and its wrapper), dots.3-note
(text and wrapper), Laguna, DeepSeek-OCR-2, Unlimited-OCR, Bailing-Hybrid, Lara-mini.
"""

from __future__ import annotations

# Aria's language model (rhymes-ai/Aria)
ARIA = (
    "hidden_size=2560 intermediate_size=1664 vocab_size=100352 num_attention_heads=20 "
    "num_key_value_heads=20 head_dim=128 moe_topk=6 num_experts_per_tok=6 moe_num_shared_experts=2"
)
# dots.3-note-prev's language model; transformers' Dots3NoteTextConfig defaults (its
# sliding-window layers' MLA shape: the config's swa_* defaults). Public loaders' checks of the
# release agree where they state a value (256 routed experts, top 8, one dense first layer, 46
# layers of which 13 full attention, kv_lora 512, qk_rope 64, index_head_dim 128); the hidden,
# expert and head sizes are unsure: no public config.json with them was found
DOTS3 = (
    "hidden_size=5120 intermediate_size=13824 moe_intermediate_size=1536 "
    "shared_experts_intermediate_size=1536 vocab_size=152064 num_attention_heads=128 "
    "num_key_value_heads=128 head_dim=256 num_experts_per_tok=8 n_shared_experts=1 "
    "routed_scaling_factor=1.0 n_group=1 topk_group=1 q_lora_rank=1024 kv_lora_rank=512 "
    "qk_rope_head_dim=64 qk_nope_head_dim=128 v_head_dim=128 index_n_heads=64 index_head_dim=128 "
    "index_topk=2048 sliding_window=512"
)
# DeepSeek-OCR's decoder (DeepSeek3B-MoE: MHA, no MLA; a softmax greedy router)
OCR = (
    "hidden_size=1280 intermediate_size=6848 moe_intermediate_size=896 vocab_size=129280 "
    "num_attention_heads=10 num_key_value_heads=10 num_experts_per_tok=6 n_shared_experts=2 "
    "routed_scaling_factor=1.0 n_group=1 topk_group=1 topk_method='greedy'"
)
LATE_REAL = {
    # Aria's language model (64); num_experts_per_tok repeats moe_topk for hf_moe_bound.py, which
    # reads the top-k under that name (AriaTextConfig has none)
    "aria_text": ("moe_num_experts", 64, ARIA),
    # Aria in its wrapper: the same language model (5.17's is refused by the patch)
    "aria": ("moe_num_experts", 64, ARIA),
    # dots.3-note-prev's language model (256); unsure of every value (DOTS3) (5.25 only)
    "dots3_note_text": ("n_routed_experts", 32, DOTS3),
    # dots.3-note-prev in its wrapper (256); unsure of every value (DOTS3) (5.25 only)
    "dots3_note": ("n_routed_experts", 32, DOTS3),
    # Laguna-XS-2.1 (256): poolside's config.json as lablup/mlxcel's src/models/laguna_tests.rs
    # pins it (XS_2_1_CONFIG); its routed scaling 2.5 and per-head gate; a full-attention layer
    # of 48 heads then three sliding-window ones of 64 (LAYOUT), the dense first layer its own
    "laguna": ("num_experts", 128,
               "hidden_size=2048 intermediate_size=8192 moe_intermediate_size=512 "
               "shared_expert_intermediate_size=512 vocab_size=100352 num_attention_heads=48 "
               "num_key_value_heads=8 head_dim=128 num_experts_per_tok=8 "
               "moe_routed_scaling_factor=2.5 gating='per-head' sliding_window=512"),
    # DeepSeek-OCR-2's language model (64): DeepSeek-OCR's decoder, which OCR-2 keeps (from
    # DeepSeek-OCR's published config, not checked against OCR-2's own: the public copies of
    # OCR-2's config.json found here give only its top level, model_type deepseek_vl_v2;
    # DeepseekOcr2TextConfig's defaults are a generic 4096-wide model with no top-k)
    "deepseek_ocr2": ("n_routed_experts", 64, OCR),
    # Unlimited-OCR's language model (64): DeepSeek-OCR's decoder with every layer a reference
    # sliding window of 128; a public cache-layout test's copy of its text_config (hidden 1280,
    # 10 heads and KV heads, sliding_window_size 128, no MLA) agrees; its expert sizes are not
    # in that copy: DeepSeek-OCR's (5.25 only)
    "unlimited_ocr": ("n_routed_experts", 64, OCR + " sliding_window=128"),
    # Ling-3.0-Flash (512): KDA layers 5 to 1 with MLA (no q LoRA); transformers'
    # BailingHybridConfig defaults, which every value here of a public Vulkan loader's pinned
    # "Ling-3.0-flash-int4 config facts" matches (hidden 2560, 32 heads, kv_lora 512, 512 experts
    # of 768, top 8, one shared of 768, scaling 2.5, 8 groups / 4, layer groups of 6); its two
    # dense first layers cut to one; SwiGLU limits off (5.25 only)
    "bailing_hybrid": ("num_local_experts", 64,
                       "hidden_size=2560 intermediate_size=6144 moe_intermediate_size=768 "
                       "vocab_size=157184 num_attention_heads=32 num_key_value_heads=32 "
                       "head_dim=128 num_experts_per_tok=8 n_shared_experts=1 "
                       "routed_scaling_factor=2.5 n_group=8 topk_group=4 norm_topk_prob=True "
                       "q_lora_rank=None kv_lora_rank=512 qk_rope_head_dim=64 "
                       "qk_nope_head_dim=128 v_head_dim=128 short_conv_kernel_size=4"),
    # Lara-4-Mini-Base (128): gated DeltaNet, sliding and full layers in the config's own
    # (released, period-5) order; unsure of every value: transformers' LaraMiniConfig defaults
    # (no public copy of its config.json was found) (5.25 only)
    "lara_mini": ("num_experts", 128,
                  "hidden_size=1024 moe_intermediate_size=512 shared_expert_intermediate_size=512 "
                  "vocab_size=151936 num_attention_heads=16 num_key_value_heads=4 head_dim=128 "
                  "num_experts_per_tok=4 norm_topk_prob=True linear_num_key_heads=8 "
                  "linear_num_value_heads=16 linear_key_head_dim=128 linear_value_head_dim=128 "
                  "linear_conv_kernel_dim=4 sliding_window=512"),
}  # fmt: skip
