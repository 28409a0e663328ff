"""The floor benchmark: every piece of the TP MoE epilogue and every composition, in one run,
against the hardware floor (2 GPUs, one rank per GPU, NCCL + symmetric memory, multicast off).

    python benchmarks/floor.py [--csv benchmarks/results/floor_h200_tp2.csv]
        [--tokens 1 16 64 256 1024] [--hidden 7168 4096] [--paths P ...] [--merge CSV]

Measured: peer copy bandwidth over NVLink (each rank writes into its peer's symmetric buffer, both
at once), HBM copy bandwidth, our finalize kernel alone, NCCL all-reduce alone, FlashInfer
one-shot/two-shot all-reduce alone and AR+residual+RMSNorm alone, FlashInfer's fused MoE-finalize
kernel (weights pre-cast), today's composition (our finalize, then FlashInfer AR+norm) with and
without programmatic dependent launch, `symm_fused_oneshot` (none, nvfp4; launch-config sweep; stage
ablations) and `symm_fused_twoshot` (none, nvfp4; the two-shot pipeline, default config), with the
two-shot composition (our finalize, then FlashInfer's two-shot AR+norm) beside it at large T.
Every time is the max over ranks of the median per call in a CUDA graph with inputs rotated past L2.

Floors: `sig` is our kernel with everything but the exchange left out (one launch, constant rows
published to every rank, the wait on them: one NVLink round trip); a path's floor is sig + max(its
HBM bytes / HBM bandwidth, its NVLink bytes / link bandwidth).

`--paths a b ...` times only those paths (plus what the floors need) and `--merge` updates those
rows in an existing CSV in the harness schema (benchmarks/harness.py), keeping the others (one
device call cannot afford every path every time).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from typing import Optional  # noqa: E402

from benchmarks.harness import Rows, add_common, parser, read_rows  # noqa: E402
from fusion_bridge.cli.launch import run_distributed  # noqa: E402
from fusion_bridge.tuning.timing import copy_bandwidth_gbs, sets_to_rotate, time_graph  # noqa: E402


def _rmax(value: float, dev) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _peer_gbs(rank: int, dev, nbytes: int = 256 << 20) -> float:
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    handle = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    assert int(handle.multicast_ptr or 0) == 0
    peer = handle.get_buffer(1 - rank, (nbytes // 2,), torch.bfloat16)
    src = torch.randn(nbytes // 2, device=dev).to(torch.bfloat16)
    dist.barrier()
    us = time_graph(lambda i: peer.copy_(src), sets=1, calls=5, repeats=7)
    dist.barrier()
    torch.cuda.synchronize()
    return nbytes / (us * 1e-6) / 1e9


def _inputs(spec, tokens, count, dev, rank):
    from fusion_bridge.oracle.synthetic import make_inputs

    return [
        make_inputs(spec, tokens, rank=rank, seed=1000 * i + tokens, device=dev, skip_fraction=0.0)
        for i in range(count)
    ]


def rank_main(
    rank: int,
    world: int,
    tokens_list: list[int],
    shapes: list[tuple[int, int]],
    only: Optional[list[str]] = None,
    sweep: bool = True,
) -> list[dict]:
    import flashinfer.comm as fi_comm

    from fusion_bridge.environment import detect
    from fusion_bridge.kernels.finalize_add import finalize_add_into
    from fusion_bridge.kernels.quant import row_block
    from fusion_bridge.spec import EpilogueSpec, QuantSpec
    from fusion_bridge.strategies import flashinfer_common as fic
    from fusion_bridge.strategies.symm_fused_oneshot import SymmFusedOneshotStrategy
    from fusion_bridge.strategies.symm_fused_twoshot import SymmFusedTwoshotStrategy
    from fusion_bridge.kernels.symm.oneshot_configs import OneshotConfig, default_config
    from fusion_bridge.testing import symm_oneshot_rig as symm_testing
    from fusion_bridge.kernels.symm import protocol as P

    # the exchange alone: constant partials published and awaited, no gathers, no outputs
    EXCHANGE_ONLY = P.ALL_PHASES & ~P.FINALIZE & ~P.NORM

    dev = torch.device("cuda", rank)
    env = detect(device=dev)
    group = dist.group.WORLD
    rows: list[dict] = []
    link = _rmax(-_peer_gbs(rank, dev), dev) * -1  # the slower direction
    hbm = copy_bandwidth_gbs(1 << 30)
    rows.append(dict(path="peer_copy_gbs", H=0, K=0, T=0, us=round(link, 1), floor_us=0, x_floor=0))
    rows.append(dict(path="hbm_copy_gbs", H=0, K=0, T=0, us=round(hbm, 1), floor_us=0, x_floor=0))
    pattern = fi_comm.AllReduceFusionPattern
    for hidden, top_k in shapes:
        spec = EpilogueSpec(
            hidden_size=hidden, top_k=top_k, routed_scaling_factor=2.5, max_tokens=max(tokens_list)
        )
        spec4 = EpilogueSpec(
            hidden_size=hidden,
            top_k=top_k,
            routed_scaling_factor=2.5,
            max_tokens=max(tokens_list),
            quant=QuantSpec.nvfp4(448.0),
        )
        symm = SymmFusedOneshotStrategy(spec, env, group, dev)
        symm4 = SymmFusedOneshotStrategy(spec4, env, group, dev)
        symm.prepare()
        symm4.prepare()
        two = SymmFusedTwoshotStrategy(spec, env, group, dev)
        two4 = SymmFusedTwoshotStrategy(spec4, env, group, dev)
        two.prepare()
        two4.prepare()
        fi_workspace = fic.acquire_workspace(group, spec, world)
        ws_ptrs = fi_workspace.workspace_tensor
        sig_us = None
        for tokens in tokens_list:
            per_set = tokens * hidden * 2 * (top_k + 6)
            n = sets_to_rotate(per_set, max_sets=64)
            sets = _inputs(spec, tokens, n, dev, rank)
            parts = [torch.empty(tokens, hidden, dtype=spec.dtype, device=dev) for _ in range(n)]
            outs = [torch.empty(tokens, hidden, dtype=spec.dtype, device=dev) for _ in range(3)]
            w_bf16 = [s.expert_weights.to(spec.dtype) for s in sets]
            oneshot = True  # FlashInfer's own heuristic at TP2 (one-shot up to 512 MB)

            def fin(i):
                s = sets[i]
                finalize_add_into(
                    parts[i],
                    s.gemm2_out,
                    s.expanded_idx_to_permuted_idx,
                    s.expert_weights,
                    s.shared_output,
                    spec.routed_scaling_factor,
                )

            def fi_ar(i, norm=True, pdl=False, one=None):
                s = sets[i]
                fi_comm.trtllm_allreduce_fusion(
                    allreduce_in=parts[i],
                    world_size=world,
                    world_rank=rank,
                    token_num=tokens,
                    hidden_dim=hidden,
                    workspace_ptrs=ws_ptrs,
                    launch_with_pdl=pdl,
                    trigger_completion_at_end=True,
                    fp32_acc=True,
                    pattern_code=pattern.kARResidualRMSNorm if norm else pattern.kAllReduce,
                    use_oneshot=oneshot if one is None else one,
                    allreduce_out=None if norm else outs[2],
                    residual_in=s.residual if norm else None,
                    residual_out=outs[0] if norm else None,
                    norm_out=outs[1] if norm else None,
                    quant_out=None,
                    scale_out=None,
                    rms_gamma=s.gamma if norm else None,
                    rms_eps=spec.eps if norm else None,
                    scale_factor=None,
                    layout_code=None,
                    weight_bias=spec.weight_bias if norm else None,
                )

            def fi_fused(i):
                s = sets[i]
                fi_comm.trtllm_moe_finalize_allreduce_fusion(
                    allreduce_in=s.gemm2_out,
                    residual_in=s.residual,
                    norm_weight=s.gamma,
                    expanded_idx_to_permuted_idx=s.expanded_idx_to_permuted_idx,
                    norm_out=outs[1],
                    residual_out=outs[0],
                    quant_out=None,
                    scale_out=None,
                    workspace_ptrs=ws_ptrs,
                    launch_with_pdl=False,
                    world_rank=rank,
                    world_size=world,
                    eps=spec.eps,
                    shared_expert_output=s.shared_output,
                    expert_scale_factor=w_bf16[i],
                    routed_scaling_factor=spec.routed_scaling_factor,
                    weight_bias=spec.weight_bias,
                )

            def symm_run(strat, config=None, phases=None):
                """The strategy's call; with a launch config or an ablation (a subset of the
                kernel's phases: results are then wrong), its kernel through the test hooks."""

                def fn(i):
                    s = sets[i]
                    if config is None and phases is None:
                        strat.run(s)
                    else:
                        symm_testing.launch_with_hooks(
                            strat._layer,
                            *symm_testing.call_records(s, (outs[0], outs[1], outs[2], outs[2])),
                            config=config,
                            phases=P.ALL_PHASES if phases is None else phases,
                        )

                return fn

            def fin_then(pdl, one=None):
                def fn(i):
                    fin(i)
                    fi_ar(i, True, pdl, one)

                return fn

            hbm_fin = tokens * hidden * 2 * (top_k + 2)
            hbm_norm = tokens * hidden * 2 * 4  # partial + residual in, two outputs
            hbm_all = tokens * hidden * 2 * (top_k + 4)
            link_b = tokens * hidden * 2 * (world - 1)
            paths = [
                ("symm_exchange_only", symm_run(symm, phases=EXCHANGE_ONLY), 0, 0),
                ("finalize_alone", fin, hbm_fin, 0),
                ("nccl_allreduce", lambda i: dist.all_reduce(parts[i]), 0, link_b),
                ("fi_allreduce", lambda i: fi_ar(i, norm=False), 0, link_b),
                ("fi_ar_norm", lambda i: fi_ar(i), hbm_norm, link_b),
                ("fi_fused_moe_finalize", fi_fused, hbm_all, link_b),
                ("compose_fin_fi_ar_norm", fin_then(False), hbm_all, link_b),
                ("compose_fin_fi_ar_norm_pdl", fin_then(True), hbm_all, link_b),
                ("symm_fused_oneshot", symm_run(symm), hbm_all, link_b),
                ("symm_fused_oneshot_nvfp4", symm_run(symm4), hbm_all, link_b),
                ("compose_fin_fi_ar_norm_twoshot", fin_then(False, False), hbm_all, link_b),
                ("symm_fused_twoshot", symm_run(two), hbm_all, link_b),
                ("symm_fused_twoshot_nvfp4", symm_run(two4), hbm_all, link_b),
            ]
            if tokens > symm._ws.cap:  # the one-shot's workspace holds fewer tokens
                paths = [
                    p
                    for p in paths
                    if not p[0].startswith(("symm_fused_oneshot", "symm_ablate", "symm_exch"))
                ]
            if tokens <= world:  # FlashInfer's two-shot needs T > world size
                paths = [p for p in paths if p[0] != "compose_fin_fi_ar_norm_twoshot"]
            if sweep and tokens <= 16 and hidden == 7168:
                rb = row_block(hidden)
                b1d, b2d, _ = default_config(tokens, hidden, symm._ws.num_sms)
                for b1, b2, w in (
                    (256, b2d, 8),
                    (1024, b2d, 8),
                    (rb, b2d, 8),
                    (b1d, rb, 8),
                    (b1d, b2d, 16),
                    (b1d, b2d, 4),
                ):
                    paths.append(
                        (
                            f"symm_v{b1 if b1 != rb else 'row'}_{b2 if b2 != rb else 'row'}_w{w}",
                            symm_run(symm, OneshotConfig(b1, b2, w)),
                            hbm_all,
                            link_b,
                        )
                    )
            if only:
                paths = [
                    p
                    for p in paths
                    if p[0] in only
                    or p[0] == "symm_exchange_only"
                    or (p[0].startswith("symm_v") and "symm_v" in only)
                    or (p[0].startswith("symm2_v") and "symm2_v" in only)
                ]
            for name, fn, hbm_b, link_bytes in paths:
                t0 = time.time()
                try:
                    dist.barrier()
                    us = _rmax(time_graph(fn, sets=n), dev)
                except Exception as exc:  # a path that cannot run here is reported, not fatal
                    print(
                        f"rank {rank}: {name} H={hidden} T={tokens}: {type(exc).__name__}: {exc}"[
                            :300
                        ],
                        file=sys.stderr,
                    )
                    us = float("nan")
                if name == "symm_exchange_only" and sig_us is None:
                    sig_us = us
                floor = (sig_us or 0) + max(hbm_b / (hbm * 1e3), link_bytes / (link * 1e3))
                if name == "finalize_alone":
                    floor = hbm_b / (hbm * 1e3)  # one launch, no communication: bandwidth only
                rows.append(
                    dict(
                        path=name,
                        H=hidden,
                        K=top_k,
                        T=tokens,
                        us=round(us, 2),
                        floor_us=round(floor, 2),
                        x_floor=round(us / floor, 2) if floor else 0.0,
                    )
                )
                if rank == 0:
                    print(
                        f"{name:32s} H={hidden} T={tokens:5d} {us:8.2f} us  "
                        f"({time.time() - t0:.1f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
            symm.check_error()
            two.check_error()
        for strat in (symm, symm4, two, two4):
            strat.close()
        fic.release_workspace(group, spec, world, fi_workspace)
    return rows


def _provider(path: str) -> str:
    """Whose code a path runs (compositions: ours, then FlashInfer's)."""
    if path.startswith("fi_"):
        return "flashinfer"
    if path.startswith("nccl_"):
        return "nccl"
    if path.startswith("compose_"):
        return "fusion_bridge+flashinfer"
    return "fusion_bridge"


def main() -> None:
    ap = parser(__doc__)
    add_common(
        ap,
        tokens=[1, 16, 64, 256, 1024],
        hidden=[7168, 4096],
        csv_default="benchmarks/results/floor_h200_tp2.csv",
    )
    ap.add_argument(
        "--paths", nargs="*", default=None, help="only these paths ('symm_v': the launch sweep)"
    )
    ap.add_argument("--merge", default=None, help="an existing CSV whose other rows are kept")
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    rows = run_distributed(
        rank_main,
        2,
        args.tokens,
        [(h, 8) for h in args.hidden],
        args.paths,
        not args.no_sweep,
        backend="nccl",
        timeout_s=540,
    )[0]
    out = Rows()
    for r in rows:
        shape = f"H={r['H']} K={r['K']} W=2" if r["H"] else "W=2"
        if r["path"].endswith("_gbs"):  # a bandwidth, not a time
            out.add(r["path"][:-4], "hardware", shape, 0, None, gbs=r["us"])
            continue
        extra = dict(floor_us=r["floor_us"], x_floor=r["x_floor"])
        out.add(r["path"], _provider(r["path"]), shape, r["T"], r["us"], **extra)
    if args.merge and os.path.exists(args.merge):
        fresh = {(r["kernel"], r["shape"], str(r["T"])) for r in out.rows}
        out.extend(
            [r for r in read_rows(args.merge) if (r["kernel"], r["shape"], r["T"]) not in fresh]
        )
    out.write(args.csv)
    by = {(r["path"], r["H"], r["T"]): r for r in rows}
    print(f"peer copy {rows[0]['us']} GB/s, HBM copy {rows[1]['us']} GB/s")
    for hidden in args.hidden:
        print(
            f"\nH={hidden} K=8, us (x floor)"
            + "".join(f"{'T=' + str(t):>16s}" for t in args.tokens)
        )
        for name in sorted(
            {r["path"] for r in rows if r["H"] == hidden},
            key=lambda p: (p.startswith(("symm_v", "symm2_v")), p),
        ):
            cells = [by.get((name, hidden, t)) for t in args.tokens]
            print(
                f"{name:32s}"
                + "".join(
                    f"{c['us']:9.2f} ({c['x_floor']:4.1f})" if c else f"{'-':>16s}" for c in cells
                )
            )


if __name__ == "__main__":
    main()
