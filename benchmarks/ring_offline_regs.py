"""The ring kernel's (`kernels/symm_ring.py`) register footprint for the H200 (sm_90), compiled on a
machine without a GPU: per launch shape (benchmarks/ring_local.py's SWEEP labels), world size,
quantization and H, the registers per thread, spills, stack and the programs one SM holds
(`symm_ring.resident_per_sm`: registers, warps), as the production launch specializes it.

    cd <tree> && PYTHONPATH=$PWD python benchmarks/ring_offline_regs.py [--variants LABEL...]
        [--worlds 1 2 8] [--quants none fp8 nvfp4] [--hidden 7168 4096] [--csv PATH]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from offline_sass import BIN, compile_for_sm90  # noqa: E402
from ring_local import SWEEP  # noqa: E402

from fusion_bridge.cli.bench import write_csv  # noqa: E402


def _usage(compiled) -> tuple[int, int, int]:
    """(registers, stack bytes, spill instructions) of a compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run(
            [f"{BIN}/cuobjdump", "--dump-resource-usage", path],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        sass = subprocess.run(
            [f"{BIN}/nvdisasm", "-c", path], capture_output=True, text=True, check=True
        ).stdout
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    spills = len(re.findall(r"\b(?:STL|LDL)(?:\.\d+)?\b", sass))
    return int(regs[1]), int(regs[2]), spills


def compile_case(shape, world: int, quant: str, hidden: int):
    import torch

    from fusion_bridge.kernels import symm_ring
    from fusion_bridge.kernels.symm_testing import EmulatedRing, _ring_layer
    from fusion_bridge.spec import EpilogueSpec, QuantSpec, SFLayout
    from fusion_bridge.strategies.base import kernel_quant_args
    from fusion_bridge.synthetic import make_inputs

    quants = {
        "none": QuantSpec.none(),
        "fp8": QuantSpec.fp8(0.02),
        "nvfp4": QuantSpec.nvfp4(448 * 6 / 8.0, SFLayout.SWIZZLED_128x4),
    }
    spec = EpilogueSpec(hidden_size=hidden, top_k=8, routed_scaling_factor=2.5, quant=quants[quant])
    tokens = 256
    emu = EmulatedRing(world, 4, 64)  # pointers only: the kernel is compiled, not run
    layer = _ring_layer(
        emu.ptrs[0], emu.states[0], world, 0, 132, 1000, hidden,
        (spec.routed_scaling_factor, spec.eps, spec.weight_bias), kernel_quant_args(spec),
    )  # fmt: skip
    inp = make_inputs(spec, tokens, seed=0, device="cpu", skip_fraction=0.0)
    from fusion_bridge.epilogue_tensors import quant_buffers

    q, sf = quant_buffers(tokens, hidden, spec.quant.kind, spec.quant.sf_layout, "cpu")
    empty = torch.empty(0, dtype=torch.uint8)
    args, constexprs = symm_ring.call_args(
        layer, shape, residual_out=torch.empty_like(inp.residual),
        norm_out=torch.empty_like(inp.residual),
        q=empty if q is None else q.view(torch.uint8), sf=empty if sf is None else sf,
        gemm2_out=inp.gemm2_out, perm=inp.expanded_idx_to_permuted_idx,
        weights=inp.expert_weights, shared=inp.shared_output, residual=inp.residual,
        gamma=inp.gamma,
    )  # fmt: skip
    compiled = compile_for_sm90(symm_ring._ring_kernel, args, dict(constexprs, **shape.options()))
    regs, stack, spills = _usage(compiled)
    per_sm = symm_ring.resident_per_sm(SimpleNamespace(n_regs=regs, metadata=compiled.metadata),
                                       shape.warps)  # fmt: skip
    programs = min(shape.programs_per_sm, per_sm)
    return dict(
        registers=regs, stack=stack, spills=spills, resident_per_sm=per_sm,
        launched_per_sm=programs, warps_per_sm=programs * shape.warps,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=list(SWEEP))
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--quants", nargs="+", default=["none", "fp8", "nvfp4"])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168, 4096])
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    from fusion_bridge.kernels.symm_ring import RingShape

    rows = []
    for hidden in args.hidden:
        for world in args.worlds:
            for quant in args.quants:
                for label in args.variants:
                    shape = RingShape(**SWEEP[label])
                    found = compile_case(shape, world, quant, hidden)
                    row = dict(H=hidden, W=world, quant=quant, variant=label,
                               warps=shape.warps, **found)  # fmt: skip
                    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
                    rows.append(row)
    if args.csv:
        write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
