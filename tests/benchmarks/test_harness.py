"""benchmarks/harness.py: the rows the scripts write have the schema's columns, the run-wide ones
filled once, and a file in another schema is refused where rows are merged (floor.py --merge)."""

import csv
import json

import pytest

from benchmarks import harness


def test_rows_are_written_in_the_schema_with_the_run_wide_columns(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    harness.commit.cache_clear()
    rows = harness.Rows()
    rows.add("hbm_copy", "hardware", "1 GiB", 0, None, gbs=4278.3)
    rows.add("fused_tp1", "fusion_bridge", "H=7168 K=8 none", 16, 3.4821, floor_us=0.66)
    rows.add("failed_path", "flashinfer", "H=7168 K=8 W=2", 1, float("nan"))
    path = tmp_path / "out" / "x.csv"
    rows.write(str(path))
    with open(path, newline="") as f:
        got = list(csv.DictReader(f))
    assert tuple(got[0]) == harness.FIELDS
    assert [r["kernel"] for r in got] == ["hbm_copy", "fused_tp1", "failed_path"]
    assert got[1]["T"] == "16" and got[1]["us_median"] == "3.482" and got[1]["us_p20"] == ""
    assert got[2]["us_median"] == "nan"
    assert json.loads(got[0]["extra"]) == {"gbs": 4278.3} and got[2]["extra"] == ""
    assert {r["commit"] for r in got} == {"abc1234"}
    assert {r["gpu"] for r in got} == {harness.gpu_name()}
    assert "torch=" in got[0]["versions"]
    assert harness.read_rows(str(path)) == got
    harness.commit.cache_clear()


def test_a_file_in_another_schema_is_refused(tmp_path):
    old = tmp_path / "old.csv"
    old.write_text("path,H,K,T,us,floor_us,x_floor\npeer_copy_gbs,0,0,0,389.2,0,0\n")
    with pytest.raises(ValueError, match="not benchmarks/harness.py's"):
        harness.read_rows(str(old))


def test_the_common_options():
    ap = harness.add_common(harness.parser("doc"), tokens=[1, 16], hidden=[7168], top_k=8)
    args = ap.parse_args(["--tokens", "4", "--csv", "x.csv"])
    assert (args.tokens, args.hidden, args.top_k, args.csv) == ([4], [7168], 8, "x.csv")
    quant = harness.add_common(harness.parser("doc"), quant=["none"], csv=False)
    assert quant.parse_args(["--quant", "fp8", "nvfp4"]).quant == ["fp8", "nvfp4"]
    with pytest.raises(SystemExit):
        quant.parse_args(["--quant", "int4"])
