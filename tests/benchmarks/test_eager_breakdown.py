"""benchmarks/eager_breakdown.py and eager_cost.py's issue-50 parts without a GPU: the CPU
breakdown runs end to end (the host stages, the out= path's check, the whole calls with the
launcher a no-op), each `unattributed*` row is its whole call less exactly the stages of its own
path, and the target line reports the allocating call's and the out= call's ratio to the anchor."""

from __future__ import annotations

import pytest

from benchmarks import eager_breakdown as eb


@pytest.fixture(scope="module")
def rows() -> dict:
    """{(quant, T, stage): us} of a short CPU breakdown planned as on 132 SMs (split rows)."""
    got = eb.breakdown(["none", "nvfp4"], [1], calls=2, rounds=1, device_type="cpu", sms=132)
    return {(r["quant"], r["tokens"], r["stage"]): r["us"] for r in got}


@pytest.mark.parametrize("quant", ["none", "nvfp4"])
def test_the_cpu_breakdown_times_both_paths_and_no_launch(rows, quant):
    timed = {stage for (q, _, stage), us in rows.items() if q == quant and us is not None}
    assert {"validation", "out_check", "output_allocation", "records", "split_sync"} <= timed
    assert set(eb.NO_LAUNCH) <= timed
    assert {"unattributed_no_launch", "unattributed_out_no_launch"} <= timed
    for stage in ("launch", "strategy_run", "finalize_epilogue", "finalize_epilogue_out"):
        assert rows[(quant, 1, stage)] is None  # launches: GPU only


@pytest.mark.parametrize("quant", ["none", "nvfp4"])
def test_each_unattributed_row_is_its_call_less_its_own_paths_stages(rows, quant):
    def stage(name):
        return rows[(quant, 1, name)]

    before = sum(stage(s) for s in eb.BEFORE_LAUNCHER)
    allocating = stage("finalize_epilogue_no_launch") - before - stage("output_allocation")
    with_out = stage("finalize_epilogue_out_no_launch") - before - stage("out_check")
    # the same sums in the same order: equal up to float rounding of a few additions
    assert stage("unattributed_no_launch") == pytest.approx(allocating, abs=1e-9)
    assert stage("unattributed_out_no_launch") == pytest.approx(with_out, abs=1e-9)


def test_the_cpu_main_prints_every_stage(capsys):
    assert eb.main(["--device", "cpu", "--tokens", "1", "--quant", "none", "--calls", "2",
                    "--rounds", "1"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    for stage in ("out_check", "finalize_epilogue_out_no_launch", "unattributed_out_no_launch"):
        assert stage in printed


def test_the_target_line_reports_both_ratios():
    import benchmarks.eager_cost as bench

    def rows(quant, tokens, call, call_out, anchor):
        base = dict(world_size=1, quant=quant, tokens=tokens, us_host=0.0)
        return [
            dict(base, item="finalize_epilogue", us_wall=call),
            dict(base, item="finalize_epilogue_out", us_wall=call_out),
            dict(base, item="fused_tp1_kernel_cached", us_wall=anchor),
        ]

    got = rows("none", 1, 30.0, 20.0, 10.0) + rows("nvfp4", 64, 40.0, 25.0, 10.0)
    assert eb.target_check(bench.ratios(got)) == [
        "target TP1 none T=1: finalize_epilogue / fused_tp1_kernel_cached = 3.00 (<= 2): miss; "
        "finalize_epilogue_out (out=) / fused_tp1_kernel_cached = 2.00: pass",
        "target TP1 nvfp4 T=64: finalize_epilogue / fused_tp1_kernel_cached = 4.00 (<= 2): miss; "
        "finalize_epilogue_out (out=) / fused_tp1_kernel_cached = 2.50: miss",
    ]
    assert "finalize_epilogue_out" in bench.ITEMS
