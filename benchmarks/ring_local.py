"""The large-T path's local work on ONE GPU: the ring two-shot kernel (`kernels/symm_ring.py`) with
a world of 1 (no peers: every row is its own, no link traffic) beside our finalize kernel alone and
our add+RMSNorm kernel alone, measured in the same run. Target: ring <= finalize + add_rmsnorm.

    python benchmarks/ring_local.py [--tokens 1024 4096 8192] [--hidden 7168 4096] [--csv PATH]
        [--variants default|sweep] [--old] [--emulate 2 8]

CUDA graphs, inputs rotated past L2, median us per call. `--old` adds the previous persistent
kernel (symm_twoshot, T <= 4096). `--emulate W...` adds W ranks emulated on this one GPU (each rank
on its own stream with SMs / W programs; all ranks' work in one time: not a two-GPU prediction).
Every ring row is checked against the two standalone kernels' outputs (residual_out bitwise, the
norm within 2 bf16 ulps-ish) before it is timed.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fusion_bridge.cli.bench import write_csv  # noqa: E402
from fusion_bridge.timing import copy_bandwidth_gbs, sets_to_rotate, time_graph  # noqa: E402

SWEEP = {  # label -> RingShape fields (chunk: per workspace)
    "c256_p2_w8_t2x1024": dict(chunk=256),
    "c128_p2_w8_t2x1024": dict(chunk=128),
    "c512_p2_w8_t2x1024": dict(chunk=512),
    "c256_p1_w8_t2x1024": dict(chunk=256, programs_per_sm=1),
    "c256_p4_w8_t2x1024": dict(chunk=256, programs_per_sm=4),
    "c256_p4_w4_t2x1024": dict(chunk=256, programs_per_sm=4, warps=4),
    "c256_p2_w8_t4x1024": dict(chunk=256, f_rows=4, r_rows=4),
    "c256_p2_w8_t1x2048": dict(chunk=256, f_rows=1, f_cols=2048, r_rows=1, r_cols=2048),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168, 4096])
    ap.add_argument("--variants", default="default", choices=["default", "sweep"])
    ap.add_argument("--old", action="store_true")
    ap.add_argument("--emulate", type=int, nargs="*", default=[])
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    from fusion_bridge.kernels import symm_ring
    from fusion_bridge.kernels.add_rmsnorm import add_rmsnorm_into
    from fusion_bridge.kernels.finalize_add import finalize_add_into
    from fusion_bridge.kernels.symm_ring_emu import one_gpu_workspaces
    from fusion_bridge.spec import EpilogueSpec
    from fusion_bridge.synthetic import make_inputs

    variants = SWEEP if args.variants == "sweep" else {"default": {}}
    rows = [dict(path="hbm_copy_gbs", H=0, T=0, us=round(copy_bandwidth_gbs(1 << 30), 1))]
    none = torch.empty(0, dtype=torch.uint8, device="cuda")

    def record(name, hidden, tokens, us):
        rows.append(dict(path=name, H=hidden, T=tokens, us=round(us, 2)))
        print(f"{name:36s} H={hidden} T={tokens:5d} {us:9.2f} us", flush=True)

    for hidden in args.hidden:
        spec = EpilogueSpec(hidden_size=hidden, top_k=8, routed_scaling_factor=2.5)
        for tokens in args.tokens:
            n = sets_to_rotate(tokens * hidden * 2 * 14, max_sets=16)
            sets = [
                make_inputs(spec, tokens, seed=i, device="cuda", skip_fraction=0.0)
                for i in range(n)
            ]
            part = torch.empty(tokens, hidden, dtype=spec.dtype, device="cuda")
            ro = torch.empty_like(part)
            no = torch.empty_like(part)

            def fin(i):
                s = sets[i]
                finalize_add_into(
                    part, s.gemm2_out, s.expanded_idx_to_permuted_idx, s.expert_weights,
                    s.shared_output, spec.routed_scaling_factor,
                )  # fmt: skip

            def norm(i):
                s = sets[i]
                add_rmsnorm_into(
                    ro, no, none, none, s.residual, part, s.gamma, spec.eps, spec.weight_bias, 0,
                    1.0, False,
                )  # fmt: skip

            t_fin = time_graph(fin, sets=n)
            t_norm = time_graph(norm, sets=n)
            record("finalize_alone", hidden, tokens, t_fin)
            record("add_rmsnorm_alone", hidden, tokens, t_norm)
            record("standalone_sum", hidden, tokens, t_fin + t_norm)
            fin(0)
            norm(0)
            ref_ro, ref_no = ro.clone(), no.clone()
            for label, fields in variants.items():
                shape = symm_ring.RingShape(**fields)
                (ws,), _ = one_gpu_workspaces(1, shape.chunk, hidden, timeout_s=5.0)
                ws.num_sms = torch.cuda.get_device_properties(0).multi_processor_count
                out_ro, out_no = torch.empty_like(part), torch.empty_like(part)

                def ring(i, ws=ws, shape=shape, out_ro=out_ro, out_no=out_no):
                    s = sets[i]
                    symm_ring.fused_into(
                        ws, residual_out=out_ro, norm_out=out_no, q=none, sf=none,
                        gemm2_out=s.gemm2_out, perm=s.expanded_idx_to_permuted_idx,
                        weights=s.expert_weights, shared=s.shared_output, residual=s.residual,
                        gamma=s.gamma, routed_scaling=spec.routed_scaling_factor, eps=spec.eps,
                        weight_bias=spec.weight_bias, quant=0, quant_scale=1.0, swizzled=False,
                        shape=shape,
                    )  # fmt: skip

                ring(0)
                torch.cuda.synchronize()
                same = torch.equal(out_ro.view(torch.int16), ref_ro.view(torch.int16))
                dn = (out_no.float() - ref_no.float()).abs().max().item()
                err = int(ws.err[0])
                print(
                    f"  check {label}: residual_out bitwise {same}, norm max diff {dn:.3g}, "
                    f"err {err}"
                )
                if not same or err or not dn < 0.1:
                    record(f"ring_{label}_WRONG", hidden, tokens, float("nan"))
                    continue
                record(f"ring_{label}", hidden, tokens, time_graph(ring, sets=n))
                assert int(ws.err[0]) == 0, hex(int(ws.err[0]))
            if args.old and tokens <= 4096:
                _old(record, spec, sets, n, tokens, hidden, part, ro, none)
            for world in args.emulate:
                _emulated(record, spec, sets, n, tokens, hidden, world, symm_ring)
    if args.csv:
        write_csv(args.csv, rows)
    print(f"HBM copy {rows[0]['us']} GB/s")


def _old(record, spec, sets, n, tokens, hidden, part, ro, none):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from test_gpu_symm_one_device import _workspaces

    from fusion_bridge.kernels import symm_twoshot

    (ws,), _ = _workspaces(symm_twoshot, 1, tokens, hidden)
    ws.num_sms = torch.cuda.get_device_properties(0).multi_processor_count

    def old(i):
        s = sets[i]
        symm_twoshot.fused_into(
            ws, part, ro, none, none, s.gemm2_out, s.expanded_idx_to_permuted_idx,
            s.expert_weights, s.shared_output, s.residual, s.gamma, spec.routed_scaling_factor,
            spec.eps, spec.weight_bias, 0, 1.0, False,
        )  # fmt: skip

    record("old_twoshot_persistent", hidden, tokens, time_graph(old, sets=n))


def _emulated(record, spec, sets, n, tokens, hidden, world, symm_ring):
    """W ranks on one GPU, each on its own stream (the same inputs on every rank: timing only)."""
    from fusion_bridge.kernels.symm_ring_emu import one_gpu_workspaces

    wss, _ = one_gpu_workspaces(world, symm_ring.DEFAULT_SHAPE.chunk, hidden, timeout_s=5.0)
    streams = [torch.cuda.Stream() for _ in range(world)]
    none = torch.empty(0, dtype=torch.uint8, device="cuda")
    outs = [(torch.empty_like(sets[0].residual), torch.empty_like(sets[0].residual)) for _ in wss]

    def call(i):
        s = sets[i]
        main = torch.cuda.current_stream()
        for ws, st, (a, b) in zip(wss, streams, outs):
            st.wait_stream(main)
            with torch.cuda.stream(st):
                symm_ring.fused_into(
                    ws, residual_out=a, norm_out=b, q=none, sf=none, gemm2_out=s.gemm2_out,
                    perm=s.expanded_idx_to_permuted_idx, weights=s.expert_weights,
                    shared=s.shared_output, residual=s.residual, gamma=s.gamma,
                    routed_scaling=spec.routed_scaling_factor, eps=spec.eps,
                    weight_bias=spec.weight_bias, quant=0, quant_scale=1.0, swizzled=False,
                )  # fmt: skip
        for st in streams:
            main.wait_stream(st)

    try:
        us = time_graph(call, sets=n)
        errs = [int(ws.err[0]) for ws in wss]
        record(f"ring_emulated_W{world}_all_ranks" + ("" if not any(errs) else "_ERR"),
               hidden, tokens, us)  # fmt: skip
    except Exception as exc:  # report and go on: the single-rank rows are the target
        print(f"emulated W={world} failed: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
