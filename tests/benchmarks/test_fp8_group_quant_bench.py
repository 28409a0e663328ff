"""benchmarks/fp8_group_quant.py's pure parts (no GPU): each target's bound computed by hand, a
point just past each bound reported as missed, a check that lacks a value left out; the hidden
sizes a format admits; the standalone kernel's byte count."""

import pytest

from benchmarks.fp8_group_quant import (
    FORMATS,
    HIDDEN_SIZES,
    QUICK,
    TOKENS,
    admits,
    check_targets,
    standalone_bytes,
)


def test_the_sweep_covers_the_issues_points():
    assert TOKENS == (1, 16, 64, 256, 1024, 4096)
    assert {2048, 4096, 5120, 7168} <= set(HIDDEN_SIZES) and 2880 in HIDDEN_SIZES
    assert set(QUICK["formats"]) <= set(FORMATS) and set(QUICK["hidden"]) <= set(HIDDEN_SIZES)


def test_2880_is_skipped_with_its_reason_for_the_group_formats_only():
    reason = admits(2880, "group_row", 128)
    assert "2880 % 128 = 64" in reason
    assert admits(2880, "token", 128) is None and admits(2880, "none", 128) is None
    assert all(admits(h, "group_tma", 128) is None for h in (2048, 4096, 5120, 7168))


def test_standalone_bytes_count_codes_scales_and_the_tma_padding():
    # T=3, H=256, groups of 128: 3*256*(2+1) bytes, scales 3x2 (TMA: 4x2) of 4 bytes
    assert standalone_bytes(3, 256, "group_row", 128) == 2304 + 24
    assert standalone_bytes(3, 256, "group_tma", 128) == 2304 + 32
    assert standalone_bytes(3, 256, "token", 128) == 2304 + 12


@pytest.mark.parametrize("over", [False, True])
def test_each_target_holds_at_its_bound_and_misses_just_past_it(over):
    eps = 1e-3 if over else 0.0
    copy = 3000.0
    points = {
        ("fused", "none", 4096, 1): 4.0,
        ("fused", "group_row", 4096, 1): 4.5 + eps,  # max(1.1 * 4, 4 + 0.5)
        ("fused", "none", 4096, 4096): 100.0,
        ("fused", "token", 4096, 4096): 110.0 + eps,  # max(1.1 * 100, 100.5)
        ("pair", "token", 4096, 4096): 130.0,
        ("standalone", "token", 4096, 4096): 20.0,  # vs_pair: 130 - 0.8 * 20 = 114
        ("standalone_gbs", "token", 4096, 4096): 2400.0 - eps,  # 0.8 * 3000
        ("standalone_gbs", "token", 4096, 256): 100.0,  # below T = 1024: no bandwidth target
        ("pair", "group_row", 4096, 1): 9.0,  # no standalone time: no vs_pair check
    }
    checks = {(c["target"], c["format"], c["T"]): c for c in check_targets(points, copy)}
    assert set(checks) == {
        ("quant_cost", "group_row", 1),
        ("quant_cost", "token", 4096),
        ("vs_pair", "token", 4096),
        ("bandwidth", "token", 4096),
    }
    assert checks[("vs_pair", "token", 4096)]["bound"] == pytest.approx(114.0)
    assert checks[("vs_pair", "token", 4096)]["ok"]  # 110 is well inside
    for key in (("quant_cost", "group_row", 1), ("quant_cost", "token", 4096)):
        assert checks[key]["ok"] is (not over), checks[key]
    assert checks[("bandwidth", "token", 4096)]["ok"] is (not over)
