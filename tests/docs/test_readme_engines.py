"""The README's engine sections run as written: each `<!-- engine: NAME -->` code block is executed
with the names it uses bound to a world-size-1 bridge and a handoff built with the engine's own
classes (tests/integrations/engine_wheels.py), and its outputs are judged against oracle64."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

from fusion_bridge import EpilogueSpec, FusionBridge
from tests.integrations import engine_cases as ec, engine_wheels as ew

README = Path(__file__).resolve().parents[2] / "README.md"


def block(engine: str) -> str:
    found = re.search(
        rf"<!-- engine: {engine} -->\n```python\n(.*?)```", README.read_text(), re.DOTALL
    )
    assert found, f"README.md has no <!-- engine: {engine} --> python block"
    return found.group(1)


def test_the_blocks_are_three_lines_of_code():
    for engine in ("vllm", "sglang"):
        lines = [line for line in block(engine).splitlines() if line.strip()]
        assert len(lines) == 3, (engine, lines)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_readme_engine_block_runs_as_written(engine):
    tokens, t_buf = 5, 5 if engine == "vllm" else 8
    p = ec.pieces(tokens, t_buf, 1, 0, route_major=engine == "vllm", gemma=engine == "sglang")
    weights = ec.handoff_weights(p, True, torch.bfloat16)
    if engine == "vllm":
        mo = ew.vllm_moe_output()
        routed = mo.route_major_moe_output(p.gemm2, weights, p.topk_ids, p.expert_map)
        names = {"moe_output": mo.MoEOutput(routed, p.shared, 1.0)}
        norm, weight_bias = ew.engine_norm(ew.VLLM, "RMSNorm", p.norm_weight, ec.EPS), 0.0
    else:
        buffers = ew.sglang_classes()["FlashInferTrtllmDeferredFinalizeOutput"](
            p.gemm2, weights.reshape(-1), p.perm.reshape(-1), ec.K
        )
        names = {"handoff": ew.sglang_from_flashinfer(buffers, gated_shared_output=p.shared, m=5)}
        norm, weight_bias = ew.engine_norm(ew.SGLANG, "GemmaRMSNorm", p.norm_weight, ec.EPS), 1.0
    spec = EpilogueSpec(hidden_size=ec.H, top_k=ec.K, eps=ec.EPS, weight_bias=weight_bias)
    with FusionBridge(spec, strategy="separate") as bridge:
        names.update(
            bridge=bridge,
            residual=p.residual,
            next_layer=types.SimpleNamespace(input_layernorm=norm),
        )
        exec(compile(block(engine), f"README.md <!-- engine: {engine} -->", "exec"), names)
    exact = ec.oracle(
        tokens,
        t_buf,
        1,
        folded=True,
        w_dtype=torch.bfloat16,
        weight_bias=weight_bias,
        route_major=engine == "vllm",
        gemma=engine == "sglang",
    )
    ec.check(names["out"], exact, engine)
    assert names["hidden_states"] is names["out"].norm_out
    assert names["residual"] is names["out"].residual_out
