"""benchmarks/tp1_hidden_sweep.py's target check (pure: no GPU): each target's bound, computed by
hand here, and a point just over each bound reported as missed."""

import pytest

from benchmarks.tp1_hidden_sweep import HIDDEN_SIZES, check_targets, floor_us


def _by_target(checks):
    return {(c["target"], c["format"], c["H"], c["T"]): c for c in checks}


def test_the_sweep_names_at_least_16_hidden_sizes_off_powers_of_two():
    assert len(HIDDEN_SIZES) >= 16
    assert all(h % 64 == 0 and 1024 <= h <= 8192 for h in HIDDEN_SIZES)
    assert sum(h % 256 != 0 for h in HIDDEN_SIZES) >= 3


def test_the_byte_floor_counts_k_plus_4_rows_and_the_quantized_copy():
    # 12 rows of T*H bf16 at 1000 GB/s: 12 * 2 * 64 * 1024 bytes = 1.572864 us
    assert floor_us(64, 1024, 8, "none", 1000.0) == pytest.approx(1.572864)
    assert floor_us(64, 1024, 8, "fp8", 1000.0) == pytest.approx(1.572864 + 0.065536)


@pytest.mark.parametrize("over", [False, True])
def test_each_target_holds_at_its_bound_and_misses_just_above(over):
    eps = 1e-3 if over else 0.0
    floors = {(2048, 1): 1.0, (2048, 256): 10.0, (2048, 1024): 40.0, (2048, 4096): 1.0}
    times = {
        ("none", 2048, 1): 2.5 + eps,  # T1: 2.5 us
        ("none", 2048, 256): 12.5 + eps,  # max(1.25 * 10, 10 + 2)
        ("none", 2048, 1024): 44.0 + eps,  # max(1.1 * 40, 40 + 2)
        ("none", 2048, 4096): 3.0 + eps,  # max(1.1 * 1, 1 + 2)
        ("nvfp4", 2048, 1): 2.5 + 0.5 + 2 * eps,  # max(1.1 * 2.5(+eps), 2.5(+eps) + 0.5)
        ("fp8", 2048, 1024): 44.0 * 1.1 + 2 * eps,
    }
    checks = _by_target(check_targets(times, floors))
    assert set(checks) == {
        ("T1", "none", 2048, 1),
        ("floor_T256", "none", 2048, 256),
        ("floor_large_T", "none", 2048, 1024),
        ("floor_large_T", "none", 2048, 4096),
        ("quant_cost", "nvfp4", 2048, 1),
        ("quant_cost", "fp8", 2048, 1024),
    }
    assert all(c["ok"] is (not over) for c in checks.values()), checks
