"""`fused_tp1`'s measured launch table (kernels/tp1/launch_table.py): it is what its sweep CSVs
give, and `tp1_config` follows it, with the fallbacks a GPU or an output format needs."""

from __future__ import annotations

import os
import re

import pytest

from benchmarks import tp1_launch_table
from fusion_bridge.kernels.quant import row_block
from fusion_bridge.kernels.quant_codes import (
    QUANT_FP8,
    QUANT_FP8_GROUP,
    QUANT_FP8_TOKEN,
    QUANT_NONE,
    QUANT_NVFP4,
)
from fusion_bridge.kernels.tp1 import launch_table
from fusion_bridge.kernels.tp1.configs import TP1_PDL, Tp1Config, measured, tp1_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H100_SMS = 132
FORMATS = {"none": (QUANT_NONE, False), "fp8": (QUANT_FP8, False), "nvfp4": (QUANT_NVFP4, True)}
SWEPT_TOKENS = [64, 256, 1024, 4096]  # the sweep behind the table (benchmarks/results/...large_t_*)


def _sources() -> list:
    return re.findall(r"^    (benchmarks/results/\S+\.csv)$", launch_table.__doc__, re.M)


def test_the_table_is_what_its_sweep_csvs_give(capsys):
    """The generator, run over the CSVs the module names, reproduces the module byte for byte:
    a hand edit of an entry (or a CSV changed without regenerating) fails here."""
    sources = _sources()
    assert sources, "the module names no CSV"
    paths = [os.path.join(ROOT, p) for p in sources]
    assert tp1_launch_table.main([*paths, "--check"]) == 0, capsys.readouterr().out


def test_the_table_covers_every_format_at_the_hidden_sizes_and_tokens_swept():
    """Each swept format has the same hidden sizes (13 of them, from 1024 to 8192), each at every
    T swept; linear NVFP4 was not swept: the rule decides it, as below the smallest T."""
    assert sorted(launch_table.TABLE) == sorted(FORMATS)
    hidden = sorted(launch_table.TABLE["none"])
    assert len(hidden) >= 13 and hidden[0] == 1024 and hidden[-1] == 8192
    for fmt in FORMATS:
        by_hidden = launch_table.TABLE[fmt]
        assert sorted(by_hidden) == hidden, fmt
        for h, by_tokens in by_hidden.items():
            assert sorted(by_tokens) == SWEPT_TOKENS, (fmt, h)
    assert measured(256, 7168, "nvfp4_linear") is None
    assert measured(63, 7168, "none") is None and measured(64, 7168, "none") is not None


def test_below_the_table_the_rule_splits_rows_as_before():
    """T=1 and T=16 at H=7168 on an H100's SMs: the split rule (512 columns with the L2 prefetch
    at T=1; 1024 columns from T=2), untouched by the table."""
    assert tp1_config(1, 7168, QUANT_NONE, H100_SMS) == Tp1Config(512, 4, 1, TP1_PDL)
    assert tp1_config(16, 7168, QUANT_NONE, H100_SMS) == Tp1Config(1024, 4, 0, TP1_PDL)


def test_a_measured_point_is_launched_as_measured():
    """H=1024, T=256, unquantized: whole rows of 8 warps (the rule before the table gave 4; the
    sweep timed 4 warps at 6.05 us and 8 at 3.56 us on one H200)."""
    assert tp1_config(256, 1024, QUANT_NONE, H100_SMS) == Tp1Config(1024, 8, 0, TP1_PDL)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tp1_config_takes_each_entry_or_its_whole_row_fallback(fmt):
    """At every measured point on an H100's SM count: the entry's fastest config when it is whole
    rows or a split that is resident; else whole rows at the entry's whole-row warps (also for
    swizzled NVFP4 at H not a multiple of 128, which never splits)."""
    quant, swizzled = FORMATS[fmt]
    from fusion_bridge.kernels.tp1.configs import split_ok

    for hidden, by_tokens in launch_table.TABLE[fmt].items():
        rb = row_block(hidden)
        for tokens, ((columns, warps, prefetch), whole_warps) in by_tokens.items():
            got = tp1_config(tokens, hidden, quant, H100_SMS, swizzled=swizzled)
            fastest = Tp1Config(columns, warps, prefetch, TP1_PDL)
            whole_only = swizzled and hidden % 128 != 0
            split = columns < rb
            if not split or (split_ok(fastest, tokens, hidden, H100_SMS) and not whole_only):
                assert got == fastest, (fmt, hidden, tokens, got)
            else:
                assert got == Tp1Config(rb, whole_warps, 0, TP1_PDL), (fmt, hidden, tokens, got)


def test_without_resident_sms_a_split_entry_falls_back_to_whole_rows():
    """No SM count (a CPU launcher, where split rows never run): whole rows at the entry's
    measured whole-row warps, never a split that could not have all its programs resident (its
    in-launch exchange would wait forever)."""
    for fmt, (quant, swizzled) in FORMATS.items():
        for hidden, by_tokens in launch_table.TABLE[fmt].items():
            for tokens, ((columns, warps, prefetch), whole_warps) in by_tokens.items():
                got = tp1_config(tokens, hidden, quant, 0, swizzled=swizzled)
                if columns < row_block(hidden):
                    assert got == Tp1Config(row_block(hidden), whole_warps, 0, TP1_PDL)
                else:
                    assert got == Tp1Config(columns, warps, prefetch, TP1_PDL)


def test_dynamic_fp8_reads_the_fp8_rows_and_splits_only_where_its_groups_allow():
    """Per-token-group and per-token FP8 read the static FP8 rows (not measured apart); a split
    entry serves them only where `dynamic_splits` allows (chunks of whole groups)."""
    from fusion_bridge.kernels.tp1.configs import dynamic_splits

    for hidden, by_tokens in launch_table.TABLE["fp8"].items():
        for tokens, (_, whole_warps) in by_tokens.items():
            static = tp1_config(tokens, hidden, QUANT_FP8, H100_SMS)
            for quant, group in ((QUANT_FP8_GROUP, 128), (QUANT_FP8_TOKEN, hidden)):
                got = tp1_config(tokens, hidden, quant, H100_SMS, group=group)
                split = static.columns < row_block(hidden)
                if split and not dynamic_splits(quant, group, static.columns):
                    assert got == Tp1Config(row_block(hidden), whole_warps, 0, TP1_PDL)
                else:
                    assert got == static, (hidden, tokens, quant, got)


def test_measured_finds_the_nearest_hidden_size_of_the_row_block_and_the_nearest_t():
    by_hidden = launch_table.TABLE["none"]
    assert measured(64, 1280, "none") == by_hidden[1344][64]  # rb 2048: 1344 is nearest
    # rb 8192, not 4096's rb 4096 (the two entries differ at T=256)
    assert by_hidden[4160][256] != by_hidden[4096][256]
    assert measured(256, 4100, "none") == by_hidden[4160][256]
    assert measured(256, 4096, "none") == by_hidden[4096][256]
    tokens = sorted(by_hidden[7168])
    for low, high in zip(tokens, tokens[1:]):
        geometric = int((low * high) ** 0.5)
        assert measured(max(low, geometric - 1), 7168, "none") == by_hidden[7168][low]
        assert measured(min(high, geometric + 2), 7168, "none") == by_hidden[7168][high]
    assert measured(1 << 20, 7168, "none") == by_hidden[7168][tokens[-1]]
    assert measured(8, 512, "none") is None  # no measured H of row block 512: the rule decides
    assert measured(8, 7168, "mxfp8") is None
