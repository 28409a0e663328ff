"""The rejected ticket-pipeline probe (`benchmarks/ticket_pipeline_local.py`) computes the epilogue
at world size 1: its kernel under TRITON_INTERPRET=1 against the float64 oracle, so the measured
times in benchmarks/results/ticket_pipeline_local_h200_v*_rejected.csv are times of a correct
computation. The interpreter runs one program at a time: program 0 takes every ticket in order,
so every wait is met by an earlier item (the GPU's interleavings are the probe's own check)."""

import importlib.util
import math
import pathlib

import pytest
import torch

from fusion_bridge.oracle.numerics import rel_err
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.strategies.base import UNIT_ROUNDOFF
from fusion_bridge.oracle.synthetic import make_inputs

from tests.oracle64 import epilogue64_from

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter run; the probe checks itself on a GPU"
)
U = UNIT_ROUNDOFF[torch.bfloat16]
_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "ticket_pipeline_local.py"
_spec = importlib.util.spec_from_file_location("ticket_pipeline_local", _PATH)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)

# small chunks so T = 13 spans several chunks and turns the slot ring; (chunk, slots, lag,
# programs per SM, warps, L2 hints, finalize item columns (0 whole rows, -1 whole rows with the
# routing prefetch, top-k 8 only), rows per row item)
SHAPES = {
    "v1_whole_rows": (4, 3, 1, 2, 4, 1, 0, 1),
    "v2_row_segments": (3, 3, 2, 2, 4, 0, 64, 1),
    "v3_prefetch": (4, 3, 1, 2, 4, 1, -1, 1),
    "v4_two_rows_per_item": (4, 3, 1, 2, 4, 1, -1, 2),
    "v4_four_rows_lag2": (8, 3, 2, 2, 4, 1, -1, 4),
}


CASES = [(1, 96, 8), (13, 200, 8), (6, 96, 1)]  # T = 1; odd T, H not a power of two; K = 1


@pytest.mark.parametrize(
    "shape,tokens,hidden,top_k",
    [
        (shape, *case)
        for shape in SHAPES
        for case in CASES
        if case[2] == 8 or SHAPES[shape][6] >= 0  # the routing prefetch is written for top-k 8
    ],
)
def test_probe_matches_the_float64_oracle(shape, tokens, hidden, top_k):
    probe.VARIANTS[shape] = SHAPES[shape]
    spec = EpilogueSpec(hidden_size=hidden, top_k=top_k, routed_scaling_factor=2.5)
    inp = make_inputs(spec, tokens, seed=tokens + hidden, skip_fraction=0.3)
    slot, ctr = probe.buffers(shape, tokens, hidden, spec.dtype, "cpu")
    res_out = torch.full_like(inp.residual, float("nan"))
    norm_out = torch.full_like(inp.residual, float("nan"))
    probe.launch(shape, inp, slot, ctr, res_out, norm_out, spec)
    x64, norm64 = epilogue64_from(spec, [inp])
    # residual_out: two roundings (the partial in the slot, residual_out); norm_out: the partial's
    # and its own (the probe norms the unrounded sum, as our add+RMSNorm does)
    assert rel_err(res_out, x64) <= math.sqrt(2) * U
    assert rel_err(norm_out, norm64) <= math.sqrt(2) * U
    # every chunk's items all arrived and were all read
    chunk = SHAPES[shape][0]
    n_chunks = -(-tokens // chunk)
    rows = [min(chunk, tokens - c * chunk) for c in range(n_chunks)]
    n_seg = 1 if SHAPES[shape][6] <= 0 else -(-hidden // SHAPES[shape][6])
    assert ctr[1 : 1 + n_chunks].tolist() == [r * n_seg for r in rows]
    assert ctr[1 + n_chunks :].tolist() == rows


def test_probe_with_no_tokens_launches_nothing():
    spec = EpilogueSpec(hidden_size=96, top_k=8, routed_scaling_factor=2.5)
    inp = make_inputs(spec, 0)
    slot, ctr = probe.buffers("c128_s4_l1_p4_w8", 0, 96, spec.dtype, "cpu")
    outputs = (torch.empty_like(inp.residual), torch.empty_like(inp.residual))
    assert probe.launch("c128_s4_l1_p4_w8", inp, slot, ctr, *outputs, spec) is None
