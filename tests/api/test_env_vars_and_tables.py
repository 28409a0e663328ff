"""Issue 22, what one rank can check alone: the FUSION_BRIDGE_* variables (one module, validated at
build, never read at import), tuning tables from disk (never raise), and the bridge's own arguments
(device, measured_us). One process: no group needed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fusion_bridge import EpilogueSpec, FusionBridge, env_vars
from fusion_bridge.tuning import format as table_format
from fusion_bridge.env_vars import EnvVarError
from fusion_bridge.tuning.tables import read_table
from tests.helpers import run_cli

SPEC = EpilogueSpec(hidden_size=64, top_k=2, max_tokens=8)
README = Path(__file__).resolve().parents[2] / "README.md"


def _build(**kwargs):
    return FusionBridge(SPEC, device="cpu", self_test=False, tuning="off", **kwargs)


# ---------------------------------------------------------------- environment variables
BAD_VALUES = {
    "FUSION_BRIDGE_DEBUG": ["disabled", "2", "yes please"],
    "FUSION_BRIDGE_SELF_TEST": ["maybe"],
    "FUSION_BRIDGE_LAUNCH_CACHE": ["nope"],
    "FUSION_BRIDGE_BUILD_TIMEOUT_S": ["soon", "0", "-1", "nan", "inf", "1e20", "0.0004"],
    "FUSION_BRIDGE_SYMM_TIMEOUT_S": ["garbage", "0", "-1", "nan", "inf", "1e20"],
    "FUSION_BRIDGE_LOG_LEVEL": ["loud", "99"],
    "FUSION_BRIDGE_EXCLUDE": ["separate;reference"],
}


@pytest.mark.parametrize("name, raw", [(n, v) for n, values in BAD_VALUES.items() for v in values])
def test_a_malformed_variable_fails_the_build_naming_it(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(EnvVarError, match=re.escape(f"environment variable {name} must be")) as e:
        _build()
    assert e.value.name == name and repr(raw) in str(e.value)


def test_an_unknown_variable_is_a_typo_and_fails_the_build(monkeypatch):
    monkeypatch.setenv("FUSION_BRIDGE_DEBG", "1")
    with pytest.raises(EnvVarError, match="unknown environment variable FUSION_BRIDGE_DEBG") as e:
        _build()
    assert "did you mean FUSION_BRIDGE_DEBUG?" in str(e.value)


def test_good_values_parse_to_what_they_say(monkeypatch):
    cases = {
        "FUSION_BRIDGE_DEBUG": ("Off", False),
        "FUSION_BRIDGE_SELF_TEST": ("TRUE", True),
        "FUSION_BRIDGE_BUILD_TIMEOUT_S": ("0.0015", 0.002),  # whole milliseconds, rounded up
        "FUSION_BRIDGE_SYMM_TIMEOUT_S": ("2", 2.0),
        "FUSION_BRIDGE_LOG_LEVEL": ("info", 20),
        "FUSION_BRIDGE_EXCLUDE": (" separate , reference", ("separate", "reference")),
    }
    for name, (raw, parsed) in cases.items():
        monkeypatch.setenv(name, raw)
        assert env_vars.read(name) == parsed, name
    monkeypatch.setenv("FUSION_BRIDGE_DEBUG", "  ")  # blank: the default
    assert env_vars.read("FUSION_BRIDGE_DEBUG") is False


def test_no_variable_is_read_at_import():
    """Importing the package with every variable malformed must work (the build reports them)."""
    env = {k: "garbage" for k in env_vars.VARIABLES}
    code = "import fusion_bridge, fusion_bridge.bridge, fusion_bridge.strategies.symm_fused_oneshot"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**__import__("os").environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_readme_table_is_the_module_table():
    text = README.read_text()
    block = text.split("<!-- env:begin -->\n", 1)[1].split("\n<!-- env:end -->", 1)[0]
    assert block == env_vars.markdown_table()
    for name in env_vars.VARIABLES:  # and nothing else reads them
        assert f"`{name}`" in block


# ---------------------------------------------------------------- the bridge's own arguments
def test_a_cuda_device_on_a_machine_without_one_is_named():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(ValueError, match="device must be one this process can use, got 'cuda'"):
        FusionBridge(SPEC, device="cuda")


@pytest.mark.parametrize(
    "measured, why",
    [
        ({"separate": {"default": {3: 5.0}}}, "has bucket '3', not a power of two"),
        ({"separate": {"default": {1: -5.0}}}, "not a number of microseconds in [0.5, 1e+07]"),
        ({"separate": {"default": {1: float("nan")}}}, "not a number of microseconds"),
        ({"separate": [1, 2]}, "is not {variant: {bucket: us}}"),
        ("fast", "is not a dict"),
    ],
)
def test_malformed_measurements_are_refused_before_the_build(measured, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        _build(measured_us=measured)
    with pytest.raises(ValueError, match="eager_us"):
        _build(eager_us=measured)


# ---------------------------------------------------------------- tables from disk
GOOD = {
    "schema_version": table_format.SCHEMA_VERSION,
    "gpu": "NVIDIA H200",
    "world_size": 1,
    "spec": {"hidden_size": 64},
    "measured_us": {"separate": {"default": {"1": 5.0, "2": 6.0}}},
}


def _variant(**changes):
    table = json.loads(json.dumps(GOOD))
    for path, value in changes.items():
        *keys, last = path.split("/")
        node = table
        for k in keys:
            node = node[k]
        node[last] = value
    return table


HOSTILE = {
    "superscript bucket": (_variant(**{"measured_us/separate/default": {"²": 5.0}}), "bucket"),
    "5000-digit bucket": (
        _variant(**{"measured_us/separate/default": {"9" * 5000: 5.0}}),
        "bucket",
    ),
    "arabic-indic digits": (_variant(**{"measured_us/separate/default": {"٤": 5.0}}), "bucket"),
    "negative time": (_variant(**{"measured_us/separate/default": {"1": -1.0}}), "microseconds"),
    "zero time": (_variant(**{"measured_us/separate/default": {"1": 0}}), "microseconds"),
    "another gpu": (_variant(gpu="NVIDIA B200"), "measured for gpu="),
    "another world size": (_variant(world_size=8), "measured for world_size="),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_table_is_ignored_with_a_warning_naming_the_file(tmp_path, case):
    table, why = HOSTILE[case]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    expect = {"gpu": "NVIDIA H200", "world_size": 1, "spec": {"hidden_size": 64}}
    with pytest.warns(UserWarning, match=re.escape(str(path))) as record:
        assert read_table(path, expect) is None
    assert why in str(record[0].message), str(record[0].message)


def test_text_level_hostility_never_raises(tmp_path):
    expect = {"gpu": "NVIDIA H200", "world_size": 1, "spec": {"hidden_size": 64}}
    good = json.dumps(GOOD)
    texts = {
        "400-digit time": good.replace("5.0", "1" * 400),
        "NaN time": good.replace("5.0", "NaN"),
        "Infinity time": good.replace("5.0", "Infinity"),
        "nested 100000 deep": "[" * 100000 + "]" * 100000,
        "not utf-8": None,
    }
    for name, text in texts.items():
        path = tmp_path / f"{len(name)}.json"
        if text is None:
            path.write_bytes(b"\xff\xfe{")
        else:
            path.write_text(text)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert read_table(path, expect) is None, name
        assert record and str(path) in str(record[0].message), name
    big = tmp_path / "huge.json"
    with open(big, "wb") as f:  # 300 MB, sparse: never read
        f.truncate(300 << 20)
    with pytest.warns(UserWarning, match="bytes > "):
        assert read_table(big, expect) is None
    path = tmp_path / "ok.json"
    path.write_text(good)
    assert read_table(path, expect)["measured_us"] == GOOD["measured_us"]


def test_the_nesting_check_reads_escapes_inside_strings(tmp_path):
    """A string holding an escaped quote and brackets is text: a valid table with one is read (it
    was refused as "nested 14 deep" when the check did not honour the escape). A string ending in a
    backslash still ends at its quote: a list nested past MAX_NESTING after it is refused."""
    expect = {"gpu": "NVIDIA H200", "world_size": 1, "spec": {"hidden_size": 64}}
    note = 'he typed "[[[[[[[[[[[[{{{{ by mistake'
    path = tmp_path / "escaped.json"
    path.write_text(json.dumps(dict(GOOD, note=note, folder="C:\\")))
    assert read_table(path, expect)["note"] == note
    deep = [[[[[[[[[]]]]]]]]]  # 9 lists inside the table's object: 10 deep
    path = tmp_path / "deep.json"
    path.write_text(json.dumps(dict(GOOD, folder="C:\\", extra=deep)))
    with pytest.warns(UserWarning, match="nested 10 deep"):
        assert read_table(path, expect) is None


@pytest.mark.parametrize(
    "args, why",
    [
        (["--seed", "1e29"], "argument --seed: expected a seed (an integer), got '1e29'"),
        (["--seed", str(10**29)], "argument --seed: must be in 0..9223372036854775807"),
        (["--tokens", "200000"], "argument --tokens: must be in 1..16384, got 200000"),
    ],
)
def test_parity_refuses_values_it_cannot_use_before_any_work(args, why):
    # the CLI in this process (tests.helpers.run_cli): a parser error, nothing run
    proc = run_cli("parity", *args)
    assert proc.returncode == 2 and why in proc.stderr, proc.stderr[-1000:]


def test_every_cli_command_names_a_malformed_variable_in_one_line():
    proc = run_cli("info", env_vars={"FUSION_BRIDGE_SYMM_TIMEOUT_S": "garbage"})
    assert proc.returncode == 2, proc.stderr[-1000:]
    assert proc.stderr.strip().splitlines() == [
        "error: environment variable FUSION_BRIDGE_SYMM_TIMEOUT_S must be a number of seconds in "
        "[0.001, 86400] in ASCII digits, got 'garbage'"
    ]
