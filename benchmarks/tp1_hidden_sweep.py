"""World size 1 on ONE GPU, across hidden sizes: `fused_tp1` (the strategy's own call, its default
launch shape) per hidden size H, output format and T, against the byte floor, with the targets of
the world-size-1 issue checked in the same run.

    python benchmarks/tp1_hidden_sweep.py [--hidden 1024 1344 ...] [--tokens 1 16 64 256 1024 4096]
        [--quant none fp8 nvfp4 nvfp4_linear] [--csv P] [--png P] [--json P] [--jobs 14]

CUDA graphs, inputs rotated past L2, median us per call (fusion_bridge.tuning.timing.time_graph).
Byte floor of a call: (K + 4) * T * H * 2 bytes (K gathered rows, the shared output and the
residual in, residual_out and norm_out out) plus the quantized output (fp8: 1 byte per element;
nvfp4: half a byte plus one scale byte per 16), over the copy bandwidth measured in the same run.

Targets checked (printed, and in --json):
- quant_cost: fp8 / nvfp4 (swizzled and linear scales) within max(+10%, +0.5 us) of the same shape
  unquantized;
- floor_T256: unquantized at T=256 within max(1.25x floor, floor + 2 us);
- floor_large_T: unquantized from T=1024 within max(1.1x floor, floor + 2 us);
- T1: unquantized at T=1 at most 2.5 us.

Kernels are compiled first in --jobs processes (Triton's on-disk cache), then timed here.
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Iterable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.harness import Rows, add_common, parser  # noqa: E402
from benchmarks.tp1_local import QUANT_BYTES, _spec, _strategy  # noqa: E402

# multiples of 64 in [1024, 8192]; not all powers of two, several not multiples of 256 or 512
# (1344, 2496, 2880: GPT-OSS, 3520, 4160, 5440, 6720, 7744)
HIDDEN_SIZES = (1024, 1344, 1536, 2048, 2496, 2880, 3072, 3520, 4096, 4160, 5120, 5440, 6144)
HIDDEN_SIZES += (6720, 7168, 7744, 8192)
TOKENS = (1, 16, 64, 256, 1024, 4096)
FORMATS = ("none", "fp8", "nvfp4", "nvfp4_linear")


def floor_us(tokens: int, hidden: int, top_k: int, fmt: str, copy_gbs: float) -> float:
    """The byte floor of one call in us at `copy_gbs` (bytes read plus written per second / 1e9)."""
    nbytes = (top_k + 4) * tokens * hidden * 2 + QUANT_BYTES[fmt] * tokens * hidden
    return nbytes / (copy_gbs * 1e3)


def check_targets(times: dict, floors: dict) -> list[dict]:
    """The issue's targets over measured `times` {(fmt, H, T): us} with `floors` {(H, T): us of
    the unquantized floor}: one dict per checked point (target, fmt, H, T, us, bound, ok). Pure."""
    out = []

    def add(target, fmt, hidden, tokens, us, bound):
        out.append(
            dict(
                target=target,
                format=fmt,
                H=hidden,
                T=tokens,
                us=round(us, 3),
                bound=round(bound, 3),
                ok=us <= bound,
            )
        )

    for (fmt, hidden, tokens), us in sorted(times.items()):
        if fmt != "none":
            base = times.get(("none", hidden, tokens))
            if base is not None:
                add("quant_cost", fmt, hidden, tokens, us, max(1.10 * base, base + 0.5))
            continue
        floor = floors[(hidden, tokens)]
        if tokens == 256:
            add("floor_T256", fmt, hidden, tokens, us, max(1.25 * floor, floor + 2.0))
        if tokens >= 1024:
            add("floor_large_T", fmt, hidden, tokens, us, max(1.10 * floor, floor + 2.0))
        if tokens == 1:
            add("T1", fmt, hidden, tokens, us, 2.5)
    return out


def _warm(task) -> str:
    """Compile one (H, format) at every T of the sweep (in a worker process)."""
    import torch

    from fusion_bridge.oracle.synthetic import make_inputs

    hidden, top_k, fmt, tokens_list = task
    spec = _spec(hidden, top_k, fmt, max(tokens_list))
    strat = _strategy("fused_tp1", spec)
    for tokens in tokens_list:
        strat.run(make_inputs(spec, tokens, seed=0, device="cuda"))
    torch.cuda.synchronize()
    return f"{fmt} H={hidden}"


def _plot(times: dict, floors: dict, tokens_list: Iterable[int], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib (the `plot` extra): no PNG", flush=True)
        return None
    fmts = sorted({f for f, _, _ in times}, key=FORMATS.index)
    fig, axes = plt.subplots(1, len(fmts), figsize=(5 * len(fmts), 4.5), sharey=True, squeeze=False)
    for ax, fmt in zip(axes[0], fmts):
        for tokens in tokens_list:
            hs = sorted(h for f, h, t in times if f == fmt and t == tokens)
            ax.plot(hs, [times[(fmt, h, tokens)] / floors[(h, tokens)] for h in hs], "o-", ms=3)
            ax.lines[-1].set_label(f"T={tokens}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(f"fused_tp1, {fmt}: time / unquantized byte floor")
        ax.set_xlabel("hidden size H")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("x floor")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    ap = parser(__doc__)
    add_common(
        ap,
        tokens=TOKENS,
        hidden=HIDDEN_SIZES,
        top_k=8,
        quant=FORMATS,
        quant_choices=FORMATS,
        csv_default="benchmarks/results/tp1_hidden_sweep_h200.csv",
    )
    ap.add_argument("--png", default=None, help="the plot (default: the CSV's path, .png)")
    ap.add_argument("--json", default=None, help="the target checks as JSON")
    ap.add_argument("--jobs", type=int, default=14, help="compile processes")
    args = ap.parse_args()
    for hidden in args.hidden:
        if hidden % 64 or not 64 <= hidden:
            ap.error(f"--hidden: multiples of 64 expected, got {hidden}")
    import torch

    if not torch.cuda.is_available():
        sys.exit("tp1_hidden_sweep.py needs a CUDA GPU (one is enough)")
    from fusion_bridge.oracle.synthetic import make_inputs
    from fusion_bridge.tuning.timing import copy_bandwidth_gbs, sets_to_rotate, time_graph

    tasks = [(h, args.top_k, f, list(args.tokens)) for h in args.hidden for f in args.quant]
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        for i, done in enumerate(pool.map(_warm, tasks), 1):
            print(f"compiled {i}/{len(tasks)}: {done}", flush=True)
    bw = copy_bandwidth_gbs(1 << 30)
    rows = Rows()
    rows.add("hbm_copy", "hardware", "1 GiB", 0, None, gbs=round(bw, 1))
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    times, floors = {}, {}
    for hidden in args.hidden:
        for fmt in args.quant:
            spec = _spec(hidden, args.top_k, fmt, max(args.tokens))
            strat = _strategy("fused_tp1", spec)
            for tokens in args.tokens:
                n = sets_to_rotate(tokens * hidden * 2 * (args.top_k + 5), max_sets=64)
                sets = [
                    make_inputs(spec, tokens, seed=i, device="cuda", skip_fraction=0.0)
                    for i in range(n)
                ]
                us = time_graph(lambda i: strat.run(sets[i]), sets=n)
                floor = floor_us(tokens, hidden, args.top_k, fmt, bw)
                floors[(hidden, tokens)] = floor_us(tokens, hidden, args.top_k, "none", bw)
                times[(fmt, hidden, tokens)] = us
                rows.add(
                    "fused_tp1",
                    "fusion_bridge",
                    f"H={hidden} K={args.top_k} {fmt}",
                    tokens,
                    us,
                    floor_us=round(floor, 3),
                    x_floor=round(us / floor, 3),
                )
                print(
                    f"{fmt:12s} H={hidden:5d} T={tokens:5d} {us:8.2f} us  floor {floor:7.2f}"
                    f"  x{us / floor:5.2f}",
                    flush=True,
                )
                sets = None  # free before the next T
            strat = None
            torch.cuda.empty_cache()
    checks = check_targets(times, floors)
    missed = [c for c in checks if not c["ok"]]
    print(f"\ntargets: {len(checks) - len(missed)} of {len(checks)} points met", flush=True)
    for c in missed:
        print(
            f"  missed {c['target']:13s} {c['format']:12s} H={c['H']:5d} T={c['T']:5d} "
            f"{c['us']:8.2f} us > {c['bound']:8.2f}",
            flush=True,
        )
    if args.csv:
        rows.write(args.csv)
        png = _plot(times, floors, args.tokens, args.png or os.path.splitext(args.csv)[0] + ".png")
        if png:
            print(f"wrote {png}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_gbs=round(bw, 1), checks=checks), f, indent=1)
        print(f"wrote {args.json}", flush=True)


if __name__ == "__main__":
    main()
