"""benchmarks/hf_end_to_end.py --cpu-smoke: the end-to-end benchmark's whole path (build, patch
with `separate` and `auto`, time eager rounds, the eager breakdown, the logits against the bound,
the harness rows) on a tiny model on CPU, so a GPU run does not fail on plumbing. It measures
nothing."""

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import harness  # noqa: E402
from benchmarks.hf_end_to_end import VARIANTS, main  # noqa: E402


def test_cpu_smoke_writes_every_variant_and_the_breakdown(tmp_path, capsys):
    threads = torch.get_num_threads()
    out = tmp_path / "rows.csv"
    try:
        assert main(["--cpu-smoke", "--family", "qwen3_moe", "--csv", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    rows = harness.read_rows(str(out))
    assert sorted({(r["kernel"], int(r["T"])) for r in rows}) == sorted(
        (v, t) for v in VARIANTS for t in (1, 16)
    )
    assert "qwen3_moe H=64 K=4 E=8 L=3" in printed
    assert "per MoE layer, eager: fused epilogue saves" in printed
    assert "logits error / bound (<= 1 expected)" in printed
    auto = [r for r in rows if r["kernel"] == "auto" and r["T"] == "16"][0]
    for key in ("experts_host_us", "bridge_host_us", "rest_us", "logits_err_over_bound"):
        assert key in auto["extra"], auto["extra"]
