"""The engine adapters' `norm=` takes the Hugging Face family table's norm classes too
(transformers' `*RMSNorm` of a model type the table supports), through the one lookup
(engine_norms.norm_class -> hf_families.norm_weight_offset): a Llama-style norm with weight_bias 0,
a zero-centred one (Qwen3-Next's `(1 + weight)`) with weight_bias 1, its eps checked; a transformers
norm of a type the table lacks, a gated norm and a look-alike are refused naming the class and the
accepted ones. Judged against tests/oracle64.py as the engine classes are
(test_engine_handoffs.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from fusion_bridge import EpilogueSpec, FusionBridge
from fusion_bridge.integrations import engine_handoff as eh
from fusion_bridge.integrations.engine_norms import HandoffError, norm_class
from tests.integrations import engine_cases as ec

pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import (  # noqa: E402
    Qwen3NextRMSNorm,
    Qwen3NextRMSNormGated,
)


@functools.lru_cache(maxsize=None)
def bridge(weight_bias: float = 0.0) -> FusionBridge:
    spec = EpilogueSpec(hidden_size=ec.H, top_k=ec.K, eps=ec.EPS, weight_bias=weight_bias)
    return FusionBridge(spec, strategy="separate")


def hf_norm(cls, weight: torch.Tensor, eps: float = ec.EPS) -> torch.nn.Module:
    """transformers' norm module holding `weight` (bf16, as a bf16 model's norm holds it)."""
    norm = cls(ec.H, eps=eps).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


def call(p: ec.Pieces, weight_bias: float = 0.0, **norm):
    return eh.finalize_handoff(
        bridge(weight_bias),
        p.gemm2,
        eh.ExpandedToPermuted.from_2d(p.perm),
        ec.handoff_weights(p, True, torch.float32),  # the model's factor folded in: scale 1
        p.shared,
        p.residual,
        scale_to_apply=1.0,
        shared_replicated=False,
        **norm,
    )


def test_a_family_table_llama_style_norm_is_read_with_offset_0():
    p = ec.pieces(5, 5, 1, 0)
    norm = hf_norm(Qwen3MoeRMSNorm, p.norm_weight)
    assert norm_class(norm).offset == 0.0 and norm_class(norm).eps_attr == "variance_epsilon"
    out = call(p, norm=norm)
    ec.check(out, ec.oracle(5, 5, 1, folded=True, w_dtype=torch.float32))
    # the norm the bridge computed is the module's own (its forward on the residual_out)
    with torch.no_grad():
        assert torch.allclose(out.norm_out.float(), norm(out.residual_out).float(), atol=2**-6)
    with pytest.raises(HandoffError, match=r"spec.weight_bias must be 0.0 .*Qwen3MoeRMSNorm"):
        call(p, weight_bias=1.0, norm=norm)


def test_a_zero_centred_family_table_norm_needs_weight_bias_1_and_its_eps():
    p = ec.pieces(5, 5, 1, 0, gemma=True)
    norm = hf_norm(Qwen3NextRMSNorm, p.norm_weight)
    assert norm_class(norm).offset == 1.0 and norm_class(norm).eps_attr == "eps"
    out = call(p, weight_bias=1.0, norm=norm)
    exact = ec.oracle(5, 5, 1, folded=True, w_dtype=torch.float32, weight_bias=1.0, gemma=True)
    ec.check(out, exact)
    with pytest.raises(HandoffError, match=r"spec.weight_bias must be 1.0 .*Qwen3NextRMSNorm"):
        call(p, norm=norm)  # weight_bias 0: (weight + 0) would be off by one everywhere
    with pytest.raises(HandoffError, match=r"spec.eps must be the norm's eps \(1e-05\)"):
        call(p, weight_bias=1.0, norm=hf_norm(Qwen3NextRMSNorm, p.norm_weight, eps=1e-5))


class LookAlikeRMSNorm(Qwen3MoeRMSNorm):
    """Qwen3-MoE's norm subclassed outside transformers: it may compute another norm."""


@pytest.mark.parametrize(
    "make",
    [
        lambda w: hf_norm(LlamaRMSNorm, w),  # transformers' own, but no row in the family table
        lambda w: Qwen3NextRMSNormGated(ec.H, eps=ec.EPS),  # takes a gate: another norm
        lambda w: hf_norm(LookAlikeRMSNorm, w),
    ],
    ids=["not-in-the-table", "gated", "subclass"],
)
def test_other_norm_classes_are_refused_naming_the_class_and_the_accepted_ones(make):
    p = ec.pieces(3, 3, 1, 0)
    norm = make(p.norm_weight)
    assert norm_class(norm) is None
    cls = type(norm)
    with pytest.raises(HandoffError) as err:
        call(p, norm=norm)
    text = str(err.value)
    assert f"{cls.__module__}.{cls.__qualname__}" in text, text
    assert "vllm.model_executor.layers.layernorm.GemmaRMSNorm" in text, text
    assert "transformers *RMSNorm of a model type in the Hugging Face family table" in text, text
