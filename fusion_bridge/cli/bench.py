"""`python -m fusion_bridge tune` and `bench`: measured selection and the benchmark of every
strategy
and `auto` against each other, in one run, on this machine's GPUs (one rank per GPU, NCCL).

bench writes a long-format CSV (candidate, tokens, us_rotated, us_same_inputs, ...) and a log-log
PNG of time vs T with `auto` highlighted (matplotlib: the `plot` extra).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from fusion_bridge.spec import EpilogueSpec


def _bridge(spec: EpilogueSpec, world_size: int, tuning: str = "auto"):
    from fusion_bridge import FusionBridge

    group = torch.distributed.group.WORLD if world_size > 1 else None
    return FusionBridge(spec, group, debug=False, tuning=tuning)


def tune_rank(rank: int, world_size: int, spec: EpilogueSpec, progress: bool) -> dict:
    with _bridge(spec, world_size, tuning="off") as bridge:
        table = bridge.tune(progress=progress)
        table["plan"] = bridge.plan.to_dict()
        return table


def host_overhead_us(bridge, tokens: int, calls: int = 50, rounds: int = 40) -> dict:
    """Eager host time per call: finalize_epilogue against the selected strategy's run() (the kernel
    launches themselves), interleaved in `rounds` rounds of `calls` calls; medians."""
    import statistics
    from fusion_bridge.oracle.synthetic import make_inputs

    inp = make_inputs(bridge.spec, tokens, device=bridge.device)
    raw = bridge.selected_run(tokens)
    args = (
        inp.gemm2_out,
        inp.expanded_idx_to_permuted_idx,
        inp.expert_weights,
        inp.shared_output,
        inp.residual,
        inp.gamma,
    )
    fns = {"bridge": lambda: bridge.finalize_epilogue(*args), "raw": lambda: raw(inp)}
    samples: dict[str, list[float]] = {"bridge": [], "raw": []}
    for fn in fns.values():
        for _ in range(20):
            fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    bridge_us, raw_us = statistics.median(samples["bridge"]), statistics.median(samples["raw"])
    return {
        "bridge_us": round(bridge_us, 2),
        "raw_us": round(raw_us, 2),
        "overhead_us": round(bridge_us - raw_us, 2),
        "route": ":".join(bridge.route_for(tokens)),
    }


def bench_rank(
    rank: int, world_size: int, spec: EpilogueSpec, tokens: list[int], progress: bool
) -> dict:
    from fusion_bridge.tuning.tables import measure, token_ranges

    with _bridge(spec, world_size, tuning="off") as bridge:
        bridge.tune(buckets=tokens, progress=progress, save=True)
        auto = (
            "auto",
            "planned",
            lambda inp, _variant: bridge.finalize_epilogue(
                inp.gemm2_out,
                inp.expanded_idx_to_permuted_idx,
                inp.expert_weights,
                inp.shared_output,
                inp.residual,
                inp.gamma,
            ),
        )
        candidates = bridge.tuning_candidates() + [auto]
        args = (bridge.spec, bridge.env, bridge.group, bridge.device, candidates, tokens)
        ranges = token_ranges(bridge.statuses)
        rotated = measure(*args, rotate=True, progress=progress, seed=1, token_ranges=ranges)
        same = measure(*args, rotate=False, progress=progress, seed=2, token_ranges=ranges)
        overhead = {t: host_overhead_us(bridge, t) for t in (1, 64)}
        plan = {t: ":".join(bridge.route_for(t)) for t in tokens}
        return {
            "rotated": rotated,
            "same": same,
            "overhead": overhead,
            "plan": plan,
            "gpu": bridge.env.gpu_name,
            "table_path": (bridge.table or {}).get("path"),
        }


def rows_from(result: dict, world_size: int) -> list[dict]:
    """Long format: one row per (candidate, T); candidate is "strategy:variant", or "auto"."""
    rows = []
    for name, variants in result["rotated"].items():
        for variant, per in variants.items():
            label = name if name == "auto" else f"{name}:{variant}"
            for tokens, us in per.items():
                rows.append(
                    {
                        "candidate": label,
                        "tokens": tokens,
                        "world_size": world_size,
                        "us_rotated": round(us, 2),
                        "us_same_inputs": round(result["same"][name][variant][tokens], 2),
                        "auto_picks": result["plan"][tokens] if name == "auto" else "",
                        "gpu": result["gpu"],
                    }
                )
    return rows


def write_csv(path: str, rows: Sequence[dict]) -> None:
    import csv
    import os

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def summary(rows: list[dict]) -> list[dict]:
    """Per T: auto vs the fastest candidate, and vs the best variant of flashinfer_fused,
    local_fused_flashinfer and separate."""
    by_t: dict[int, dict[str, dict]] = {}
    for r in rows:
        by_t.setdefault(r["tokens"], {})[r["candidate"]] = r
    out = []
    for tokens, cands in sorted(by_t.items()):
        auto = cands["auto"]
        line = {"tokens": tokens, "auto_picks": auto["auto_picks"]}
        for mode in ("us_rotated", "us_same_inputs"):
            others = {k: v[mode] for k, v in cands.items() if k != "auto"}
            tag = "rot" if mode == "us_rotated" else "same"
            line[f"auto_{tag}"] = auto[mode]
            line[f"vs_best_{tag}"] = round(auto[mode] / min(others.values()), 3)
            for name in ("flashinfer_fused", "local_fused_flashinfer", "separate"):
                times = [us for label, us in others.items() if label.split(":")[0] == name]
                if times:
                    line[f"vs_{name}_{tag}"] = round(auto[mode] / min(times), 3)
        out.append(line)
    return out


def plot(rows: list[dict], path: str, title: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, mode, label in (
        (axes[0], "us_rotated", "inputs rotated beyond L2"),
        (axes[1], "us_same_inputs", "same inputs replayed"),
    ):
        for cand in sorted({r["candidate"] for r in rows}):
            pts = sorted((r["tokens"], r[mode]) for r in rows if r["candidate"] == cand)
            is_auto = cand == "auto"
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                label=cand,
                linewidth=3.5 if is_auto else 1.2,
                color="black" if is_auto else None,
                zorder=10 if is_auto else 1,
                alpha=1.0 if is_auto else 0.8,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("us per call (CUDA graph, median)")
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
