"""The large-T path's local work on ONE GPU: the two-shot ring kernel (`kernels/symm_ring.py`) with
a world of 1 (no peers: every row is its own, no link traffic) beside our finalize kernel alone and
our add+RMSNorm kernel alone, measured in the same run. Target: ring <= finalize + add_rmsnorm.

    python benchmarks/ring_local.py [--tokens 1024 4096 8192] [--hidden 7168 4096] [--csv PATH]
        [--variants default | sweep | LABEL...] [--ablate] [--emulate 2 8]

Prints (and writes as CSV) one table: per (H, T) our finalize alone, our add+RMSNorm alone, their
sum, each ring row's time, its ratio to the sum and the ring's workspace per rank (MB). `--ablate`
adds the ring's finalize stage alone (PHASES hook; its outputs are wrong) and our finalize in the
ring's tile shape. `--staged LABEL... | all` adds the staged pipeline (kernels/symm_staged.py: per-
chunk launches, F on a side stream) in the STAGED shapes or as the two-shot strategy launches it
(TWOSHOT labels), checked like the ring, and with `--ablate` its finalize launches alone, its
row launches (R) alone and everything but F on one stream. CUDA graphs, inputs rotated past
L2, median us per call.
`--emulate W...` adds W ranks emulated on this one GPU (each rank on its own stream with SMs / W
programs; all ranks' work in one time: not a two-GPU prediction). Every ring row is first checked
against the two standalone kernels' outputs (residual_out bitwise equal: the same roundings;
norm_out close: the ring norms the rounded residual_out) and its error word. The `lean_*` labels
stream the row stages in column chunks with a register cap (RingShape.row_cols / f_prefetch /
max_regs), so several programs share an SM; benchmarks/ring_offline_regs.py gives their registers
without a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fusion_bridge.cli.bench import write_csv  # noqa: E402
from fusion_bridge.timing import (  # noqa: E402
    copy_bandwidth_gbs,
    sets_to_rotate,
    time_graph,
    time_graphs_per_rank,
)

SWEEP = {  # label -> RingShape fields (programs per SM are capped by the occupancy)
    "default": dict(),
    "w16_f2x4096": dict(warps=16, f_rows=2, f_cols=4096),
    "w16_f2x2048": dict(warps=16, f_rows=2, f_cols=2048),
    "w8_f1x2048": dict(warps=8, f_rows=1, f_cols=2048),
    # rows streamed in column chunks (RingShape.row_cols), routing loaded in the finalize tile,
    # a register cap: several programs per SM (benchmarks/ring_offline_regs.py: the registers)
    "lean_w8_r512_m40": dict(
        programs_per_sm=6, warps=8, f_cols=1024, row_cols=512, f_prefetch=False, max_regs=40
    ),
    "lean_w8_r512_m32": dict(
        programs_per_sm=8, warps=8, f_cols=1024, row_cols=512, f_prefetch=False, max_regs=32
    ),
    "lean_w4_r256_m40": dict(
        programs_per_sm=12, warps=4, f_cols=512, row_cols=256, f_prefetch=False, max_regs=40
    ),
    "lean_w8_r1024_m48": dict(
        programs_per_sm=5, warps=8, f_cols=1024, row_cols=1024, f_prefetch=False, max_regs=48
    ),
    "lean_w8_r512": dict(programs_per_sm=8, warps=8, f_cols=1024, row_cols=512, f_prefetch=False),
}
# the staged pipeline (kernels/symm_staged.py): label -> StagedShape fields
STAGED = {
    "c256": dict(chunk=256),
    "c512": dict(chunk=512),
    "c512_one_stream": dict(chunk=512, stream_mode="one"),
    "c512_w8": dict(chunk=512, row_warps=8),
    "c512_prio": dict(chunk=512, stream_mode="two_prio"),
    "c512_w8_prio": dict(chunk=512, row_warps=8, stream_mode="two_prio"),
    "c1024": dict(chunk=1024),  # 117 MB of slots at H=7168: to see what fewer launches give
    # the same 58.7 MB as 4 x 512: 2 slots of 1024 tokens; F of consecutive chunks on 2 streams
    "c512_f2": dict(chunk=512, f_streams=2),
    "c512_f2_prio": dict(chunk=512, f_streams=2, stream_mode="two_prio"),
    "c1024_s2": dict(chunk=1024, slots=2),
    "c1024_s2_f2": dict(chunk=1024, slots=2, f_streams=2),
    "c1024_s2_f2_prio": dict(chunk=1024, slots=2, f_streams=2, stream_mode="two_prio"),
    # L2 hints (StagedShape.l2: 1 evict-first / evict-last, 2 also drop the read slot rows)
    "c1024_s2_f2_l2h": dict(chunk=1024, slots=2, f_streams=2, l2=1),
    "c1024_s2_f2_l2d": dict(chunk=1024, slots=2, f_streams=2, l2=2),
    "c512_f2_l2d": dict(chunk=512, f_streams=2, l2=2),
    "c1024_s2_f2_prio_l2d": dict(chunk=1024, slots=2, f_streams=2, stream_mode="two_prio", l2=2),
}
# the two-shot strategy's launch variants on its whole workspace (kernels/twoshot_launch.py)
TWOSHOT = {"twoshot_default": None, "twoshot_staged_prio": "staged_prio"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168, 4096])
    ap.add_argument("--variants", nargs="*", default=["default"], help="SWEEP labels or 'sweep'")
    ap.add_argument("--staged", nargs="*", default=[], help="STAGED labels or 'all'")
    ap.add_argument("--emulate", type=int, nargs="*", default=[])
    ap.add_argument("--ablate", action="store_true", help="also time the finalize stage alone")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    from fusion_bridge.kernels import symm_ring
    from fusion_bridge.kernels.add_rmsnorm import add_rmsnorm_into
    from fusion_bridge.kernels.finalize_add import finalize_add_into
    from fusion_bridge.kernels import symm_protocol as P
    from fusion_bridge.kernels.symm_testing import (
        call_tensors,
        ring_launch_ablated,
        ring_layers_on_one_gpu,
    )
    from fusion_bridge.spec import EpilogueSpec
    from fusion_bridge.synthetic import make_inputs

    names = list(SWEEP) if args.variants == ["sweep"] else args.variants
    staged = list(STAGED) + list(TWOSHOT) if args.staged == ["all"] else args.staged
    variants = {name: SWEEP[name] for name in names}
    copy_gbs = round(copy_bandwidth_gbs(1 << 30), 1)
    rows = []  # one per (H, T, variant): the table the target reads
    none = torch.empty(0, dtype=torch.uint8, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    keep = []

    def record(name, hidden, tokens, us):
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
            ro, no = torch.empty_like(part), torch.empty_like(part)

            def fin(i):
                s = sets[i]
                finalize_add_into(
                    part, s.gemm2_out, s.expanded_idx_to_permuted_idx, s.expert_weights,
                    s.shared_output, spec.routed_scaling_factor,
                )  # fmt: skip

            def norm(i):
                add_rmsnorm_into(
                    ro, no, none, none, sets[i].residual, part, sets[i].gamma, eps=spec.eps,
                    weight_bias=spec.weight_bias, quant=0, quant_scale=1.0, swizzled=False,
                )  # fmt: skip

            t_fin, t_norm = time_graph(fin, sets=n), time_graph(norm, sets=n)
            if args.ablate:  # our finalize in the ring's tile: 16 warps, 4096 columns (3 CTAs/SM)

                def fin16(i):
                    s = sets[i]
                    finalize_add_into(
                        part, s.gemm2_out, s.expanded_idx_to_permuted_idx, s.expert_weights,
                        s.shared_output, spec.routed_scaling_factor, block_h=4096, num_warps=16,
                    )  # fmt: skip

                t_fin16 = time_graph(fin16, sets=n)
                record("finalize_alone_w16_b4096", hidden, tokens, t_fin16)
            record("finalize_alone", hidden, tokens, t_fin)
            record("add_rmsnorm_alone", hidden, tokens, t_norm)
            record("standalone_sum", hidden, tokens, t_fin + t_norm)
            workspace_mb = symm_ring.buffer_bytes(1, hidden, 2) / 1e6

            def row(label, us):
                return dict(
                    H=hidden, T=tokens, finalize_alone_us=round(t_fin, 2),
                    add_rmsnorm_alone_us=round(t_norm, 2), sum_us=round(t_fin + t_norm, 2),
                    path=label, us=round(us, 2), ratio=round(us / (t_fin + t_norm), 3),
                    workspace_mb=round(workspace_mb, 1),
                )  # fmt: skip

            if args.ablate:
                rows.append(row("finalize_alone_w16_b4096", t_fin16))
            fin(0)
            norm(0)
            ref_ro, ref_no = ro.clone(), no.clone()
            for label, fields in variants.items():
                shape = symm_ring.RingShape(**fields)
                group = ring_layers_on_one_gpu(1, hidden, spec, timeout_s=5.0)
                keep.append(group)  # the layer holds raw pointers into its buffer
                layer, err = _with_sms(group.layers[0], sms), group.errs[0]
                out = (torch.empty_like(part), torch.empty_like(part), none, none)

                def ring(i, layer=layer, shape=shape, out=out):
                    symm_ring.launch(layer, shape=shape, **call_tensors(sets[i], out))

                ring(0)
                torch.cuda.synchronize()
                same = torch.equal(out[0].view(torch.int16), ref_ro.view(torch.int16))
                dn = (out[1].float() - ref_no.float()).abs().max().item()
                print(f"  check {label}: residual_out bitwise {same}, norm max diff {dn:.3g}, "
                      f"err {int(err[0])}")  # fmt: skip
                if not same or int(err[0]) or not dn < 0.1:
                    rows.append(row(f"ring_{label}_WRONG", float("nan")))
                    continue
                us = time_graph(ring, sets=n)
                record(f"ring_{label}", hidden, tokens, us)
                assert int(err[0]) == 0, hex(int(err[0]))
                rows.append(row(f"ring_{label}", us))
                if args.ablate:  # the stages' shares (results wrong by design)
                    for tag, phases in (("F", P.RING_FINALIZE),):

                        def ablated(i, layer=layer, shape=shape, out=out, phases=phases):
                            ring_launch_ablated(layer, phases, shape, **call_tensors(sets[i], out))

                        us = time_graph(ablated, sets=n)
                        record(f"ring_{label}_only_{tag}", hidden, tokens, us)
                        rows.append(row(f"ring_{label}_only_{tag}", us))
            for label in staged:
                rows.extend(
                    _staged_rows(label, record, row, spec, sets, n, part, ref_ro, ref_no, keep,
                                 args.ablate)
                )  # fmt: skip
            for world in args.emulate:
                us = _emulated(record, spec, sets, n, tokens, hidden, world)
                rows.append(row(f"ring_emulated_W{world}_all_ranks", us))
    print(f"\nHBM copy {copy_gbs} GB/s; W=1 local work vs our two standalone kernels (us, graph)")
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    if args.csv:
        write_csv(
            args.csv, rows + [dict.fromkeys(cols, "") | dict(path="hbm_copy_gbs", us=copy_gbs)]
        )


def _staged_rows(label, record, row, spec, sets, n, part, ref_ro, ref_no, keep, ablate):
    """The staged pipeline (kernels/symm_staged.py) at world size 1 in shape STAGED[label], or
    (TWOSHOT labels) the two-shot strategy's launch of a variant (kernels/twoshot_launch.py) on
    its whole workspace: checked against the standalone kernels' outputs, then timed; `ablate`
    adds its finalize launches alone, its R launches alone and every launch but F on one stream
    (the slot counters preset so no gate holds them; outputs not all written)."""
    from fusion_bridge.kernels import symm_protocol as P
    from fusion_bridge.kernels import symm_staged, twoshot_launch
    from fusion_bridge.kernels.symm_ring_device import FREED_BYTE, SLOTS
    from fusion_bridge.kernels.symm_testing import call_tensors, ring_layers_on_one_gpu
    from fusion_bridge.kernels.symm_testing_staged import staged_launches

    hidden, tokens = part.shape[1], part.shape[0]
    variant = TWOSHOT.get(label, False)
    if variant is False:
        shape, region = symm_staged.StagedShape(**STAGED[label]), 0
        nbytes = P.HEADER_BYTES + shape.slots * (P.ring_buffer_bytes(1, hidden, 2, shape.chunk)
                                                 - P.HEADER_BYTES) // P.RING_SLOTS  # fmt: skip
    else:
        shape = twoshot_launch._STAGED.get(variant, symm_staged.DEFAULT_SHAPE)
        region = P.staged_region(1, hidden, 2)[0]
        nbytes = P.buffer_bytes("twoshot", 1, 0, hidden, 2)
    none = torch.empty(0, dtype=torch.uint8, device="cuda")

    def group_for():
        g = ring_layers_on_one_gpu(1, hidden, spec, 5.0, chunk=shape.chunk, nbytes=nbytes)
        keep.append(g)
        return g

    group = group_for()
    layer, err = group.layers[0], group.errs[0]
    out = (torch.full_like(part, float("nan")), torch.full_like(part, float("nan")), none, none)
    mb = group.buffers[0].numel() / 1e6

    def staged(i):
        if variant is False:
            symm_staged.launch(layer, shape=shape, **call_tensors(sets[i], out))
        else:
            twoshot_launch.launch(layer, shape=variant, **call_tensors(sets[i], out))

    staged(0)
    torch.cuda.synchronize()
    same = torch.equal(out[0].view(torch.int16), ref_ro.view(torch.int16))
    dn = (out[1].float() - ref_no.float()).abs().max().item()
    print(f"  check staged_{label}: residual_out bitwise {same}, norm max diff {dn:.3g}, "
          f"err {int(err[0])}")  # fmt: skip
    if not same or int(err[0]) or not dn < 0.1:
        return [dict(row(f"staged_{label}_WRONG", float("nan")), workspace_mb=round(mb, 1))]
    us = time_graph(staged, sets=n)
    record(f"staged_{label}", hidden, tokens, us)
    assert int(err[0]) == 0, hex(int(err[0]))
    out_rows = [dict(row(f"staged_{label}", us), workspace_mb=round(mb, 1))]
    if ablate:
        group_f = group_for()
        group_f.buffers[0][FREED_BYTE : FREED_BYTE + 8 * SLOTS].view(torch.int64).fill_(1 << 40)

        def only(stages):
            def fn_of(i):
                for stage, _, fn in staged_launches(
                    group_f.layers[0], call_tensors(sets[i], out), shape, False, False, region
                ):
                    if stage in stages:
                        fn()

            return fn_of

        for tag, stages in (("only_F", "F"), ("only_R", "R"), ("no_F", "QXRYGZ")):
            us = time_graph(only(stages), sets=n)
            record(f"staged_{label}_{tag}", hidden, tokens, us)
            out_rows.append(dict(row(f"staged_{label}_{tag}", us), workspace_mb=round(mb, 1)))
    return out_rows


def _with_sms(layer, sms):
    import dataclasses

    return dataclasses.replace(layer, num_sms=sms)


def _emulated(record, spec, sets, n, tokens, hidden, world):
    """W ranks on one GPU, each on its own stream (the same inputs on every rank: timing only)."""
    from fusion_bridge.kernels import symm_ring
    from fusion_bridge.kernels.symm_testing import call_tensors, ring_layers_on_one_gpu

    group = ring_layers_on_one_gpu(world, hidden, spec, timeout_s=5.0)
    layers, errs = group.layers, group.errs
    none = torch.empty(0, dtype=torch.uint8, device="cuda")
    outs = [
        (torch.empty_like(sets[0].residual), torch.empty_like(sets[0].residual), none, none)
        for _ in layers
    ]

    def rank_fn(layer, out):
        return lambda i: symm_ring.launch(layer, **call_tensors(sets[i], out))

    try:
        # one graph per rank on its own stream: one graph holding every rank does not guarantee
        # that its branches run concurrently, and a rank waiting alone for a peer times out
        us = time_graphs_per_rank([rank_fn(la, o) for la, o in zip(layers, outs)], sets=n)
        bad = any(int(e[0]) for e in errs)
        record(f"ring_emulated_W{world}_all_ranks" + ("_ERR" if bad else ""), hidden, tokens, us)
        return float("nan") if bad else us
    except Exception as exc:  # report and go on: the single-rank rows are the target
        print(f"emulated W={world} failed: {type(exc).__name__}: {exc}")
        return float("nan")


if __name__ == "__main__":
    main()
