"""tune and bench: the commands that time CUDA graphs on this machine's GPUs (one rank per GPU)."""

from __future__ import annotations

import os

from fusion_bridge.cli.common import emit, set_multicast_off, spec_from_args


def visible_nvidia_gpus_without_torch() -> int:
    """GPUs this process could see, from the driver's device files and CUDA_VISIBLE_DEVICES, without
    importing torch (seconds on a cold start): lets `tune` and `bench` refuse a GPU-less machine at
    once. An upper bound; torch's own count decides when this finds enough."""
    import glob

    devices = len(glob.glob("/dev/nvidia[0-9]*"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        listed = [d for d in visible.split(",") if d.strip() and d.strip() != "-1"]
        devices = min(devices, len(listed))
    return devices


def _require_gpus(world_size: int) -> None:
    if visible_nvidia_gpus_without_torch() < world_size:
        raise ValueError(
            f"--world-size {world_size} needs {world_size} CUDA GPU(s) (it times CUDA graphs), "
            f"found {visible_nvidia_gpus_without_torch()} (no NVIDIA device files or "
            "CUDA_VISIBLE_DEVICES hides them)"
        )
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < world_size:
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(
            f"--world-size {world_size} needs {world_size} CUDA GPU(s) (it times CUDA graphs), "
            f"found {found}"
        )


def _on_ranks(fn, world_size: int, *fn_args):
    from fusion_bridge.cli.launch import run_distributed

    if world_size == 1:
        return fn(0, 1, *fn_args)
    return run_distributed(fn, world_size, *fn_args, backend="nccl", timeout_s=3000)[0]


def cmd_tune(args) -> int:
    _require_gpus(args.world_size)  # before any heavy import: a CPU machine hears it at once
    set_multicast_off("tune")
    from fusion_bridge.cli.bench import tune_rank

    table = _on_ranks(tune_rank, args.world_size, spec_from_args(args), not args.json)
    lines = [f"tuned {table['gpu']} TP{table['world_size']}; cached at {table.get('path')}"]
    spread = table.get("spread") or {}
    if spread:
        lines.append(
            f"spread between two passes: {100 * spread['fraction']:.1f}% (90th percentile of "
            f"{spread['cases']} cases): a route replaces the static-order choice only when "
            "faster by more"
        )
    for b in table["plan"]["buckets"]:
        lines.append(
            f"  T <= {b['max_tokens']:6d}: {b['strategy']}:{b['variant']:10s} "
            f"{b['measured_us']:.1f} us  ({b['why']})"
        )
    emit(args, {"table": table}, "\n".join(lines))
    return 0


def cmd_bench(args) -> int:
    _require_gpus(args.world_size)  # before any heavy import: a CPU machine hears it at once
    set_multicast_off("bench")
    from fusion_bridge.cli.bench import bench_rank, plot, rows_from, summary, write_csv

    tokens = [2**i for i in range(args.max_tokens.bit_length()) if 2**i <= args.max_tokens]
    spec = spec_from_args(args)
    result = _on_ranks(bench_rank, args.world_size, spec, tokens, not args.json)
    rows = rows_from(result, args.world_size)
    write_csv(args.csv, rows)
    png = plot(
        rows,
        args.csv.rsplit(".", 1)[0] + ".png",
        f"{result['gpu']} TP{args.world_size} H={spec.hidden_size} K={spec.top_k} "
        f"{spec.dtype_name} "
        f"quant={spec.quant.kind.value}",
    )
    table = summary(rows)
    # hand-written tables (here, in parity and in matrix): tabulate comes only with the optional
    # flashinfer extra, not with torch/triton, and parity and matrix run on CPU installs without it
    text = [
        f"wrote {args.csv}"
        + (
            f" and {png}"
            if png
            else " (no PNG: matplotlib is missing; pip install 'fusion-bridge[plot]')"
        )
    ]
    keys = list(table[0])
    text.append(" ".join(f"{k:>14s}" for k in keys))
    text += [" ".join(f"{str(line.get(k, '')):>14s}" for k in keys) for line in table]
    text.append(f"host overhead (eager, us per call): {result['overhead']}")
    emit(
        args,
        {
            "csv": args.csv,
            "png": png,
            "summary": table,
            "overhead": result["overhead"],
            "rows": rows,
        },
        "\n".join(text),
    )
    return 0
