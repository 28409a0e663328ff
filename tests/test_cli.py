"""The CLI as users run it: a subprocess, JSON on stdout only, the documented fields."""

import json
import os
import subprocess
import sys

import pytest


def cli(*args, check=True):
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-m", "fusion_bridge", *args], capture_output=True, text=True,
                          env=env, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_no_arguments_explains_the_deepseek_v3_shape():
    out = cli().stdout
    assert "H=7168 K=8" in out and "SELECTED" in out and "selected for T=16: separate" in out


def test_help_lists_the_commands():
    out = cli("--help").stdout
    for command in ("info", "explain", "parity"):
        assert command in out


def test_info_json_has_every_strategy_with_reasons_steps_and_self_test():
    doc = json.loads(cli("info", "--json").stdout)
    assert doc["environment"]["device_type"] in ("cpu", "cuda")
    names = [s["name"] for s in doc["strategies"]]
    assert names == ["local_fused_flashinfer", "local_fused_nccl", "flashinfer_fused", "flashinfer_fused_fp4",
                     "separate", "reference"]
    for s in doc["strategies"]:
        assert set(s) >= {"name", "available", "reasons", "steps", "self_test"}
        assert s["available"] == (not s["reasons"])
        # on this CPU machine no GPU strategy is self-tested, and the report says why
        expected = "not needed" if s["name"] in ("separate", "reference") else "not run (CUDA only)"
        if doc["environment"]["device_type"] == "cpu":
            assert s["self_test"] == expected, s
        assert all(set(r) == {"code", "message", "hint"} for r in s["reasons"]) and s["steps"]


@pytest.mark.parametrize("sm", ["90", "100"])
def test_explain_nvfp4_never_uses_flashinfer_fused_fp4(sm):
    doc = json.loads(cli("explain", "--hidden", "7168", "--top-k", "8", "--tokens", "16", "--world-size", "2",
                         "--quant", "nvfp4", "--sm", sm, "--json").stdout)
    strategies = {s["name"]: s for s in doc["strategies"]}
    assert doc["selected"] == "local_fused_flashinfer" and doc["environment"]["sm"] == int(sm)
    for s in doc["strategies"]:
        if s["available"]:
            assert "flashinfer.moe_finalize_ar_residual_rmsnorm_fp4" not in s["steps"]
    assert strategies["flashinfer_fused"]["steps"] == ["flashinfer.moe_finalize_ar_residual_rmsnorm",
                                                       "local.quant_nvfp4"]
    codes = [r["code"] for r in strategies["flashinfer_fused_fp4"]["reasons"]]
    assert "flashinfer_fused_fp4_broken" in codes and (("fp4_needs_sm100" in codes) == (sm == "90"))


def test_explain_routes_gpt_oss_hidden_size_away_from_the_fused_kernel():
    doc = json.loads(cli("explain", "--hidden", "2880", "--top-k", "4", "--world-size", "2", "--sm", "90",
                         "--gpu", "NVIDIA H200", "--json").stdout)
    fi = {s["name"]: s for s in doc["strategies"]}["flashinfer_fused"]
    assert not fi["available"] and fi["reasons"][0]["code"] == "hidden_not_multiple_of_256"
    assert doc["environment"]["gpu_name"] == "NVIDIA H200"


def test_parity_world_size_two_json():
    proc = cli("parity", "--world-size", "2", "--hidden", "512", "--top-k", "4", "--tokens", "5", "--json")
    doc = json.loads(proc.stdout)  # stdout is only the JSON document
    rows = doc["results"]
    assert {r["strategy"] for r in rows} >= {"separate"}
    for r in rows:
        assert set(r) >= {"strategy", "output", "rel_err", "max_abs_err"} and r["passed"]


def test_bad_arguments_exit_2_with_a_message():
    proc = cli("explain", "--hidden", "72", "--quant", "nvfp4", check=False)
    assert proc.returncode == 2 and "multiple of 16 for nvfp4, got 72" in proc.stderr
    proc = cli("explain", "--dtype", "fp32", check=False)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_the_cli_package_uses_only_the_public_api():
    """No `obj._private` attribute access and no `_private` import from fusion_bridge in fusion_bridge/cli."""
    import ast
    import pathlib

    import fusion_bridge.cli
    offenders = []
    for path in pathlib.Path(fusion_bridge.cli.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                offenders.append(f"{path.name}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("fusion_bridge", ".")):
                offenders += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                              if a.name.startswith("_")]
    assert not offenders, offenders
