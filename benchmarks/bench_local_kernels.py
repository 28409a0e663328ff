"""Benchmark our two kernels on one GPU against the copy bandwidth and the torch separate path.

    CUDA_VISIBLE_DEVICES=0 python benchmarks/bench_local_kernels.py [--hidden 7168 --top-k 8]
        [--csv PATH]

For T in 1, 2, 4, ..., 8192: kernel time inside a CUDA graph with inputs rotated beyond L2
("rotated") and with the same inputs replayed ("same_inputs": L2-resident at small T, which
flatters them), the achieved bandwidth (bytes read + written, each once) and its fraction of the
device-to-device copy bandwidth measured in the same run; then the launch-shape sweeps, written
beside the CSV as <csv>_launch_sweep.csv.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.harness import Rows, add_common, parser  # noqa: E402
from fusion_bridge.kernels.add_rmsnorm import add_rmsnorm_into  # noqa: E402
from fusion_bridge.kernels.finalize_add import finalize_add_into  # noqa: E402
from fusion_bridge.kernels.quant import QUANT_FP8, QUANT_NONE, QUANT_NVFP4  # noqa: E402
from fusion_bridge.tuning.timing import copy_bandwidth_gbs, sets_to_rotate, time_graph  # noqa: E402
from fusion_bridge.oracle.torch_math import finalize_fp32  # noqa: E402


def finalize_sets(tokens, hidden, top_k, count, dev):
    sets = []
    for _ in range(count):
        rows = tokens * top_k
        sets.append(
            dict(
                gemm2=torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16),
                perm=torch.randperm(rows, device=dev).to(torch.int32).reshape(tokens, top_k),
                w=torch.rand(tokens, top_k, device=dev),
                shared=torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16),
                out=torch.empty(tokens, hidden, device=dev, dtype=torch.bfloat16),
            )
        )
    return sets


def norm_sets(tokens, hidden, quant, count, dev):
    sets = []
    for _ in range(count):
        s = dict(
            res=torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16),
            red=torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16),
            res_out=torch.empty(tokens, hidden, device=dev, dtype=torch.bfloat16),
            norm_out=torch.empty(tokens, hidden, device=dev, dtype=torch.bfloat16),
        )
        if quant == QUANT_FP8:
            s["q"], s["sf"] = (
                torch.empty(tokens, hidden, device=dev, dtype=torch.uint8),
                torch.empty(0, device=dev),
            )
        elif quant == QUANT_NVFP4:
            s["q"] = torch.empty(tokens, hidden // 2, device=dev, dtype=torch.uint8)
            s["sf"] = torch.empty(
                -(-tokens // 128) * 128, -(-hidden // 64) * 4, device=dev, dtype=torch.uint8
            )
        else:
            s["q"] = s["sf"] = torch.empty(0, device=dev, dtype=torch.uint8)
        sets.append(s)
    return sets


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--max-tokens", type=int, default=8192)
    add_common(ap, top_k=8, csv_default="benchmarks/results/local_kernels_h200.csv")
    args = ap.parse_args()
    dev = torch.device("cuda")
    hidden, top_k = args.hidden, args.top_k
    gamma = torch.ones(hidden, device=dev, dtype=torch.bfloat16)
    copy_gbs = copy_bandwidth_gbs()
    print(
        f"# {torch.cuda.get_device_name()}  copy bandwidth {copy_gbs:.0f} GB/s (read+write)",
        file=sys.stderr,
    )
    rows = []
    tokens = 1
    while tokens <= args.max_tokens:
        fin_bytes = tokens * top_k * hidden * 2 + 2 * tokens * hidden * 2 + tokens * top_k * 8
        count = sets_to_rotate(fin_bytes, max_sets=2048)
        fs = finalize_sets(tokens, hidden, top_k, count, dev)

        def fin(i, fs=fs):
            s = fs[i]
            finalize_add_into(s["out"], s["gemm2"], s["perm"], s["w"], s["shared"], 1.0)

        def torch_fin(i, fs=fs):
            s = fs[i]
            s["out"].copy_(
                finalize_fp32(s["gemm2"], s["perm"], s["w"], 1.0).to(torch.bfloat16) + s["shared"]
            )

        measures = [
            ("finalize_add", fin, fin_bytes, count),
            ("torch_finalize_shared", torch_fin, fin_bytes, min(count, 64)),
        ]
        for quant, name in (
            (QUANT_NONE, "add_rmsnorm"),
            (QUANT_FP8, "add_rmsnorm_fp8"),
            (QUANT_NVFP4, "add_rmsnorm_nvfp4"),
        ):
            qbytes = {
                QUANT_NONE: 0,
                QUANT_FP8: tokens * hidden,
                QUANT_NVFP4: tokens * hidden // 2 + tokens * hidden // 16,
            }
            nbytes = 4 * tokens * hidden * 2 + hidden * 2 + qbytes[quant]
            ncount = sets_to_rotate(nbytes, max_sets=2048)
            ns = norm_sets(tokens, hidden, quant, ncount, dev)

            def norm(i, ns=ns, quant=quant):
                s = ns[i]
                add_rmsnorm_into(
                    s["res_out"],
                    s["norm_out"],
                    s["q"],
                    s["sf"],
                    s["res"],
                    s["red"],
                    gamma,
                    eps=1e-6,
                    weight_bias=0.0,
                    quant=quant,
                    quant_scale=0.05 if quant == QUANT_FP8 else 336.0,
                    swizzled=True,
                )

            measures.append((name, norm, nbytes, ncount))
        for name, fn, nbytes, count_ in measures:
            rotated = time_graph(fn, sets=count_)
            same = time_graph(fn, sets=1, calls=100)
            gbs = nbytes / (rotated * 1e-6) / 1e9
            rows.append(
                {
                    "kernel": name,
                    "tokens": tokens,
                    "hidden": hidden,
                    "top_k": top_k,
                    "us_rotated": round(rotated, 2),
                    "us_same_inputs": round(same, 2),
                    "gbs_rotated": round(gbs, 1),
                    "fraction_of_copy": round(gbs / copy_gbs, 3),
                    "copy_gbs": round(copy_gbs, 1),
                    "gpu": torch.cuda.get_device_name(),
                }
            )
        del fs
        torch.cuda.empty_cache()
        tokens *= 2
    sweep = []  # (T, kernel or BLOCK_H, warps, us)
    for tokens in (1, 16):  # launch shape of finalize_add where latency, not bandwidth, bounds it
        fs = finalize_sets(tokens, hidden, top_k, 1, dev)[0]
        for block in (256, 512, 1024, 2048):
            for warps in (1, 2, 4, 8):
                if block // (32 * warps) < 1:
                    continue
                us = time_graph(
                    lambda i, b=block, w=warps: finalize_add_into(
                        fs["out"], fs["gemm2"], fs["perm"], fs["w"], fs["shared"], 1.0, b, w
                    ),
                    sets=1,
                    calls=100,
                )
                sweep.append((tokens, f"finalize_block{block}", warps, us))
    for tokens in (1024, 4096):  # add_rmsnorm(+quant) warps per row program
        for quant in (QUANT_NONE, QUANT_FP8, QUANT_NVFP4):
            ns = norm_sets(tokens, hidden, quant, 2, dev)
            for warps in (4, 8, 16, 32):
                us = time_graph(
                    lambda i, ns=ns, q=quant, w=warps: add_rmsnorm_into(
                        ns[i]["res_out"],
                        ns[i]["norm_out"],
                        ns[i]["q"],
                        ns[i]["sf"],
                        ns[i]["res"],
                        ns[i]["red"],
                        gamma,
                        eps=1e-6,
                        weight_bias=0.0,
                        quant=q,
                        quant_scale=0.05 if q == QUANT_FP8 else 336.0,
                        swizzled=True,
                        num_warps=w,
                    ),
                    sets=2,
                )
                sweep.append((tokens, f"norm_q{quant}", warps, us))
    swept = Rows()
    for t, b, w, u in sweep:
        swept.add(b, "fusion_bridge", f"H={hidden} K={top_k} warps={w}", t, u)
    swept.write(args.csv.replace(".csv", "_launch_sweep.csv"))
    print(
        "launch sweep (T/variant/warps: us): "
        + ", ".join(f"{t}/{b}/{w}: {u:.2f}" for t, b, w, u in sweep)
    )
    out = Rows()
    out.add("hbm_copy", "hardware", "2 GiB", 0, None, gbs=round(copy_gbs, 1))
    for r in rows:
        provider = "torch" if r["kernel"].startswith("torch_") else "fusion_bridge"
        shape = f"H={hidden} K={top_k}"
        extra = dict(gbs=r["gbs_rotated"], fraction_of_copy=r["fraction_of_copy"])
        out.add(r["kernel"], provider, f"{shape} rotated", r["tokens"], r["us_rotated"], **extra)
        out.add(r["kernel"], provider, f"{shape} same_inputs", r["tokens"], r["us_same_inputs"])
    out.write(args.csv)
    print(f"{'kernel':24s} {'T':>5s} {'us rot':>8s} {'us same':>8s} {'GB/s':>7s} {'of copy':>7s}")
    for r in rows:
        print(
            f"{r['kernel']:24s} {r['tokens']:5d} {r['us_rotated']:8.2f} {r['us_same_inputs']:8.2f} "
            f"{r['gbs_rotated']:7.0f} {r['fraction_of_copy']:7.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
