"""Random-weight configs of the families the family table added last (issue 47's remaining
types), for hf_moe_models.build_model: Aria's text model, dots.3-note's text model, Laguna
(a block that scales its routed output itself, softplus-gated attention), DeepSeek-OCR-2 in its
wrapper (a one-layer SAM and vision encoder; DeepSeek-V2's softmax router with routed scaling).
"""

from __future__ import annotations

LATE_FAMILIES = (
    "aria_text",
    "dots3_note_text",
    "laguna",
    "deepseek_ocr2",
    "aria",
    "unlimited_ocr",
    "bailing_hybrid",
    "lara_mini",
    "dots3_note",
)
# the transformers config class each family needs
LATE_CONFIG_CLASS = {
    "aria_text": "AriaTextConfig",
    "dots3_note_text": "Dots3NoteTextConfig",
    "laguna": "LagunaConfig",
    "deepseek_ocr2": "DeepseekOcr2Config",
    "aria": "AriaConfig",
    "unlimited_ocr": "UnlimitedOcrConfig",
    "bailing_hybrid": "BailingHybridConfig",
    "lara_mini": "LaraMiniConfig",
    "dots3_note": "Dots3NoteConfig",
}

_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # defaults: their vocabularies


def late_configs(family: str, s: dict, common: dict, deepseek: dict, dense_first) -> tuple:
    """(model class name, config keyword arguments) of `family` at size s; deepseek: DeepSeek-V3's
    shape at s (hf_moe_models._deepseek), dense_first: a dense first layer, then MoE layers."""
    aria = dict(common, num_key_value_heads=2, head_dim=s["head_dim"], **_IDS)
    aria.update(intermediate_size=s["moe_inter"], moe_num_experts=s["experts"])
    aria.update(moe_topk=s["top_k"], moe_num_shared_experts=2)
    if family == "aria_text":  # every layer MoE; experts and shared MLP at intermediate_size
        return "AriaTextForCausalLM", aria
    if family == "aria":  # its text model in the wrapper, a one-layer Idefics3 vision tower
        vision = dict(model_type="idefics3_vision", hidden_size=32, intermediate_size=32)
        vision.update(num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=16)
        kwargs = dict(text_config=aria, vision_config=vision, image_token_index=1 << 20)
        return "AriaForConditionalGeneration", dict(kwargs, projector_patch_to_query_dict={4: 2})
    if family in ("dots3_note_text", "dots3_note"):  # its text model: as DeepSeek-V3.2's
        dsa = dict(q_lora_rank=s["head_dim"] * 2, index_topk=64, index_head_dim=s["head_dim"])
        dots = dict(deepseek, **dsa, index_n_heads=2, mlp_layer_types=dense_first)
        dots.pop("first_k_dense_replace")
        dots.update(shared_experts_intermediate_size=s["shared_inter"], head_dim=s["head_dim"])
        # its sliding-window layers take their attention shape from swa_* (defaults: the released
        # 64 heads at rank 1024, 77 MB of weights in a tiny model): the MLA shape above instead
        swa = dict(num_attention_heads=s["heads"], num_key_value_heads=s["heads"])
        swa.update(q_lora_rank=dots["q_lora_rank"], kv_lora_rank=dots["kv_lora_rank"])
        swa.update(head_dim=dots["qk_nope_head_dim"] + dots["qk_rope_head_dim"])
        swa.update(qk_nope_head_dim=dots["qk_nope_head_dim"], v_head_dim=dots["v_head_dim"])
        dots.update({f"swa_{k}": v for k, v in swa.items()}, sliding_window=4)
        text = dict(common, **dots, **_IDS)
        if family == "dots3_note_text":
            return "Dots3NoteForCausalLM", text
        # the wrapper: its text model at model.language_model, one-layer vision and audio towers
        vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1)
        vision.update(num_attention_heads=2, moe_intermediate_size=16, num_local_experts=4)
        vision.update(num_experts_per_tok=2, router_scaling_factor=1.0, mlp_layer_types=["dense"])
        vision.update(adapter_in_dim=32, adapter_out_dim=s["hidden"])
        audio = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1)
        audio.update(num_attention_heads=2, downsample_hidden_size=16, adapter_input_size=32)
        audio.update(adapter_out_dim=s["hidden"])
        kwargs = dict(text_config=text, vision_config=vision, audio_config=audio)
        kwargs.update(image_token_id=1 << 20, video_token_id=1 << 21, audio_token_id=1 << 22)
        return "Dots3NoteForConditionalGeneration", kwargs
    if family == "laguna":  # the block's own moe_routed_scaling_factor; sliding-window layers
        laguna = dict(common, num_key_value_heads=2, head_dim=s["head_dim"], **_IDS)
        laguna.update(intermediate_size=s["inter"], moe_intermediate_size=s["moe_inter"])
        laguna.update(num_experts=s["experts"], shared_expert_intermediate_size=s["shared_inter"])
        laguna.update(moe_routed_scaling_factor=2.5, mlp_layer_types=dense_first)
        laguna.update(layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        return "LagunaForCausalLM", dict(laguna, sliding_window=4)
    if family == "deepseek_ocr2":  # DeepSeek-V2's MoE (softmax, group-limited, scaled)
        text = {k: v for k, v in deepseek.items() if not k.startswith(("q_", "qk_", "kv_", "v_"))}
        text.pop("first_k_dense_replace")
        text.update(topk_method="group_limited_greedy", mlp_layer_types=dense_first)
        text.update(num_key_value_heads=2, head_dim=s["head_dim"])
        text = dict(common, **text, **_IDS)
        return "DeepseekOcr2ForConditionalGeneration", dict(
            text_config=text, vision_config=_ocr_vision(s), image_token_id=1 << 20
        )
    if family == "unlimited_ocr":  # as DeepSeek-OCR-2's, with reference sliding-window layers
        text = {k: v for k, v in deepseek.items() if not k.startswith(("q_", "qk_", "kv_", "v_"))}
        text.update(topk_method="group_limited_greedy", sliding_window=4)
        text = dict(common, **dict(text, num_key_value_heads=2), **_IDS)
        vision = _ocr_vision(s)
        vision["encoder_config"] = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1)
        vision["encoder_config"].update(num_attention_heads=2, image_size=32, patch_size=16)
        kwargs = dict(text_config=text, vision_config=vision, image_token_id=1 << 20)
        return "UnlimitedOcrForConditionalGeneration", kwargs
    return _hybrid_configs(family, s, common, deepseek, dense_first)


def _hybrid_configs(family: str, s: dict, common: dict, deepseek: dict, dense_first) -> tuple:
    """Bailing-Hybrid (KDA linear attention around a gated MLA layer, clamped SwiGLUs) and
    Lara-mini (gated DeltaNet around full attention, an ungated shared expert)."""
    linear_first = ["linear_attention", "full_attention", "linear_attention"]
    if family == "bailing_hybrid":
        bailing = {k: v for k, v in deepseek.items() if k not in ("n_routed_experts",)}
        bailing.update(num_local_experts=s["experts"], **_IDS)
        bailing.update(layer_types=linear_first, mlp_layer_types=dense_first, head_dim=16)
        # the SwiGLU limits: small enough that the tiny model's activations reach them
        bailing.update(swiglu_limits=[0, 0.02, 0.02], swiglu_limits_shared=[0, 0.02, 0.02])
        return "BailingHybridForCausalLM", dict(common, **bailing)
    if family == "lara_mini":
        lara = dict(common, num_key_value_heads=2, head_dim=s["head_dim"], **_IDS)
        lara.update(moe_intermediate_size=s["moe_inter"], num_experts=s["experts"])
        lara.update(shared_expert_intermediate_size=s["shared_inter"], layer_types=linear_first)
        lara.update(linear_num_key_heads=2, linear_num_value_heads=2)
        lara.update(linear_key_head_dim=s["head_dim"], linear_value_head_dim=s["head_dim"])
        return "LaraMiniForCausalLM", lara
    raise ValueError(f"build_model: family {family!r} has no config here")


def _ocr_vision(s: dict) -> dict:
    """A one-layer SAM encoder and a one-layer vision encoder (never run: text-only prompts)."""
    sam = dict(hidden_size=32, output_channels=16, num_hidden_layers=1, num_attention_heads=2)
    sam.update(image_size=64, patch_size=16, window_size=2, global_attn_indexes=[0])
    sam.update(mlp_dim=32, downsample_channels=[16, 32])  # defaults: 512 / 1024-channel convs
    encoder = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1)
    encoder.update(num_attention_heads=2, num_key_value_heads=2, vocab_size=16)
    return dict(sam_config=sam, encoder_config=encoder)
