"""The two-shot kernel's local work alone, on ONE GPU: `symm_twoshot` launched with a world of 1 (no
peers: every row is its own, the reduce-scatter is empty and the all-gather writes into its own
buffer),
beside our finalize kernel alone and the HBM copy bandwidth. What the kernel costs before any NVLink
traffic: the part of the large-T time that overlapping with the link cannot hide.

    python benchmarks/twoshot_local.py [--tokens 1024 4096] [--hidden 7168 4096] [--csv PATH]

CUDA graphs, inputs rotated past L2, median us per call. The `twoshot_ablate_*` rows run a subset of
the
kernel's phases (reduce: finalize + residual + the row into its own all-gather region; gather: poll,
residual_out, norm; clear: the previous call's rows back to the sentinel): where the time goes;
their
outputs are wrong.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from fusion_bridge.cli.bench import write_csv  # noqa: E402
from fusion_bridge.timing import copy_bandwidth_gbs, sets_to_rotate, time_graph  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168, 4096])
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    from fusion_bridge.kernels import symm_protocol as P
    from fusion_bridge.kernels import symm_testing
    from fusion_bridge.kernels.symm_twoshot import TwoshotShape
    from fusion_bridge.kernels.finalize_add import finalize_add_into
    from fusion_bridge.spec import EpilogueSpec
    from fusion_bridge.synthetic import make_inputs

    rows = [dict(path="hbm_copy_gbs", H=0, T=0, us=round(copy_bandwidth_gbs(1 << 30), 1))]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for hidden in args.hidden:
        cap = max(args.tokens)
        spec = EpilogueSpec(hidden_size=hidden, top_k=8, routed_scaling_factor=2.5, max_tokens=cap)
        group = symm_testing.emulated_group(
            "twoshot", spec, 1, cap, device="cuda", timeout=10_000_000, num_sms=sms
        )
        for tokens in args.tokens:
            n = sets_to_rotate(tokens * hidden * 2 * 14, max_sets=16)
            sets = [
                make_inputs(spec, tokens, seed=i, device="cuda", skip_fraction=0.0)
                for i in range(n)
            ]
            outs = [torch.empty(tokens, hidden, dtype=spec.dtype, device="cuda") for _ in range(2)]
            none = torch.empty(0, dtype=torch.uint8, device="cuda")

            def fin(i):
                s = sets[i]
                finalize_add_into(
                    outs[0],
                    s.gemm2_out,
                    s.expanded_idx_to_permuted_idx,
                    s.expert_weights,
                    s.shared_output,
                    spec.routed_scaling_factor,
                )

            def local(warps, phases=P.ALL_PHASES):
                def fn(i):
                    symm_testing.launch_with_hooks(
                        "twoshot",
                        group.layers[0],
                        shape=TwoshotShape(None, warps),
                        phases=phases,
                        **symm_testing.call_tensors(sets[i], (outs[0], outs[1], none, none)),
                    )

                return fn

            variants = [("finalize_alone", fin)] + [
                (f"twoshot_local_w{w}", local(w)) for w in (8, 16, 4)
            ]
            # ablations (wrong results, timing only): which phase costs what
            for label, phases in (
                ("reduce_only", P.REDUCE | P.EPOCH),
                ("reduce_gather", P.REDUCE | P.NORM | P.EPOCH),
                ("reduce_clear", P.REDUCE | P.CLEAR | P.EPOCH),
            ):
                variants.append((f"twoshot_ablate_{label}_w16", local(16, phases)))
            for name, fn in variants:
                us = time_graph(fn, sets=n)
                rows.append(dict(path=name, H=hidden, T=tokens, us=round(us, 2)))
                print(f"{name:32s} H={hidden} T={tokens:5d} {us:9.2f} us", flush=True)
        assert int(group.errs[0, 0]) == 0, hex(int(group.errs[0, 0]))
    if args.csv:
        write_csv(args.csv, rows)
    print(f"HBM copy {rows[0]['us']} GB/s")


if __name__ == "__main__":
    main()
