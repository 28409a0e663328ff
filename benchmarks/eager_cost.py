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
import sys
from typing import Optional

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The script in three modules: the items timed on each rank (eager_cost_items.py), what is made of
# the ranks' rows, the CSV, the table and the target lines (eager_cost_report.py), and the command
# line here. The names tests and callers import from here are re-exported.
from benchmarks.eager_cost_items import H, ITEMS, K, rank_main  # noqa: E402, F401
from benchmarks.eager_cost_report import (  # noqa: E402, F401
    max_over_ranks,
    print_table,
    ratios,
    write_csv,
)

DEFAULT_OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "eager_cost_h200.csv"
)


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

    if not torch.cuda.is_available():
        print("eager_cost: needs CUDA GPUs (one per rank)", file=sys.stderr)
        return 2
    rows = []
    for world_size in args.world_sizes:
        per_rank = run_distributed(
            rank_main,  # from eager_cost_items, by its importable name: the spawned ranks find it
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
    sys.exit(main())
