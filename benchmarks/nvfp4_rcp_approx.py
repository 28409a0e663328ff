"""How many NVFP4 codes and block scales FlashInfer's default build would write otherwise than ours
(a GPU with SM90 or newer; a measurement, not a test).

    python benchmarks/nvfp4_rcp_approx.py [--rows 4096] [--json OUT.json]

Our NVFP4 (kernels/quant.py, docs/math.md section 3) takes FlashInfer's steps with IEEE fp32
operations: sf = e4m3(gs * (amax * fp32(1/6))), q = e2m1(fp32(x * (1 / (sf * (1 / gs))))).
FlashInfer's default build takes the three reciprocals with `rcp.approx.ftz.f32` instead. Its FP4
conversion is compiled for SM100 and newer only, so its own output cannot be produced on an SM90
GPU; this script runs both formulas in one Triton kernel on the GPU (the approximate reciprocal by
the same PTX instruction, inline), rounds both products with our exact e2m1 rounding, and counts
the differences over normally distributed bf16 rows and several global scales.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from fusion_bridge.kernels import quant_codes as QC
from fusion_bridge.kernels.quant import _e2m1_codes, _e4m3_rne_satfinite, _nvfp4_encode_scale
from fusion_bridge.kernels.rounding import block_amax


@triton.jit
def _rcp_approx(x):
    return tl.inline_asm_elementwise(
        "rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _both(x_ptr, out_ptr, gs, H: tl.constexpr, BLOCK: tl.constexpr):
    """Row `program_id`: out[0] codes differing, out[1] scales differing (atomic sums); BLOCK the
    next power of two of H (the columns past H are 0: their blocks agree in both formulas)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    y = tl.load(x_ptr + row * H + cols, mask=cols < H, other=0.0).to(tl.float32)
    yb = tl.reshape(y, [BLOCK // 16, 16])
    amax = block_amax(yb, True)
    sf_code, sf = _e4m3_rne_satfinite(gs * (amax * QC.E2M1_MAX_RECIP))
    ours = _e2m1_codes(tl.abs(yb * _nvfp4_encode_scale(sf, gs)[:, None]))
    sixes, scales = tl.full(amax.shape, 6.0, tl.float32), tl.full(amax.shape, gs, tl.float32)
    fast_code, fast_sf = _e4m3_rne_satfinite(gs * (amax * _rcp_approx(sixes)))
    fast_scale = tl.where(amax != 0.0, _rcp_approx(fast_sf * _rcp_approx(scales)), 0.0)
    fast = _e2m1_codes(tl.abs(yb * fast_scale[:, None]))
    tl.atomic_add(out_ptr, tl.sum(tl.sum((ours != fast).to(tl.int64), 1), 0))
    tl.atomic_add(out_ptr + 1, tl.sum((sf_code != fast_code).to(tl.int64), 0))


def measure(rows: int, hidden: int, scales: list[float], seed: int = 0) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g, device="cuda").to(torch.bfloat16)
    found = []
    for gs in scales:
        out = torch.zeros(2, dtype=torch.int64, device="cuda")
        _both[(rows,)](x, out, float(gs), H=hidden, BLOCK=triton.next_power_of_2(hidden))
        codes, sfs = out.tolist()
        found.append(
            {
                "global_scale": gs,
                "elements": rows * hidden,
                "codes_differing": codes,
                "codes_differing_fraction": codes / (rows * hidden),
                "blocks": rows * hidden // 16,
                "scales_differing": sfs,
            }
        )
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows", type=int, default=4096, help="bf16 rows of N(0, 1) (default 4096)"
    )
    parser.add_argument("--hidden", type=int, default=7168, help="row length (default 7168)")
    parser.add_argument("--json", help="write the table here too")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "nvfp4_rcp_approx: needs a CUDA GPU (the approximate reciprocal is a PTX instruction)"
        )
        return 2
    scales = [1.0, 3.0, 100.0, 384.0, 448.0 * 6 / 4.0, 448.0 * 6 / 5.0, 1000.3]
    table = measure(args.rows, args.hidden, scales)
    gpu = torch.cuda.get_device_name()
    print(
        f"{gpu}: {args.rows} x {args.hidden} bf16 N(0,1); FlashInfer's rcp.approx formula vs ours"
    )
    print(f"{'global_scale':>13} {'codes differing':>16} {'fraction':>10} {'scales differing':>17}")
    for r in table:
        print(
            f"{r['global_scale']:>13.4g} {r['codes_differing']:>16} "
            f"{r['codes_differing_fraction']:>10.2e} {r['scales_differing']:>17}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"gpu": gpu, "rows": args.rows, "hidden": args.hidden, "table": table}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
