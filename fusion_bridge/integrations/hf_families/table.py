"""The family table: one row per transformers MoE model type the adapter supports, keyed by the
language model's `config.model_type` (as Liger's MODEL_TYPE_TO_APPLY_LIGER_FN). Each row's
`source` names the transformers modeling file it was read from and what that file does after the
modules the patch calls (router, experts' `_apply_gate`, shared expert). A new family that fits
the behaviours of `Family` is one row here.
"""

from __future__ import annotations

import torch

from fusion_bridge.integrations.hf_families.base import Family


def _sigmoid_grouped(name: str, types: tuple[str, ...], modeling: str, note: str, **kw) -> Family:
    """DeepSeek-V3's block: a TopkRouter whose fp32 weights carry routed_scaling_factor (sigmoid
    scores, e_score_correction_bias for the choice, grouped top-k, normalised when norm_topk_prob),
    plus `shared_experts(x)` unscaled."""
    return Family(
        name, types, (modeling,), note, scaled_router=True, shared_attr="shared_experts", **kw
    )


def _softmax_topk(name: str, types: tuple[str, ...], modeling: str, note: str, **kw) -> Family:
    """Qwen's block: a TopKRouter (softmax over fp32 logits, top-k, renormalised per the config,
    cast back to the activation dtype), weights applied as they are."""
    return Family(name, types, (modeling,), note, **kw)


def _clamped_glu(shared: torch.nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """MiniMaxM3VLDenseMLP's activation, as its forward writes it (elementwise): gate clamped
    above, up clamped both ways at swiglu_limit, (up + 1) * gate * sigmoid(gate * swiglu_alpha)."""
    gate = gate.clamp(max=shared.swiglu_limit)
    up = up.clamp(min=-shared.swiglu_limit, max=shared.swiglu_limit)
    glu = gate * torch.sigmoid(gate * shared.swiglu_alpha)
    return (up + 1.0) * glu


def _limited_swiglu(shared: torch.nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """BailingHybridMLP's activation, as its forward writes it (elementwise): act_fn(gate) clamped
    above and up clamped both ways at the layer's `limit` where it has one (None: no clamp)."""
    gate = shared.act_fn(gate)
    if shared.limit is not None:
        gate = gate.clamp(max=shared.limit)
        up = up.clamp(min=-shared.limit, max=shared.limit)
    return gate * up


_QWEN_GATED = dict(shared_attr="shared_expert", shared_gate_attr="shared_expert_gate")

FAMILY_ROWS: tuple[Family, ...] = (
    _sigmoid_grouped(
        "DeepSeek-V3",
        ("deepseek_v3", "kimi_k2"),
        "deepseek_v3",
        "modeling_deepseek_v3: DeepseekV3MoE; Kimi-K2's config.json says 'kimi_k2' for this "
        "architecture, Kimi-K2.5 (kimi_k25) wraps it",
        wrappers=("kimi_k25",),
    ),
    _sigmoid_grouped(
        "DeepSeek-V2",
        ("deepseek_v2",),
        "deepseek_v2",
        "modeling_deepseek_v2: DeepseekV2Moe, softmax router (greedy or group-limited), weights "
        "times routed_scaling_factor, never renormalised",
    ),
    _sigmoid_grouped(
        "DeepSeek-V3.2",
        ("deepseek_v32",),
        "deepseek_v32",
        "modeling_deepseek_v32: DeepseekV32MoE as DeepseekV3MoE; sparse (indexer) attention",
    ),
    _sigmoid_grouped(
        "GLM-4-MoE", ("glm4_moe",), "glm4_moe", "modeling_glm4_moe: Glm4MoeMoE as DeepseekV3MoE"
    ),
    _sigmoid_grouped(
        "GLM-4-MoE-Lite",
        ("glm4_moe_lite",),
        "glm4_moe_lite",
        "modeling_glm4_moe_lite: Glm4MoeLiteMoE as DeepseekV3MoE; MLA attention",
    ),
    _sigmoid_grouped(
        "GLM-MoE-DSA",
        ("glm_moe_dsa",),
        "glm_moe_dsa",
        "modeling_glm_moe_dsa: GlmMoeDsaMoE as DeepseekV3MoE; DSA indexer attention",
    ),
    _sigmoid_grouped(
        "Mistral-4",
        ("mistral4",),
        "mistral4",
        "modeling_mistral4: Mistral4MoE as DeepseekV3MoE",
        # the NaN was the bound's, not the logits': the random prompt held pad_token_id 11, whose
        # zero embedding row made the bound 0/0 (fixed in hf_moe_bound.py); on the CPU, bf16, at
        # the GPU check's size both prompts pass within the bound; kept until the GPU rerun passes
        cuda_refusal="its GPU check (tests/integrations/test_hf_transformers_on_gpu.py, one H100) "
        "reported a NaN logits error at the large size (the bound's 0/0 at the padding token, "
        "since fixed); not rerun on a GPU yet",
    ),
    _sigmoid_grouped(
        "Mistral-Large-4",
        ("mistral_large4_text",),
        "mistral_large4",
        "modeling_mistral_large4: MistralLarge4TextMoE as DeepseekV3MoE (always renormalised); "
        "the layer also returns its indexer's top-k, which the patch leaves alone",
        wrappers=("mistral_large4",),
    ),
    _sigmoid_grouped(
        "Kimi-Linear",
        ("kimi_linear",),
        "kimi_linear",
        "modeling_kimi_linear: KimiLinearMoE as DeepseekV3MoE; KDA linear attention layers",
    ),
    _sigmoid_grouped(
        "dots.llm1",
        ("dots1",),
        "dots1",
        "modeling_dots1: Dots1MoE as DeepseekV3MoE (Qwen-style attention)",
    ),
    _sigmoid_grouped(
        "Solar-Open",
        ("solar_open",),
        "solar_open",
        "modeling_solar_open: SolarOpenMoE as DeepseekV3MoE; every layer MoE",
    ),
    _sigmoid_grouped(
        "EXAONE-MoE",
        ("exaone_moe",),
        "exaone_moe",
        "modeling_exaone_moe: ExaoneMoeSparseMoEBlock as DeepseekV3MoE (its shared experts "
        "sized by num_shared_experts)",
    ),
    _sigmoid_grouped(
        "MiMo-V2-Flash",
        ("mimo_v2_flash",),
        "mimo_v2_flash",
        "modeling_mimo_v2_flash: MiMoV2FlashMoE as DeepseekV3MoE without shared experts (the "
        "row's shared expert is absent); sliding-window attention with a value scale",
    ),
    _sigmoid_grouped(
        "GLM-4.5V",
        ("glm4v_moe_text",),
        "glm4v_moe",
        "modeling_glm4v_moe: Glm4vMoeTextMoE as DeepseekV3MoE; the text model at "
        "model.language_model (the vision tower is not patched)",
        wrappers=("glm4v_moe",),
    ),
    _sigmoid_grouped(
        "HY-V3",
        ("hy_v3",),
        "hy_v3",
        "modeling_hy_v3: HYV3MoE, its TopKRouter takes the block's e_score_correction_bias and "
        "multiplies its renormalised sigmoid weights by router_scaling_factor; adds "
        "shared_experts(x) (in fp32 where enable_moe_fp32_combine)",
        router_args=("e_score_correction_bias",),
        scaling_attr="router_scaling_factor",
    ),
    _sigmoid_grouped(
        "dots3.note",
        ("dots3_note_text",),
        "dots3_note",
        "modeling_dots3_note (5.25): Dots3NoteTextMoE as DeepseekV3MoE; MLA with DSA indexer "
        "attention and a per-head sigmoid gate; the text model, alone or at the wrapper's "
        "model.language_model (its vision encoder's MoE blocks are refused by their structure)",
        wrappers=("dots3_note",),
    ),
    _sigmoid_grouped(
        "DeepSeek-OCR-2",
        ("deepseek_ocr2_text",),
        "deepseek_ocr2",
        "modeling_deepseek_ocr2: DeepseekOcr2TextMoe as DeepseekV2Moe (softmax router, greedy or "
        "group-limited, weights times routed_scaling_factor, never renormalised), plus "
        "shared_experts(x) unscaled; the text model at model.language_model (the SAM and vision "
        "encoders are not patched)",
        wrappers=("deepseek_ocr2",),
    ),
    _sigmoid_grouped(
        "Unlimited-OCR",
        ("unlimited_ocr_text",),
        "unlimited_ocr",
        "modeling_unlimited_ocr (5.25): UnlimitedOcrTextMoe as DeepSeek-OCR-2's; reference "
        "sliding-window attention; the text model at model.language_model",
        wrappers=("unlimited_ocr",),
    ),
    _sigmoid_grouped(
        "Bailing-Hybrid",
        ("bailing_hybrid",),
        "bailing_hybrid",
        "modeling_bailing_hybrid (5.25): BailingHybridMoE as DeepseekV3MoE, its experts' "
        "_apply_gate and its shared MLP clamp the SwiGLU at per-layer limits; KDA linear "
        "attention and gated MLA layers",
        shared_act=_limited_swiglu,
    ),
    _sigmoid_grouped(
        "MiniCPM5-MoE",
        ("minicpm5_moe",),
        "minicpm5_moe",
        "modeling_minicpm5_moe: MiniCPM5MoeMoE as DeepseekV3MoE",
    ),
    _softmax_topk(
        "Qwen2-MoE",
        ("qwen2_moe",),
        "qwen2_moe",
        "modeling_qwen2_moe: Qwen2MoeSparseMoeBlock adds sigmoid(shared_expert_gate(x)) * "
        "shared_expert(x)",
        **_QWEN_GATED,
    ),
    _softmax_topk(
        "HunYuan-MoE-V1",
        ("hunyuan_v1_moe",),
        "hunyuan_v1_moe",
        "modeling_hunyuan_v1_moe: HunYuanMoEV1Moe, its fp32 gate a softmax top-k renormalised "
        "(weights left fp32), plus shared_mlp(x) unscaled; every layer MoE",
        shared_attr="shared_mlp",
    ),
    _softmax_topk(
        "Mellum",
        ("mellum",),
        "mellum",
        "modeling_mellum: MellumSparseMoeBlock as Qwen3-MoE's (no shared expert); sliding-window "
        "layers",
    ),
    _softmax_topk(
        "Flint",
        ("flint",),
        "flint",
        "modeling_flint: FlintSparseMoeBlock, a sigmoid top-k router renormalised per the config, "
        "plus shared_expert(x) ungated",
        shared_attr="shared_expert",
    ),
    _softmax_topk(
        "Lara-mini",
        ("lara_mini",),
        "lara_mini",
        "modeling_lara_mini (5.25): LaraMiniSparseMoeBlock, a softmax router over fp32 logits "
        "renormalised per the config, plus shared_expert(x) ungated; gated DeltaNet layers; its "
        "RMSNorm applies the weight in fp32",
        shared_attr="shared_expert",
    ),
    _softmax_topk("Qwen3-MoE", ("qwen3_moe",), "qwen3_moe", "modeling_qwen3_moe: no shared expert"),
    _softmax_topk(
        "Qwen3.5-MoE",
        ("qwen3_5_moe_text",),
        "qwen3_5_moe",
        "modeling_qwen3_5_moe: the gated shared expert as Qwen2-MoE; zero-centred RMSNorm "
        "(1 + weight); gated DeltaNet layers",
        wrappers=("qwen3_5_moe",),
        weight_bias=1.0,
        **_QWEN_GATED,
    ),
    _softmax_topk(
        "Qwen3-Next",
        ("qwen3_next",),
        "qwen3_next",
        "modeling_qwen3_next: the gated shared expert as Qwen2-MoE; zero-centred RMSNorm "
        "(1 + weight); gated DeltaNet layers",
        weight_bias=1.0,
        # the GPU check ran with the gated DeltaNet's old constant gain of 7, which does not hold
        # where its output cancels (its output is linear in q.k, no softmax); the bound now
        # derives that gain per token (migration/examples/hf_delta_gain.py), which on the CPU,
        # bf16, at the large size barely moves the bound (those tokens' mixer output is a small
        # share of the residual); kept until the GPU check passes with it
        cuda_refusal="its GPU check (tests/integrations/test_hf_transformers_on_gpu.py, one H100) "
        "found a logits error past the bound derived for its gated DeltaNet layers at the large "
        "size, with a constant gain for those layers that does not hold where their output "
        "cancels; the gain is now derived per token, not yet rerun on a GPU",
        **_QWEN_GATED,
    ),
    _softmax_topk(
        "Qwen3-VL-MoE",
        ("qwen3_vl_moe_text",),
        "qwen3_vl_moe",
        "modeling_qwen3_vl_moe: Qwen3VLMoeTextSparseMoeBlock as Qwen3-MoE's; the text model at "
        "model.language_model",
        wrappers=("qwen3_vl_moe",),
    ),
    _softmax_topk(
        "Qwen3-Omni-MoE thinker",
        ("qwen3_omni_moe_text",),
        "qwen3_omni_moe",
        "modeling_qwen3_omni_moe: Qwen3OmniMoeThinkerTextSparseMoeBlock as Qwen3-MoE's; the "
        "thinker's text model moves (the talker is not patched)",
        wrappers=("qwen3_omni_moe", "qwen3_omni_moe_thinker"),
        # 5.25: model.language_model (thinker) / thinker.model.language_model (whole model);
        # 5.17: the thinker's text model is its `.model` (thinker.model of the whole model)
        text_paths=(
            "model.language_model",
            "thinker.model.language_model",
            "model",
            "thinker.model",
        ),
    ),
    _softmax_topk(
        "OLMoE", ("olmoe",), "olmoe", "modeling_olmoe: OlmoeSparseMoeBlock as Qwen3-MoE's"
    ),
    _softmax_topk(
        "ERNIE-4.5-MoE",
        ("ernie4_5_moe",),
        "ernie4_5_moe",
        "modeling_ernie4_5_moe: softmax router choosing by moe_statics' bias, renormalised "
        "(clamped at norm_min); `shared_experts(x)` unscaled where the config has any",
        shared_attr="shared_experts",
    ),
    _softmax_topk(
        "Mixtral", ("mixtral",), "mixtral", "modeling_mixtral: renormalised fp32 router weights"
    ),
    Family(
        "Aria",
        ("aria_text",),
        ("aria",),
        "modeling_aria (5.25): AriaTextMoELayer, its `router` a softmax over the top-k logits, "
        "plus shared_experts(x) unscaled; transposed experts; the text model, alone or at the "
        "wrapper's model.language_model (5.17's block scales the expert input: refused there)",
        wrappers=("aria",),
        router_attr="router",
        shared_attr="shared_experts",
    ),
    Family(
        "MiniMax-M2",
        ("minimax_m2",),
        ("minimax_m2",),
        "modeling_minimax_m2: the router takes the block's e_score_correction_bias",
        router_args=("e_score_correction_bias",),
    ),
    Family(
        "MiniMax-M3",
        ("minimax_m3_vl_text",),
        ("minimax_m3_vl",),
        "modeling_minimax_m3_vl: MiniMaxM3VLSparseMoeBlock multiplies its routed output by its "
        "own routed_scaling_factor and adds shared_experts(x), a fused gate_up_proj MLP with a "
        "clamped GLU; zero-centred RMSNorm (1 + weight)",
        wrappers=("minimax_m3_vl",),
        block_scaling=True,
        shared_attr="shared_experts",
        shared_act=_clamped_glu,
        weight_bias=1.0,
    ),
    Family(
        "Laguna",
        ("laguna",),
        ("laguna",),
        "modeling_laguna: LagunaSparseMoeBlock, its TopKRouter a sigmoid top-k chosen with "
        "e_score_correction_bias and renormalised; the block multiplies its routed output by its "
        "own routed_scaling_factor and adds shared_experts(x) unscaled; softplus-gated attention",
        block_scaling=True,
        shared_attr="shared_experts",
    ),
    Family(
        "Granite-MoE",
        ("granitemoe",),
        ("granitemoe",),
        "modeling_granitemoe: GraniteMoeMoE at `block_sparse_moe`, its `router` a softmax over "
        "the top-k logits; the layer adds residual + h * residual_multiplier",
        router_attr="router",
        moe_attr="block_sparse_moe",
        residual_multiplier="residual_multiplier",
    ),
    Family(
        "Granite-MoE-Shared",
        ("granitemoeshared",),
        ("granitemoeshared",),
        "modeling_granitemoeshared: Granite-MoE's block and multiplier, plus the layer's own "
        "shared_mlp (fused input_linear [2I, H] / output_linear) added as moe + shared_mlp(x)",
        router_attr="router",
        moe_attr="block_sparse_moe",
        residual_multiplier="residual_multiplier",
        shared_attr="shared_mlp",
        shared_on_layer=True,
    ),
    Family(
        "gpt-oss",
        ("gpt_oss",),
        ("gpt_oss",),
        "modeling_gpt_oss: GptOssMLP's router is `router`, the block returns (output, scores); "
        "transposed biased experts with their own clamped _apply_gate",
        router_attr="router",
        block_returns="pair",
    ),
)
