"""The items benchmarks/eager_cost.py times, on each rank (the list and what each item is: that
script's docstring): the callables per (quant, T), the interleaved timing rounds, and rank_main,
the function every spawned rank runs, returning one row per item. Nothing runs at import."""

from __future__ import annotations

import statistics
import time
from typing import Callable

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
