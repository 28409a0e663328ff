"""Host cost of an eager call (issue 15): wall time per call over back-to-back calls, next to the
raw launches it is made of, FlashInfer's fused MoE-finalize kernel called directly (the ratio
anchor) and the selected strategy's graph-timed GPU time.

    python -m benchmarks.eager_cost     # TP1 and TP2, H=7168 K=8, T=1 and 64, none and nvfp4
    python -m benchmarks.eager_cost --world-sizes 2 --tokens 1 --quant none --rounds 5

Per (world size, quant, T), every rank times each item in interleaved rounds of `--calls` calls
(default 300): `wall` stops after a synchronize (what a caller waits for), `host` before it (the
time to issue the calls). The median over rounds is taken per rank and the maximum over ranks
reported. Items (n/a where they cannot run, e.g. FlashInfer's comm kernels at TP1):

- finalize_epilogue: the bridge's call (validation, dispatch, the selected strategy), its outputs
  allocated per call;
- finalize_epilogue_out: the same call with `out=` outputs the caller preallocated once (as a
  serving engine that owns its buffers calls it; `allocate_outputs(spec, T, device)`);
- strategy_run: the selected strategy's own run for T (the eager plan's, if the bridge has one);
- fused_tp1_kernel_cached (world size 1, where the eager route is fused_tp1; issue 50's anchor):
  the kernel the call runs (fused_tp1's launch for T, its config), through the launch the call
  makes (the plan's bound launch, kernels/launch_cache.py), records built once, outputs
  preallocated (`Tp1Launcher.bound`);
- finalize_kernel_normal / finalize_kernel_cached: our finalize kernel alone, Triton's
  `kernel[grid]` launch vs the launch cache (kernels/launch_cache.py), same precomputed launch
  shape, preallocated output;
- finalize_add_into: the launch function the strategies use (shape lookup + cached launch);
- fi_allreduce_public / fi_allreduce_prebound: FlashInfer's AR+residual+RMSNorm, its Python wrapper
  vs the pre-bound compiled call (fusion_bridge/strategies/flashinfer_calls.py);
- fi_moe_finalize_public (the anchor) / fi_moe_finalize_prebound: FlashInfer's fused MoE-finalize
  kernel called directly, weights pre-cast to the activation dtype;
- graph_selected / graph_fi_moe_finalize: CUDA-graph GPU time per call
  (fusion_bridge.tuning.timing.time_graph) of the graph plan's strategy and of the anchor.

Writes benchmarks/results/eager_cost_h200.csv (--csv; the harness schema, benchmarks/harness.py:
us_median is the wall time, extra holds the host time, the routes and notes) and prints a table
with the ratios the issues' targets are stated in, then issue 50's target check: at world size 1,
finalize_epilogue <= 2x fused_tp1_kernel_cached (same run, medians of the alternating rounds),
pass or miss per quant and T, and on the same line finalize_epilogue_out's ratio to the same
anchor (whose outputs are preallocated too). `--breakdown` then times each stage of the
world-size-1 eager call on its own, both paths (benchmarks/eager_breakdown.py), in the same
process. Nothing runs at import.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Callable, Optional

DEFAULT_OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "eager_cost_h200.csv"
)
H, K = 7168, 8
ITEMS = (
    "finalize_epilogue",
    "finalize_epilogue_out",
    "strategy_run",
    "fused_tp1_kernel_cached",
    "finalize_kernel_normal",
    "finalize_kernel_cached",
    "finalize_add_into",
    "fi_allreduce_public",
    "fi_allreduce_prebound",
    "fi_moe_finalize_public",
    "fi_moe_finalize_prebound",
)


def _spec(quant: str):
    from fusion_bridge import EpilogueSpec, QuantSpec

    return EpilogueSpec(
        hidden_size=H,
        top_k=K,
        quant=QuantSpec.nvfp4(336.0) if quant == "nvfp4" else QuantSpec.none(),
    )


def _timed_rounds(
    fns: dict[str, Callable[[], object]], calls: int, rounds: int, barrier: Callable[[], None]
) -> dict[str, tuple[float, float]]:
    """{name: (median wall us per call, median host us per call)}, rounds interleaved across
    items."""
    import torch

    for fn in fns.values():  # warm: compiles, caches, workspaces
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    wall: dict[str, list[float]] = {n: [] for n in fns}
    host: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            barrier()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            issued = time.perf_counter()
            torch.cuda.synchronize()
            end = time.perf_counter()
            host[name].append((issued - start) / calls * 1e6)
            wall[name].append((end - start) / calls * 1e6)
    return {n: (statistics.median(wall[n]), statistics.median(host[n])) for n in fns}


def _finalize_launchers(inp, spec):
    """Our finalize kernel three ways, into one preallocated output, same launch shape."""
    import torch

    from fusion_bridge.kernels import finalize_add as fa

    tokens = inp.expanded_idx_to_permuted_idx.shape[0]
    out = torch.empty(tokens, H, dtype=inp.gemm2_out.dtype, device=inp.gemm2_out.device)
    shared = inp.shared_output
    blocks, constexprs, warps = fa._launch_shape(H, K, shared is not None, tokens <= 32, None, None)
    routed = (
        inp.gemm2_out,
        inp.expanded_idx_to_permuted_idx,
        inp.expert_weights,
        out if shared is None else shared,
    )
    if fa._finalize_add_kernel.arg_names[0] == "src":  # the kernel takes a record (issue 37)
        from fusion_bridge.kernels.records import RowSource

        routed = (RowSource(*routed, None, None),)
    args = (*routed, out, H, float(spec.routed_scaling_factor))
    named = dict(zip(fa._LAUNCH.constexpr_names, constexprs))
    grid = (tokens, blocks)
    kernel, launch = fa._finalize_add_kernel, fa._LAUNCH
    return {
        "finalize_kernel_normal": lambda: kernel[grid](*args, **named, num_warps=warps),
        "finalize_kernel_cached": lambda: launch(grid, args, constexprs, warps),
        "finalize_add_into": lambda: fa.finalize_add_into(
            out,
            inp.gemm2_out,
            inp.expanded_idx_to_permuted_idx,
            inp.expert_weights,
            shared,
            spec.routed_scaling_factor,
        ),
    }


def _flashinfer_items(inp, spec, group, world_size, rank) -> tuple[dict, dict, list[str]]:
    """FlashInfer's AR+norm and fused MoE-finalize, public wrapper vs pre-bound; (items, anchor fn,
    notes)."""
    import flashinfer.comm as fi_comm
    import torch

    from fusion_bridge.strategies import flashinfer_calls, flashinfer_common as fic

    workspace = fic.acquire_workspace(group, spec, world_size)
    tokens = inp.expanded_idx_to_permuted_idx.shape[0]
    partial = torch.randn(tokens, H, dtype=spec.dtype, device=inp.residual.device)
    residual_out, norm_out = torch.empty_like(inp.residual), torch.empty_like(inp.residual)
    moe_residual_out, moe_norm_out = torch.empty_like(inp.residual), torch.empty_like(inp.residual)
    weights = inp.expert_weights.to(
        spec.dtype
    )  # pre-cast: FlashInfer reads them in the activation dtype
    pattern = fi_comm.AllReduceFusionPattern.kARResidualRMSNorm
    ar = flashinfer_calls.AllReduceFusionCall(
        fi_comm,
        workspace,
        world_size=world_size,
        rank=rank,
        hidden=H,
        dtype=spec.dtype,
        pattern=pattern,
        scale_factor=None,
        layout=None,
        eps=spec.eps,
        weight_bias=spec.weight_bias,
    )
    moe = flashinfer_calls.MoeFinalizeCall(
        fi_comm,
        workspace,
        world_size=world_size,
        rank=rank,
        eps=spec.eps,
        routed_scaling_factor=spec.routed_scaling_factor,
        weight_bias=spec.weight_bias,
    )

    def ar_public():
        fi_comm.trtllm_allreduce_fusion(
            allreduce_in=partial,
            world_size=world_size,
            world_rank=rank,
            token_num=tokens,
            hidden_dim=H,
            workspace_ptrs=workspace.workspace_tensor,
            launch_with_pdl=False,
            trigger_completion_at_end=True,
            fp32_acc=True,
            pattern_code=pattern,
            use_oneshot=True,
            allreduce_out=None,
            residual_in=inp.residual,
            residual_out=residual_out,
            norm_out=norm_out,
            quant_out=None,
            scale_out=None,
            rms_gamma=inp.gamma,
            rms_eps=spec.eps,
            scale_factor=None,
            layout_code=None,
            weight_bias=spec.weight_bias,
        )

    def moe_public():
        fi_comm.trtllm_moe_finalize_allreduce_fusion(
            allreduce_in=inp.gemm2_out,
            residual_in=inp.residual,
            norm_weight=inp.gamma,
            expanded_idx_to_permuted_idx=inp.expanded_idx_to_permuted_idx,
            norm_out=moe_norm_out,
            residual_out=moe_residual_out,
            quant_out=None,
            scale_out=None,
            workspace_ptrs=workspace.workspace_tensor,
            launch_with_pdl=False,
            world_rank=rank,
            world_size=world_size,
            eps=spec.eps,
            shared_expert_output=inp.shared_output,
            expert_scale_factor=weights,
            routed_scaling_factor=spec.routed_scaling_factor,
            weight_bias=spec.weight_bias,
        )

    items = {
        "fi_allreduce_public": ar_public,
        "fi_allreduce_prebound": lambda: ar(
            partial, tokens, True, inp.residual, residual_out, norm_out, None, None, inp.gamma
        ),
        "fi_moe_finalize_public": moe_public,
        "fi_moe_finalize_prebound": lambda: moe(
            inp.gemm2_out,
            inp.residual,
            inp.gamma,
            inp.expanded_idx_to_permuted_idx,
            moe_norm_out,
            moe_residual_out,
            None,
            None,
            inp.shared_output,
            weights,
        ),
    }
    notes = [flashinfer_calls.describe(ar), flashinfer_calls.describe(moe)]
    release = lambda: fic.release_workspace(group, spec, world_size, workspace)  # noqa: E731
    return items, {"release": release, "anchor": moe_public}, notes


def rank_main(
    rank: int, world_size: int, quants: list[str], token_counts: list[int], calls: int, rounds: int
) -> list[dict]:
    import inspect

    import torch
    import torch.distributed as dist

    from benchmarks.eager_breakdown import tp1_anchor
    from fusion_bridge import FusionBridge
    from fusion_bridge.epilogue_tensors import allocate_outputs
    from fusion_bridge.kernels import finalize_add as fa
    from fusion_bridge.oracle.synthetic import make_inputs
    from fusion_bridge.tuning.timing import time_graph

    group = dist.group.WORLD
    barrier = (lambda: dist.barrier(group)) if world_size > 1 else (lambda: None)
    rows = []
    for quant in quants:
        spec = _spec(quant)
        with FusionBridge(spec, group if world_size > 1 else None, debug=False) as bridge:
            eager_kw = (
                {"eager": True}
                if "eager" in inspect.signature(bridge.selected_run).parameters
                else {}
            )
            for tokens in token_counts:
                inp = make_inputs(spec, tokens, rank=rank, device=bridge.device)
                args = tuple(inp)
                raw = bridge.selected_run(tokens, **eager_kw)
                graph_raw = bridge.selected_run(tokens)
                out = allocate_outputs(spec, tokens, bridge.device)  # the caller's, made once
                fns: dict[str, Callable[[], object]] = {
                    "finalize_epilogue": lambda: bridge.finalize_epilogue(*args),
                    "finalize_epilogue_out": lambda: bridge.finalize_epilogue(*args, out=out),
                    "strategy_run": lambda: raw(inp),
                }
                if world_size == 1:
                    fns.update(tp1_anchor(bridge, inp, tokens, eager_kw))
                fns.update(_finalize_launchers(inp, spec))
                notes = [f"launch cache: {fa._LAUNCH.disabled_reason or 'on'}"]
                fi = None
                if world_size in (2, 4, 8, 16):
                    try:
                        items, fi, fi_notes = _flashinfer_items(
                            inp, spec, bridge.group, world_size, rank
                        )
                        fns.update(items)
                        notes += fi_notes
                    except Exception as exc:  # reported, never silently missing
                        notes.append(f"flashinfer items skipped: {type(exc).__name__}: {exc}")
                timed = _timed_rounds(fns, calls, rounds, barrier)
                notes[0] = (
                    f"launch cache: {fa._LAUNCH.disabled_reason or 'on'}"  # after the warm-up
                )
                graph = {"graph_selected": time_graph(lambda i: graph_raw(inp), sets=1, calls=20)}
                if fi is not None:
                    graph["graph_fi_moe_finalize"] = time_graph(
                        lambda i: fi["anchor"](), sets=1, calls=20
                    )
                    fi["release"]()
                route = {
                    "route_graph": ":".join(bridge.route_for(tokens) or ()),
                    "route_eager": ":".join(bridge.route_for(tokens, **eager_kw) or ()),
                }
                for name, (wall, host) in timed.items():
                    rows.append(
                        {
                            "world_size": world_size,
                            "quant": quant,
                            "tokens": tokens,
                            "item": name,
                            "us_wall": wall,
                            "us_host": host,
                            **route,
                            "notes": "; ".join(notes),
                        }
                    )
                for name, us in graph.items():
                    rows.append(
                        {
                            "world_size": world_size,
                            "quant": quant,
                            "tokens": tokens,
                            "item": name,
                            "us_wall": us,
                            "us_host": float("nan"),
                            **route,
                            "notes": "; ".join(notes),
                        }
                    )
                torch.cuda.synchronize()
    return rows


def max_over_ranks(per_rank: list[list[dict]]) -> list[dict]:
    merged: dict[tuple, dict] = {}
    for rows in per_rank:
        for r in rows:
            key = (r["world_size"], r["quant"], r["tokens"], r["item"])
            if key not in merged:
                merged[key] = dict(r)
            else:
                for col in ("us_wall", "us_host"):
                    if r[col] == r[col]:  # not NaN
                        merged[key][col] = max(merged[key][col], r[col])
    return list(merged.values())


def ratios(rows: list[dict]) -> list[dict]:
    """Per (world size, quant, T): the issue's target ratios."""
    by = {}
    for r in rows:
        by.setdefault((r["world_size"], r["quant"], r["tokens"]), {})[r["item"]] = r["us_wall"]
    out = []
    for (ws, quant, tokens), v in sorted(by.items()):
        line = {"world_size": ws, "quant": quant, "tokens": tokens}
        fe, anchor, graph = (
            v.get("finalize_epilogue"),
            v.get("fi_moe_finalize_public"),
            v.get("graph_selected"),
        )
        if fe is not None and anchor:
            line["eager_vs_flashinfer_direct"] = round(fe / anchor, 3)
        if fe is not None and graph:
            line["eager_vs_graph_gpu"] = round(fe / graph, 3)
        if fe is not None and v.get("strategy_run") is not None:
            line["bridge_overhead_us"] = round(fe - v["strategy_run"], 2)
        if fe is not None and v.get("fused_tp1_kernel_cached"):
            line["eager_vs_tp1_kernel"] = round(fe / v["fused_tp1_kernel_cached"], 3)
        fe_out = v.get("finalize_epilogue_out")
        if fe_out is not None and v.get("fused_tp1_kernel_cached"):
            line["eager_out_vs_tp1_kernel"] = round(fe_out / v["fused_tp1_kernel_cached"], 3)
        out.append(line)
    return out


def write_csv(path: str, rows: list[dict]) -> None:
    """The rows in the harness schema: us_median the wall time per call, extra the rest."""
    from benchmarks.harness import Rows

    out = Rows()
    for r in sorted(rows, key=lambda r: (r["world_size"], r["quant"], r["tokens"], r["item"])):
        provider = "flashinfer" if "fi_" in r["item"] else "fusion_bridge"
        shape = f"TP{r['world_size']} H={H} K={K} {r['quant']}"
        extra = {k: r[k] for k in ("route_graph", "route_eager", "notes")}
        if r["us_host"] == r["us_host"]:  # not NaN: an eager item
            extra["us_host"] = round(r["us_host"], 2)
        out.add(r["item"], provider, shape, r["tokens"], r["us_wall"], **extra)
    out.write(path)


def print_table(rows: list[dict]) -> None:
    from benchmarks.eager_breakdown import target_check

    configs = sorted({(r["world_size"], r["quant"], r["tokens"]) for r in rows})
    items = list(ITEMS) + ["graph_selected", "graph_fi_moe_finalize"]
    value = {(r["world_size"], r["quant"], r["tokens"], r["item"]): r["us_wall"] for r in rows}
    head = ["item (us per call, wall)"] + [f"TP{w} {q} T={t}" for w, q, t in configs]
    width = [max(len(h), 26) for h in head]
    print("  ".join(h.ljust(w) for h, w in zip(head, width)))
    for item in items:
        cells = [item] + [
            f"{value[(w, q, t, item)]:.2f}" if (w, q, t, item) in value else "n/a"
            for w, q, t in configs
        ]
        print("  ".join(c.ljust(w) for c, w in zip(cells, width)))
    print()
    for line in ratios(rows):
        print(line)
    routes = {
        (r["world_size"], r["quant"], r["tokens"]): (r["route_graph"], r["route_eager"], r["notes"])
        for r in rows
    }
    for cfg, (graph, eager, notes) in sorted(routes.items()):
        print(f"TP{cfg[0]} {cfg[1]} T={cfg[2]}: graph route {graph}, eager route {eager}; {notes}")
    print()
    for line in target_check(ratios(rows)):
        print(line)


def main(argv: Optional[list[str]] = None) -> int:
    from benchmarks.harness import add_common, parser

    ap = parser(__doc__)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    add_common(
        ap,
        tokens=[1, 64],
        quant=["none", "nvfp4"],
        quant_choices=["none", "nvfp4"],
        csv_default=DEFAULT_OUT,
    )
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="then time each stage of the world-size-1 eager call, allocating and out= "
        "(benchmarks/eager_breakdown.py)",
    )
    args = ap.parse_args(argv)
    import torch

    from fusion_bridge.cli.launch import run_distributed

    try:  # by its importable name, so the spawned ranks find it however this file was started
        from benchmarks.eager_cost import rank_main as fn
    except ImportError:
        fn = rank_main
    if not torch.cuda.is_available():
        print("eager_cost: needs CUDA GPUs (one per rank)", file=sys.stderr)
        return 2
    rows = []
    for world_size in args.world_sizes:
        per_rank = run_distributed(
            fn,
            world_size,
            args.quant,
            args.tokens,
            args.calls,
            args.rounds,
            backend="nccl",
            timeout_s=1800.0,
        )
        rows += max_over_ranks(per_rank)
    write_csv(args.csv, rows)
    print_table(rows)
    if args.breakdown:
        from benchmarks import eager_breakdown

        print()
        eager_breakdown.print_rows(
            eager_breakdown.breakdown(args.quant, args.tokens, args.calls, args.rounds, "cuda")
        )
    return 0


if __name__ == "__main__":
    sys.path.insert(
        0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    )  # the repository root
    sys.exit(main())
