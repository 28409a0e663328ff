"""The migration example: before (hand-written epilogue) and after (the bridge) agree, on real gloo
processes; shadow statistics reach explain(); the README's matrix is the generated one."""

import json
import os
import subprocess
import sys

import torch

from fusion_bridge.cli.matrix import embedded, markdown
from migration.examples.deepseek_moe import DeepSeekMoEBlock, MoEConfig, run_rank

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_example_before_and_after_agree_on_two_gloo_ranks_with_shadow_stats():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "migration.examples.deepseek_moe",
            "--world-size",
            "2",
            "--shadow",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["agree"] and len(doc["ranks"]) == 2
    for r in doc["ranks"]:
        shadow = r["shadow"]
        assert shadow["strategy"] == "reference" and shadow["sampled"] == shadow["calls"] == 1
        assert 0 < shadow["outputs"]["norm_out"]["max_rel_err"] < 1e-2
        assert shadow["outputs"]["norm_out"]["nan"] == 0


def test_router_keeps_to_the_top_groups_and_normalizes_weights():
    cfg = MoEConfig()
    block = DeepSeekMoEBlock(cfg, rank=0, world=1)
    x = torch.randn(32, cfg.hidden).to(cfg.dtype)
    ids, weights = block.route(x)
    per_group = cfg.experts // cfg.groups
    assert all(len(set((row // per_group).tolist())) <= cfg.topk_groups for row in ids)
    assert torch.allclose(weights.sum(-1), torch.ones(32))
    gemm2_out, perm, w, shared = block.experts(x)
    assert perm.shape == (32, cfg.top_k) and perm.dtype == torch.int32
    assert sorted(perm.reshape(-1).tolist()) == list(
        range(32 * cfg.top_k)
    )  # each slot has its own row


def test_single_rank_example_agrees():
    r = run_rank(0, 1, 9, shadow=False)
    assert r["norm_rel_diff"] < 2**-6 and r["residual_rel_diff"] < 2**-6


def test_readme_matrix_is_the_generated_one():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert embedded(readme) == markdown(), (
        "README matrix is stale: run `python -m fusion_bridge matrix`"
    )


def test_shadow_statistics_are_printed_in_text_mode(capsys):
    from migration.examples.deepseek_moe import main

    assert main(["--world-size", "1", "--shadow"]) == 0
    out = capsys.readouterr().out
    assert "shadow reference every 1 calls: 1 sampled of 1" in out, out
    for name in ("residual_out", "norm_out"):
        assert f"{name}".ljust(13) + " max rel err" in out, out
