"""The migration guide's "before" snippet (migration/README.md, section 1) computes the finalize
the bridge replaces: its lines from `rows = ...` to `routed = ...` run here on an index map with
-1 slots (and a NaN in the last row of gemm2_out, which a -1 read as a Python index would reach)
and agree with the fp32 oracle."""

import re
from pathlib import Path

import torch

from fusion_bridge import EpilogueSpec
from fusion_bridge.oracle.synthetic import make_inputs
from fusion_bridge.oracle.torch_math import finalize_fp32

GUIDE = Path(__file__).resolve().parents[2] / "migration" / "README.md"


def _finalize_lines() -> str:
    before = GUIDE.read_text().split("Before, the end of the MoE layer")[1]
    block = re.search(r"```python\n(.*?)```", before, re.S).group(1)
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("rows = "))
    end = next(i for i, line in enumerate(lines) if line.startswith("routed = "))
    return "\n".join(lines[start : end + 1])


def test_the_before_snippet_skips_minus_one_slots():
    spec = EpilogueSpec(hidden_size=64, top_k=4, routed_scaling_factor=2.5)
    inputs = make_inputs(spec, 6, seed=2)
    perm = inputs.expanded_idx_to_permuted_idx.clone()
    perm[::2, -1] = -1
    gemm2_out = inputs.gemm2_out.clone()
    gemm2_out[-1] = float("nan")  # never referenced by a valid slot
    assert not (perm == gemm2_out.shape[0] - 1).any()
    scope = {
        "torch": torch,
        "gemm2_out": gemm2_out,
        "perm": perm,
        "weights": inputs.expert_weights,
        "routed_scaling": spec.routed_scaling_factor,
    }
    exec(_finalize_lines(), scope)
    expected = finalize_fp32(gemm2_out, perm, inputs.expert_weights, spec.routed_scaling_factor)
    # both sum K fp32 products in fp32, in other orders: a few ulps (2^-23 each) apart at most
    assert torch.allclose(scope["routed"], expected, rtol=1e-6, atol=1e-6)
