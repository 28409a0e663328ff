"""benchmarks/hf_end_to_end.py --cpu-smoke: the end-to-end benchmark's whole path (build with the
on-device init, patch with `auto` and `separate`, alternated eager rounds, the CUDA-graph rounds'
plumbing with eager stand-ins, the breakdown, the logits against the bound, the verdict per row,
the CSV and JSON) on a tiny model on CPU, so a GPU run does not fail on plumbing. It measures
nothing. The rule itself (benchmarks/hf_verdict.py) is checked on given numbers, and the deadline
and the JSON's replay without building a model."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import harness  # noqa: E402
from benchmarks.hf_end_to_end import VARIANTS, main  # noqa: E402
from benchmarks.hf_verdict import Results, judge  # noqa: E402
from benchmarks.hf_verdict import main as verdict_main  # noqa: E402


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # --cpu-smoke sets one thread


def test_cpu_smoke_writes_every_variant_the_breakdown_and_a_verdict_per_row(
    tmp_path, capsys, threads
):
    csv, out = tmp_path / "rows.csv", tmp_path / "verdicts.json"
    argv = ["--cpu-smoke", "--family", "qwen3_moe", "--separate", "--csv", str(csv)]
    assert main(argv + ["--json", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = harness.read_rows(str(csv))
    extras = [json.loads(r["extra"]) for r in rows]
    got = sorted({(r["kernel"], int(r["T"]), e["mode"]) for r, e in zip(rows, extras)})
    assert got == sorted((v, t, m) for v in VARIANTS for t in (1, 16) for m in ("eager", "graph"))
    assert all(e["rounds"] == 2 for e in extras), extras  # the smoke's two rounds, both modes
    assert "qwen3_moe H=64 K=4 E=8 L=3 (2 MoE layers)" in printed
    assert "per MoE layer, eager: the fused epilogue saves" in printed
    assert "logits error / bound (<= 1 expected)" in printed
    auto = {(int(r["T"]), e["mode"]): e for r, e in zip(rows, extras) if r["kernel"] == "auto"}
    for key in ("experts_host_us", "bridge_host_us", "rest_us", "logits_err_over_bound_auto"):
        assert key in auto[(16, "eager")], auto[(16, "eager")]
    # each auto row's verdict is the rule applied to the unpatched row's rounds beside it
    verdicts = json.loads(out.read_text())["verdicts"]
    assert len(verdicts) == 4 and all(v["passes"] is not None for v in verdicts), verdicts
    by_row = {(r["kernel"], int(r["T"]), e["mode"]): (r, e) for r, e in zip(rows, extras)}
    for v in verdicts:
        row, extra = by_row[("unpatched", v["tokens"], v["mode"])]
        low, high = extra["spread_us"]
        assert v["unpatched_us"] == pytest.approx(float(row["us_median"]), abs=1e-3)
        assert v["spread"] == pytest.approx((high - low) / v["unpatched_us"], rel=1e-6)
        mine = float(by_row[("auto", v["tokens"], v["mode"])][0]["us_median"])
        assert v["passes"] == (mine <= v["unpatched_us"] * (1 + v["spread"]))
        assert auto[(v["tokens"], v["mode"])]["passes"] == v["passes"]
        assert f"limit 1 + s = {1 + v['spread']:.3f}" in printed
    passing = sum(v["passes"] for v in verdicts)
    assert f"verdict: {passing} of 4 (family, T, mode) rows pass, {4 - passing} miss" in printed


def test_the_rule_is_the_unpatched_spread_around_its_median():
    # unpatched rounds 90, 100, 110: median 100, s = (110 - 90) / 100 = 0.2, limit 120 us
    v = judge("f", 16, "eager", [110.0, 90.0, 100.0], [120.0, 500.0, 1.0])
    assert (v.unpatched_us, v.patched_us, v.passes) == (100.0, 120.0, True)
    assert v.spread == pytest.approx(0.2)
    assert judge("f", 16, "eager", [110.0, 90.0, 100.0], [120.5]).passes is False
    # no spread: the patched median must not exceed the unpatched one
    assert judge("f", 1, "graph", [50.0], [50.0]).passes is True
    assert judge("f", 1, "graph", [50.0], [50.01]).passes is False
    # not judged where the unpatched model has no rounds; a miss where only the patched has none
    assert judge("f", 1, "graph", [], [], "no capture").passes is None
    missed = judge("f", 1, "graph", [50.0], [], "patched auto does not capture")
    assert missed.passes is False and "MISS" in missed.cell()
    with pytest.raises(ValueError, match="mode must be one of"):
        judge("f", 1, "compiled", [1.0], [1.0])
    with pytest.raises(ValueError, match="round times must be > 0 us"):
        judge("f", 1, "eager", [1.0, 0.0], [1.0])


def test_summary_counts_rows_lists_misses_and_survives_the_json(tmp_path, capsys):
    results = Results()
    results.verdicts = [
        judge("a", 1, "eager", [100.0, 110.0], [100.0]),
        judge("a", 1, "graph", [100.0, 100.0], [107.0]),
        judge("b", 1, "graph", [], [], "the unpatched model does not capture: X"),
    ]
    results.shapes, results.skipped = {"a": "H=8"}, {"c": "not in this transformers"}
    summary = results.summary()
    assert (
        summary[0]
        == "verdict: 1 of 2 (family, T, mode) rows pass, 1 miss: a T=1 graph (1.070x > 1.000)"
    )
    assert "not judged: 1: b T=1 graph (the unpatched model does not capture: X)" in summary
    assert "skipped: 1: c (not in this transformers)" in summary
    path = tmp_path / "run.json"
    results.write_json(str(path))
    assert verdict_main([str(path)]) == 0
    printed = capsys.readouterr().out
    assert "| a | H=8 | graph | 1.07 (s 0.00) MISS |" in printed
    assert summary[0] in printed


def test_no_family_starts_after_the_deadline(tmp_path, capsys, threads):
    out = tmp_path / "run.json"
    argv = ["--cpu-smoke", "--family", "olmoe", "mixtral", "--deadline-s", "1e-9"]
    assert main(argv + ["--json", str(out)]) == 0
    assert json.loads(out.read_text())["not_run"] == ["olmoe", "mixtral"]
    assert "not run (deadline): 2: olmoe mixtral" in capsys.readouterr().out


def test_rounds_and_iters_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        main(["--cpu-smoke", "--rounds", "0"])
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err
