"""`parity` and `explain` take every EpilogueSpec field (issue 51), so a model's exact spec can be
checked from the command line: each field has its flag (a field added without one fails here), the
flags build exactly the spec a caller would, `--help` says what each means, and the spec's own
limits are reported naming the flag."""

import dataclasses
import json

import pytest
import torch

from fusion_bridge import EpilogueSpec, QuantSpec
from fusion_bridge.cli.args import build_parser
from fusion_bridge.spec import QuantSpec as _QuantSpec
from tests.helpers import run_cli

# EpilogueSpec's (and QuantSpec's) fields -> the flag that sets each
FLAG_OF_FIELD = {
    "hidden_size": "--hidden",
    "top_k": "--top-k",
    "dtype": "--dtype",
    "eps": "--eps",
    "weight_bias": "--weight-bias",
    "routed_scaling_factor": "--routed-scaling-factor",
    "has_shared_output": "--no-shared",
    "shared_output_replicated": "--shared-output-replicated",
    "quant": "--quant",
    "max_tokens": "--max-tokens",
    "quant.kind": "--quant",
    "quant.scale": "--quant-scale",
    "quant.global_scale": "--quant-scale",
    "quant.sf_layout": "--sf-layout",
    "quant.group_size": "--group-size",
    "quant.scale_layout": "--scale-layout",
}
EVERY_FLAG = [
    "--hidden", "64", "--top-k", "2", "--dtype", "fp16", "--eps", "1e-2", "--weight-bias", "0.5",
    "--routed-scaling-factor", "2.5", "--shared-output-replicated", "--quant", "nvfp4",
    "--quant-scale", "100", "--sf-layout", "linear", "--max-tokens", "64",
]  # fmt: skip
EXPECTED = EpilogueSpec(
    hidden_size=64,
    top_k=2,
    dtype=torch.float16,
    eps=1e-2,
    weight_bias=0.5,
    routed_scaling_factor=2.5,
    shared_output_replicated=True,
    quant=QuantSpec.nvfp4(100.0, "linear"),
    max_tokens=64,
)


def test_every_spec_field_has_a_flag_in_parity_and_explain_with_help():
    fields = {f.name for f in dataclasses.fields(EpilogueSpec)}
    fields |= {f"quant.{f.name}" for f in dataclasses.fields(_QuantSpec)}
    assert fields == set(FLAG_OF_FIELD), fields ^ set(FLAG_OF_FIELD)
    parser = build_parser(
        {c: None for c in ("info", "explain", "parity", "tune", "bench", "matrix")}
    )
    commands = parser._subparsers._group_actions[0].choices
    for command in ("parity", "explain"):
        actions = {s: a for a in commands[command]._actions for s in a.option_strings}
        for field, flag in FLAG_OF_FIELD.items():
            assert flag in actions, (command, field, flag)
            assert len(actions[flag].help or "") > 10, (command, flag)


def test_explain_builds_exactly_the_spec_the_flags_describe():
    run = run_cli("explain", "--json", *EVERY_FLAG)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["spec"] == EXPECTED.to_dict()
    run = run_cli("explain", "--json", "--hidden", "64", "--top-k", "2", "--quant", "fp8",
                  "--quant-scale", "0.25")  # fmt: skip
    assert json.loads(run.stdout)["spec"]["quant"]["scale"] == 0.25


def test_parity_checks_the_flags_spec_over_two_gloo_ranks():
    run = run_cli(
        "parity", "--json", "--tokens", "3", "--world-size", "2", *EVERY_FLAG,
        env_vars={"TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["spec"] == EXPECTED.to_dict()
    assert doc["results"] and all(r["passed"] for r in doc["results"]), doc["results"]


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--eps", "0"], "argument --eps: eps must be a positive float"),
        (["--eps", "tiny"], "argument --eps: expected a number such as 1e-6, got 'tiny'"),
        (["--routed-scaling-factor", "-1"], "argument --routed-scaling-factor:"),
        (["--quant", "fp8", "--quant-scale", "0"], "argument --quant-scale: quant.scale must be"),
        (["--sf-layout", "linear"], "--sf-layout applies to --quant nvfp4 only"),
        (["--quant-scale", "2"], "--quant-scale needs --quant fp8 or nvfp4"),
        (["--no-shared", "--shared-output-replicated"], "contradicts --no-shared"),
        (["--group-size", "64"], "--group-size applies to --quant fp8_per_token_group only"),
        (
            ["--quant", "fp8_per_token", "--scale-layout", "column_major"],
            "--scale-layout applies to --quant fp8_per_token_group only, got --quant fp8_per_token",
        ),
        (
            ["--quant", "fp8_per_token_group", "--group-size", "48"],
            "argument --group-size: quant.group_size must be a power of two",
        ),
        (
            ["--quant", "fp8_per_token_group", "--group-size", "128"],
            "argument --hidden: hidden_size must be a multiple of quant.group_size (128)",
        ),
        (["--quant", "fp8_per_token", "--quant-scale", "2"], "--quant-scale needs --quant fp8"),
        (["--quant", "mxfp8"], "invalid choice"),
    ],
)
def test_a_bad_spec_flag_is_named(argv, expected):
    run = run_cli("explain", "--hidden", "64", "--top-k", "2", *argv)
    assert run.returncode == 2 and expected in run.stderr, run.stderr


def test_explain_builds_the_dynamic_fp8_specs():
    run = run_cli("explain", "--json", "--hidden", "256", "--top-k", "2", "--quant",
                  "fp8_per_token_group", "--group-size", "64", "--scale-layout",
                  "column_major_tma")  # fmt: skip
    assert run.returncode == 0, run.stderr
    want = EpilogueSpec(
        hidden_size=256, top_k=2, quant=QuantSpec.fp8_per_token_group(64, "column_major_tma")
    )
    assert json.loads(run.stdout)["spec"] == want.to_dict()
    run = run_cli("explain", "--json", "--hidden", "256", "--top-k", "2", "--quant",
                  "fp8_per_token_group")  # fmt: skip
    assert json.loads(run.stdout)["spec"]["quant"]["group_size"] == 128
    run = run_cli("explain", "--json", "--hidden", "200", "--top-k", "2", "--quant",
                  "fp8_per_token")  # fmt: skip
    assert json.loads(run.stdout)["spec"]["quant"]["kind"] == "fp8_per_token"
