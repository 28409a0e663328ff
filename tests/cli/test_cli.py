"""The CLI as users run it: JSON on stdout only, the documented fields, one-line errors.

Most tests run it in this process (`cli`: tests.helpers.run_cli calls `main(argv)` with file
descriptors 1 and 2 captured, as `python -m fusion_bridge` does, without paying torch's import per
call); those about the process itself start one (`cli_process`, or `python -c`): parity over
spawned ranks with TRITON_INTERPRET unset, --help without importing torch, the console script, a
reader that leaves early."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import run_cli

# `explain` and the shipped table's preview describe the strategies this process can run; without
# the flashinfer package the FlashInfer strategies are off (reason `flashinfer_missing`), so the
# selections those tests assert on differ (parity checks either case). The README's setup installs
# the `flashinfer` extra; with `pip install -e ".[test]"` alone these tests skip.
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
needs_flashinfer = pytest.mark.skipif(
    not HAS_FLASHINFER,
    reason="flashinfer is not installed (pip install -e '.[flashinfer,test]'): the expected "
    "selections include FlashInfer strategies",
)


def cli(*args, check=True, env_vars=None):
    """The CLI in this process: returncode, stdout, stderr as `python -m fusion_bridge ARGS` would
    give them (tests.helpers.run_cli)."""
    proc = run_cli(*args, env_vars=env_vars)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def cli_process(*args, check=True, env_vars=None):
    """`python -m fusion_bridge ARGS` in a process of its own."""
    env = dict(os.environ)
    env.pop("FUSION_BRIDGE_STRATEGY", None)
    for name, value in (env_vars or {}).items():  # None: unset
        env.pop(name, None) if value is None else env.__setitem__(name, value)
    proc = subprocess.run(
        [sys.executable, "-m", "fusion_bridge", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_no_arguments_explains_the_deepseek_v3_shape():
    # the README's first command (`python -m fusion_bridge`: main with no arguments; the module's
    # own entry point runs as a process in the parity and early-reader tests)
    out = cli().stdout
    assert "H=7168 K=8" in out and "SELECTED" in out and "selected for T=16: separate" in out
    # this machine was not described: no "described machine" footer
    assert "described machine" not in out, out.splitlines()[-1]
    lines = out.splitlines()
    # the answer first: the strategy for T, then the plan per token range, before any strategy
    assert lines[3] == "selected for T=16: separate" and lines[4].startswith("plan (")
    assert lines.index("strategies:") < 10, out
    # a strategy that can run here states its self-test once, with why it did not run
    rows = [line for line in lines if "self-test:" in line]
    assert all(line.count("self-test") == 1 for line in rows), rows
    assert all(line.endswith(("not run (static checks only)", "not needed")) for line in rows), rows
    # without a GPU, a GPU strategy is one line: no GPU-machine advice (multicast, world sizes)
    import torch

    if not torch.cuda.is_available():
        fi = [line for line in lines if line.startswith("flashinfer_fused ")]
        assert fi == [
            "flashinfer_fused       rejected: needs a CUDA GPU [needs_cuda] "
            "(+1 more for GPU machines: in the report's JSON, `to_dict()` in Python, `--json` on "
            "the command line)"
        ]
        assert "hint:" not in out.split("strategies:")[1].split("flashinfer_fused_fp4")[0]
        assert "MULTICAST" not in out and "world sizes" not in out


def test_explain_text_of_a_described_gpu():
    out = cli("explain", "--sm", "90", "--world-size", "2").stdout
    assert out.splitlines()[0].startswith(
        "fusion-bridge on cuda SM90, world size 2;"
    )  # no "SM90 SM90 GPU"
    # flashinfer_fused_fp4 does not apply to quant=none: that one reason, not the FP4 gate's too
    fp4 = out.split("flashinfer_fused_fp4", 1)[1].split("\nseparate", 1)[0]
    assert "[quant_not_nvfp4]" in fp4 and fp4.count("[") == 1, fp4
    tail = out.split("(a described machine: static checks only, no self-test, no workspace)")[1]
    # it says what it took for granted about that machine; multicast is not among the needs
    assert tail.startswith("\nassumed for it:\n  world size 2, every rank on one node\n")
    assert "multicast: not needed by any strategy" in tail


def test_explain_of_a_described_machine_lists_its_assumptions_in_json_too():
    doc = json.loads(cli("explain", "--gpu", "H200", "--world-size", "2", "--json").stdout)
    assert doc["assumed"][0] == "world size 2, every rank on one node"
    # the shipped table was measured with NVLS and multicast off: said with the table's versions
    assert any(
        a.startswith("the tuning table's times: measured with NCCL NVLS and NVLink multicast off")
        for a in doc["assumed"]
    )
    here = json.loads(cli("explain", "--json").stdout)
    assert here["assumed"] == []  # this machine is probed, not assumed


def test_report_names_the_gpu_once_and_carries_a_schema_version():
    from fusion_bridge import EpilogueSpec
    from fusion_bridge.environment import Environment
    from fusion_bridge.plan.planner import select, static_statuses
    from fusion_bridge.plan.report import Report

    spec = EpilogueSpec(hidden_size=7168, top_k=8)
    for name, where in (
        ("NVIDIA H200", "cuda SM90 (NVIDIA H200),"),
        ("SM90 GPU", "cuda SM90,"),
        (None, "cuda SM90,"),
    ):
        env = Environment(device_type="cuda", sm=90, gpu_name=name, world_size=2)
        statuses = static_statuses(spec, env)
        report = Report(env, spec, statuses, select(statuses, spec), tokens=4)
        assert str(report).startswith(f"fusion-bridge on {where} world size 2"), str(
            report
        ).splitlines()[0]
    assert json.loads(report.to_json())["schema_version"] == 1


def test_sm_hint_names_the_sm_that_is_needed():
    from fusion_bridge.environment import Environment
    from fusion_bridge.reasons import require_sm_at_least

    reason = require_sm_at_least(Environment(device_type="cuda", sm=75), "x", 80)
    assert "SM >= 80" in reason.hint and "Hopper" not in reason.hint


def test_help_lists_the_commands():
    out = cli("--help").stdout
    for command in ("info", "explain", "parity"):
        assert command in out


def test_info_json_has_every_strategy_with_reasons_steps_and_self_test():
    doc = json.loads(cli("info", "--json").stdout)
    # info and explain print one shape: the report's to_dict() plus command and env_strategy
    explained = json.loads(cli("explain", "--json").stdout)
    assert (
        list(doc) == list(explained) and doc["schema_version"] == explained["schema_version"] == 1
    )
    assert (doc["command"], explained["command"]) == ("info", "explain") and doc[
        "env_strategy"
    ] is None
    assert [s["name"] for s in doc["strategies"]] == [s["name"] for s in explained["strategies"]]
    assert doc["environment"]["device_type"] in ("cpu", "cuda")
    names = [s["name"] for s in doc["strategies"]]
    assert names == [
        "fused_tp1",
        "local_fused_flashinfer",
        "local_fused_nccl",
        "symm_fused_oneshot",
        "symm_fused_twoshot",
        "flashinfer_fused",
        "flashinfer_fused_fp4",
        "separate",
        "reference",
    ]
    for s in doc["strategies"]:
        assert set(s) >= {"name", "available", "reasons", "steps", "self_test"}
        assert s["available"] == (not s["reasons"])
        # on this CPU machine no GPU strategy is self-tested, and the report says why
        expected = "not needed" if s["name"] in ("separate", "reference") else "not run (CUDA only)"
        if doc["environment"]["device_type"] == "cpu":
            assert s["self_test"] == expected, s
        assert all(set(r) == {"code", "message", "hint"} for r in s["reasons"]) and s["steps"]


@needs_flashinfer
@pytest.mark.parametrize("sm", ["90", "100"])
def test_explain_nvfp4_never_uses_flashinfer_fused_fp4(sm):
    doc = json.loads(
        cli(
            "explain",
            "--hidden",
            "7168",
            "--top-k",
            "8",
            "--tokens",
            "16",
            "--world-size",
            "2",
            "--quant",
            "nvfp4",
            "--sm",
            sm,
            "--json",
        ).stdout
    )
    strategies = {s["name"]: s for s in doc["strategies"]}
    assert doc["selected"] == "local_fused_flashinfer" and doc["environment"]["sm"] == int(sm)
    for s in doc["strategies"]:
        if s["available"]:
            assert "flashinfer.moe_finalize_ar_residual_rmsnorm_fp4" not in s["steps"]
    assert strategies["flashinfer_fused"]["steps"] == [
        "flashinfer.moe_finalize_ar_residual_rmsnorm",
        "local.quant_nvfp4",
    ]
    codes = [r["code"] for r in strategies["flashinfer_fused_fp4"]["reasons"]]
    assert "flashinfer_fused_fp4_broken" in codes and (("fp4_needs_sm100" in codes) == (sm == "90"))


@needs_flashinfer
def test_explain_routes_gpt_oss_hidden_size_away_from_the_fused_kernel():
    doc = json.loads(
        cli(
            "explain",
            "--hidden",
            "2880",
            "--top-k",
            "4",
            "--world-size",
            "2",
            "--sm",
            "90",
            "--gpu",
            "NVIDIA H200",
            "--json",
        ).stdout
    )
    fi = {s["name"]: s for s in doc["strategies"]}["flashinfer_fused"]
    assert not fi["available"] and fi["reasons"][0]["code"] == "hidden_not_multiple_of_256"
    assert doc["environment"]["gpu_name"] == "NVIDIA H200"


def test_parity_world_size_two_json():
    # a process of its own (stdout is only the JSON document at the file-descriptor level; ranks
    # spawned from it), TRITON_INTERPRET unset, as a user runs it: on CPU parity sets it for
    # local_fused_nccl
    proc = cli_process(
        "parity",
        "--world-size",
        "2",
        "--hidden",
        "512",
        "--top-k",
        "4",
        "--tokens",
        "5",
        "--seed",
        "3",
        "--json",
        env_vars={"TRITON_INTERPRET": None},
    )
    doc = json.loads(proc.stdout)  # stdout is only the JSON document
    assert doc["schema_version"] == 1 and doc["command"] == "parity"
    # what was checked, with what: the spec, the seed and the versions
    assert doc["spec"]["hidden_size"] == 512 and doc["spec"]["top_k"] == 4 and doc["seed"] == 3
    assert set(doc["versions"]) == {"fusion_bridge", "torch", "triton", "flashinfer", "cuda"}
    assert doc["versions"]["torch"] and doc["tokens"] == 5 and doc["world_size"] == 2
    rows = doc["results"]
    assert {r["strategy"] for r in rows} >= {"separate"}
    for r in rows:
        assert set(r) >= {"strategy", "output", "rel_err", "max_abs_err"} and r["passed"]
    # what it did not run, and why, by reason code
    assert "reference" not in doc["skipped"] and not set(doc["skipped"]) & {
        r["strategy"] for r in rows
    }
    if doc["skipped"]:
        assert all(
            codes and all(isinstance(c, str) for c in codes) for codes in doc["skipped"].values()
        )
    import torch

    if not torch.cuda.is_available():
        missing = [] if HAS_FLASHINFER else ["flashinfer_missing"]
        assert doc["skipped"]["flashinfer_fused"] == missing + ["needs_cuda"]
        assert doc["skipped"]["flashinfer_fused_fp4"] == ["quant_not_nvfp4"]
        # our Triton kernels ran under the interpreter, all-reducing over 2 gloo ranks
        assert doc["triton_interpret"] is True
        assert {r["strategy"] for r in rows} == {"separate", "local_fused_nccl"}


@pytest.mark.parametrize("command", ["tune", "bench"])
def test_tune_and_bench_refuse_a_machine_without_gpus_before_importing_torch(command):
    code = (
        "import sys; from fusion_bridge.cli.main import main; "
        f"rc = main([{command!r}, '--world-size', '2']); "
        "print(rc, 'torch' in sys.modules)"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.stdout.split() == ["2", "False"], (proc.stdout, proc.stderr)
    assert "--world-size 2 needs 2 CUDA GPU(s)" in proc.stderr


def test_info_describes_the_machine_and_explain_the_plan():
    info, explain = cli("info").stdout, cli("explain").stdout
    # info: this machine and what a bridge built here prepared, the plan in one line
    assert "this machine:" in info and "steps:" not in info and "plan: separate for" in info
    # explain: the plan per token range and every strategy's steps and reasons
    assert "this machine:" not in explain and "steps:" in explain
    assert "plan (static order):" in explain


def test_a_requested_strategy_is_named_once_in_the_plan_header():
    out = cli("explain", env_vars={"FUSION_BRIDGE_STRATEGY": "separate"}).stdout
    assert "plan (requested: separate):" in out and "requested, requested" not in out


def test_matrix_json_uses_keys_not_display_titles():
    doc = json.loads(cli("matrix", "--json").stdout)
    row = {r["strategy"]: r for r in doc["matrix"]}["symm_fused_oneshot"]
    assert set(row) == {
        "strategy",
        "stages",
        "launches_sm90_tp2",
        "launches_at_world_size",
        "cpu",
        "sm",
        "world_sizes",
        "quant",
        "flashinfer",
    }
    assert row["world_sizes"] == [2, 3, 4, 5, 6, 7, 8] and row["sm"] == [90, 100]
    assert row["quant"] == ["none", "fp8", "nvfp4"]


def test_bad_arguments_exit_2_with_a_message():
    proc = cli("explain", "--hidden", "72", "--quant", "nvfp4", check=False)
    assert proc.returncode == 2 and "multiple of 16 for nvfp4, got 72" in proc.stderr
    proc = cli("explain", "--dtype", "fp32", check=False)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def _parity_rank_limit() -> tuple[int, str]:
    import torch
    from fusion_bridge.cli.main import gloo_rank_limit

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return (gpus, "one rank per GPU") if gpus else (gloo_rank_limit(), "gloo on CPU")


BAD_ARGUMENTS = [
    (("parity", "--world-size", "0"), "argument --world-size: must be >= 1, got 0"),
    (("parity", "--tokens", "-1"), "argument --tokens: must be in 1..16384, got -1"),
    (("parity", "--tokens", "0"), "argument --tokens: must be in 1..16384, got 0"),
    (("parity", "--world-size", "1000"), "argument --world-size: must be at most"),
    (("explain", "--world-size", "0"), "argument --world-size: must be >= 1, got 0"),
    (("explain", "--world-size", "-2"), "argument --world-size: must be >= 1, got -2"),
    (("explain", "--tokens", "-3"), "argument --tokens: must be >= 0, got -3"),
    (("explain", "--sm", "-1"), "argument --sm: must be in 70..200, got -1"),
    (("explain", "--sm", "300"), "argument --sm: must be in 70..200, got 300"),
    (("explain", "--hidden", "0"), "argument --hidden: must be >= 1, got 0"),
    (("explain", "--top-k", "0"), "argument --top-k: must be >= 1, got 0"),
    (("explain", "--top-k", "two"), "argument --top-k: expected an integer, got 'two'"),
    (("info", "--max-tokens", "0"), "argument --max-tokens: must be >= 1, got 0"),
    (("explain", "--gpu", "Tesla V100"), "--gpu 'Tesla V100' is not a GPU whose SM is known here"),
    (
        ("explain", "--gpu", "NVIDIA H200", "--sm", "100"),
        "--sm 100 contradicts --gpu 'NVIDIA H200' (SM 90)",
    ),
    (
        ("tune", "--tokens", "4"),
        "unrecognized arguments: --tokens 4",
    ),  # accepted-and-ignored no more
    (("bench", "--tokens", "4"), "unrecognized arguments: --tokens 4"),
    (("--tokens", "-3"), "argument --tokens: must be >= 0, got -3"),  # no command: explain
    # the spec's own limits, named by their flag
    (("explain", "--hidden", "72", "--quant", "nvfp4"), "argument --hidden: hidden_size must be a"),
    (("explain", "--hidden", "100000000"), "argument --hidden: hidden_size must be <= 1048576"),
    (("parity", "--max-tokens", "100000000"), "argument --max-tokens: max_tokens must be <="),
]


def test_bad_arguments_are_one_line_parser_errors():
    limit, backend = _parity_rank_limit()
    cases = BAD_ARGUMENTS + [
        (("parity", "--world-size", str(limit + 1)), f"must be at most {limit} here ({backend}")
    ]
    for args, message in cases:
        proc = cli(*args, check=False)
        assert proc.returncode == 2 and not proc.stdout, (args, proc.stdout, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, (
            args,
            proc.stderr,
        )


def test_help_shows_descriptions_and_defaults_without_importing_torch():
    code = (
        "import sys, contextlib, io\n"
        "from fusion_bridge.cli.main import main\n"
        "for argv in (['--help'], ['explain', '--help'], ['parity', '--help'], ['--version']):\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        try: main(argv)\n"
        "        except SystemExit: pass\n"
        "    print(repr(out.getvalue()))\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    *outputs, torch_imported = proc.stdout.strip().splitlines()
    top, explain, parity, version = (eval(o) for o in outputs)
    assert torch_imported == "False"
    for command in ("info", "explain", "parity", "tune", "bench", "matrix"):
        assert command in top
    assert (
        "shipped tuning table" in explain
        and "(default: 7168)" in explain
        and "(default: 16)" in explain
    )
    assert "min(8, CPU cores)" in " ".join(parity.split()) and "visible GPU count" in " ".join(
        parity.split()
    )
    import fusion_bridge

    assert version.strip() == f"fusion-bridge {fusion_bridge.__version__}"


def test_console_script_resolves_to_main(tmp_path):
    # from another directory, so the installed metadata is read (not a stale egg-info in the
    # checkout)
    code = (
        "import importlib.metadata as m, fusion_bridge.cli.main as cli\n"
        "(ep,) = m.entry_points(group='console_scripts', name='fusion-bridge')\n"
        "print(ep.value, ep.load() is cli.main)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["fusion_bridge.cli.main:main", "True"]


def test_unknown_env_strategy_is_an_error_naming_the_variable():
    proc = cli("info", check=False, env_vars={"FUSION_BRIDGE_STRATEGY": "bogus"})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "FUSION_BRIDGE_STRATEGY='bogus' is not a strategy" in proc.stderr


def test_info_diagnoses_an_env_strategy_that_cannot_run():
    import torch

    if torch.cuda.is_available():
        pytest.skip("local_fused_nccl can run on a GPU: nothing to diagnose")
    # without TRITON_INTERPRET (the test session sets it), local_fused_nccl cannot run on CPU
    proc = cli(
        "info",
        "--json",
        env_vars={"FUSION_BRIDGE_STRATEGY": "local_fused_nccl", "TRITON_INTERPRET": None},
    )
    doc = json.loads(proc.stdout)
    assert doc["selected"] == "separate"  # built with auto
    req = doc["env_strategy"]
    assert req["variable"] == "FUSION_BRIDGE_STRATEGY" and req["value"] == "local_fused_nccl"
    assert req["available"] is False and [r["code"] for r in req["reasons"]] == [
        "needs_cuda_or_interpreter"
    ]


@needs_flashinfer
def test_explain_previews_the_shipped_h200_table():
    from fusion_bridge import EpilogueSpec
    from fusion_bridge.environment import Environment
    from fusion_bridge.tuning.tables import as_measurements, default_table_path, read_table
    from fusion_bridge.plan.planner import select, static_statuses

    env = Environment(
        device_type="cuda",
        sm=90,
        gpu_name="NVIDIA H200",
        world_size=2,
        triton_version="3.6.0",
        flashinfer_version="0.7.2.post1",
    )
    spec = EpilogueSpec(hidden_size=7168, top_k=8)
    path = default_table_path(spec, env)
    assert path.is_file()
    doc = json.loads(cli("explain", "--gpu", "NVIDIA H200", "--world-size", "2", "--json").stdout)
    assert doc["environment"]["sm"] == 90 and doc["tuning_table"] == str(path)
    assert doc["plan"]["source"] == "measured"
    expected = select(
        static_statuses(spec, env), spec, measured_us=as_measurements(read_table(path))
    )
    assert [b["measured_us"] for b in doc["plan"]["buckets"]] == list(expected.measured_us)
    out = cli("explain", "--gpu", "H200", "--world-size", "4").stdout
    assert "no tuning table ships for NVIDIA H200 TP4 with this spec: static order" in out


def test_parser_choices_match_the_library():
    from fusion_bridge.cli import main
    from fusion_bridge.spec import DTYPE_BY_NAME, QuantKind

    assert sorted(main.DTYPES) == sorted(DTYPE_BY_NAME) and sorted(main.QUANTS) == sorted(
        q.value for q in QuantKind
    )


def test_pytest_config_hides_dependency_deprecations_but_not_ours():
    """The suite's warning filters hide what our dependencies raise (deprecations; numpy's
    arithmetic warnings inside the Triton interpreter) and nothing raised from our modules."""
    import builtins
    import pathlib
    import tomllib
    import warnings

    config = tomllib.loads((pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text())
    filters = config["tool"]["pytest"]["ini_options"]["filterwarnings"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for entry in filters:
            action, message, category, module = (entry.split(":") + ["", "", ""])[:4]
            assert category in ("DeprecationWarning", "RuntimeWarning"), entry
            assert not module.startswith(("fusion_bridge", "tests", "kernels")), entry
            warnings.filterwarnings(action, message, getattr(builtins, category), module)
        for category, message, module in (
            (DeprecationWarning, "x", "flashinfer.fused_moe.x"),
            (DeprecationWarning, "x", "cutlass.utils"),
            (DeprecationWarning, "x", "torch.distributed.x"),
            (DeprecationWarning, "x", "fusion_bridge.bridge"),
            (DeprecationWarning, "x", "tests.test_cli"),
            (RuntimeWarning, "overflow encountered in multiply", "triton.runtime.interpreter"),
            (RuntimeWarning, "overflow encountered in reduce", "numpy._core.fromnumeric"),
            (RuntimeWarning, "overflow encountered in multiply", "fusion_bridge.kernels.quant"),
        ):
            text = f"{category.__name__} from {module}"
            warnings.warn_explicit(f"{message}: {text}", category, "f.py", 1, module=module)
    assert [str(w.message).split(": ")[1] for w in seen] == [
        "DeprecationWarning from fusion_bridge.bridge",
        "DeprecationWarning from tests.test_cli",
        "RuntimeWarning from fusion_bridge.kernels.quant",
    ]


def test_the_cli_package_uses_only_the_public_api():
    """No `obj._private` attribute access and no `_private` import from fusion_bridge in
    fusion_bridge/cli."""
    import ast
    import pathlib

    import fusion_bridge.cli

    offenders = []
    for path in pathlib.Path(fusion_bridge.cli.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                offenders.append(f"{path.name}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                ("fusion_bridge", ".")
            ):
                offenders += [
                    f"{path.name}:{node.lineno} import {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert not offenders, offenders


def test_bench_draws_its_png_with_the_plot_extra(tmp_path):
    # matplotlib comes with the `plot` extra, which the README's setup installs: no silent skip
    from fusion_bridge.cli.bench import plot

    rows = [
        {"candidate": c, "tokens": t, "us_rotated": us * t**0.5, "us_same_inputs": us * t**0.4}
        for c, us in (("auto", 7.0), ("separate:default", 80.0), ("local_fused_nccl:default", 14.0))
        for t in (1, 2, 4, 8)
    ]
    path = plot(rows, str(tmp_path / "bench.png"), "test TP2")
    assert path == str(tmp_path / "bench.png")
    data = (tmp_path / "bench.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_the_measuring_tools_set_the_multicast_variables_in_their_processes_and_say_so(
    monkeypatch, capsys
):
    # tune, bench and parity (on GPUs) call this before anything starts NCCL; spawned ranks set the
    # same variables again (cli/launch.py) before init_process_group
    from fusion_bridge.cli.main import set_multicast_off

    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    set_multicast_off("tune")
    assert [
        os.environ[k]
        for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
    ] == ["0", "1", "1"]
    captured = capsys.readouterr()
    assert not captured.out
    assert captured.err.startswith("tune: every process it starts runs with NCCL_NVLS_ENABLE=0")


@pytest.mark.parametrize("typed", ["H200", "h200", "nvidia h200", "NVIDIA  H200", "Nvidia H200"])
def test_a_known_gpu_name_is_read_in_torchs_spelling(typed):
    """Tuning tables are keyed by the exact device name, so `--gpu h200` must find the H200 table
    (it once showed the static order, silently)."""
    from fusion_bridge.cli.args import _gpu_name

    assert _gpu_name(typed) == "NVIDIA H200"
    assert _gpu_name("nvidia h100 80GB HBM3") == "NVIDIA H100 80GB HBM3"
    assert _gpu_name("gh200") == "NVIDIA GH200"


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`python -m fusion_bridge explain | head -1`: the pipe closes before the report is written;
    the command ends quietly with exit code 0 (it once printed a BrokenPipeError traceback)."""
    cmd = [sys.executable, "-m", "fusion_bridge", "explain", "--gpu", "H200", "--world-size", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
