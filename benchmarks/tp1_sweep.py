"""World size 1 on ONE GPU: the launch shapes of `fused_tp1`'s kernel per T (whole rows, one program
per row, vs rows split over several programs that exchange their sums of squares), beside the
graph time of an empty one-program launch (what no kernel can go below) and the default config.

    python benchmarks/tp1_sweep.py [--tokens 1 16 64] [--hidden 7168] [--quant none fp8 nvfp4]
        [--csv P] [--jobs 12]

Variants are compiled first in `--jobs` processes (Triton's on-disk cache), then timed in this one.
CUDA graphs, rotated inputs (as benchmarks/tp1_local.py), median us per call.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.harness import Rows, add_common, parser  # noqa: E402
from benchmarks.tp1_local import _spec, _strategy  # noqa: E402
from fusion_bridge.tuning.timing import sets_to_rotate, time_graph  # noqa: E402


QUANT_CODE = {"none": 0, "fp8": 1, "nvfp4": 2, "nvfp4_linear": 2}  # nvfp4: swizzled scales


@triton.jit
def _empty_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 1)


def configs(
    tokens: int,
    hidden: int,
    quant: str,
    num_sms: int,
    prefetches=(0, 1),
    row_warps=(16, 32),
    default_only=False,
    whole_warps=(),
) -> list:
    """The launch configs to time at T: the default, whole rows at `row_warps` warps per 8192
    columns (at least 4) and at each of `whole_warps` warps (absolute), split rows at each chunk
    that fits; each with each of `prefetches` (the L2 prefetch of the row), and programmatic
    dependent launch as in the default. default_only: the default alone."""
    from fusion_bridge.kernels.quant import row_block
    from fusion_bridge.kernels.tp1.configs import Tp1Config, split_ok, tp1_config

    rb = row_block(hidden)
    default = tp1_config(tokens, hidden, QUANT_CODE[quant], num_sms, swizzled=quant == "nvfp4")
    out = [default]
    if default_only:
        return out
    for prefetch in prefetches:
        for warps in row_warps if tokens > 32 else ():  # whole rows lose below (tp1_sweep_h200*)
            out.append(Tp1Config(rb, max(4, warps * rb // 8192), prefetch, default.pdl))
        for warps in whole_warps:
            out.append(Tp1Config(rb, warps, prefetch, default.pdl))
        for chunk in (256, 512) if tokens == 1 else (512, 1024, 2048, 4096):
            for warps in (1, 2, 4, 8, 16):
                per_thread = chunk // (warps * 32)
                config = Tp1Config(chunk, warps, prefetch, default.pdl)
                wanted = per_thread in ((4, 8) if tokens == 1 else (8,))
                if wanted and split_ok(config, tokens, hidden, num_sms):
                    out.append(config)
    return list(dict.fromkeys(out))  # the default once


def _run_one(strat, inp, out, config):
    """One call of the strategy's launcher into `out` (`_outputs`) in `config`."""
    from fusion_bridge.kernels.records import RowSource

    strat._launcher(RowSource.of(inp), out, config)


def _outputs(strat, inp):
    """The launcher's output record of a call on `inp` (the strategy's own outputs)."""
    from fusion_bridge.kernels.records import RowOutputs

    return RowOutputs.of(strat.run(inp), strat._unused)


def _warm(task) -> str:
    """Compile one variant (in a worker process)."""
    hidden, top_k, quant, tokens, config = task
    from fusion_bridge.kernels.tp1.configs import Tp1Config
    from fusion_bridge.oracle.synthetic import make_inputs

    spec = _spec(hidden, top_k, quant, max(tokens, 1))
    strat = _strategy("fused_tp1", spec)
    inp = make_inputs(spec, tokens, seed=0, device="cuda")
    _run_one(strat, inp, _outputs(strat, inp), Tp1Config(*config))
    torch.cuda.synchronize()
    return "ok"


def tokens_for(args, quant: str) -> list:
    return args.tokens if quant == "none" else [t for t in args.tokens if t in args.quant_tokens]


def main() -> None:
    ap = parser(__doc__)
    add_common(
        ap,
        tokens=[1, 4, 16, 32, 64],
        hidden=[7168],
        top_k=8,
        quant=["none", "fp8", "nvfp4"],
        quant_choices=tuple(QUANT_CODE),
    )
    ap.add_argument("--quant-tokens", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--warm-only", action="store_true", help="compile the variants, time nothing")
    ap.add_argument("--prefetch", type=int, nargs="+", default=[0, 1], help="0 / 1 (L2 prefetch)")
    ap.add_argument(
        "--row-warps", type=int, nargs="+", default=[16, 32], help="whole rows: warps per 8192"
    )
    ap.add_argument(
        "--whole-warps", type=int, nargs="*", default=[], help="whole rows: also these warps"
    )
    ap.add_argument("--default-only", action="store_true", help="time the default config alone")
    args = ap.parse_args()
    pick = dict(
        prefetches=args.prefetch,
        row_warps=args.row_warps,
        default_only=args.default_only,
        whole_warps=args.whole_warps,
    )
    from fusion_bridge.oracle.synthetic import make_inputs

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    flag = torch.zeros(1024, dtype=torch.int32, device="cuda")
    empty = time_graph(lambda i: _empty_kernel[(1,)](flag), sets=1, calls=100)
    print(f"empty one-program launch (graph) {empty:.2f} us", flush=True)
    rows = Rows()
    rows.add("empty_launch", "benchmarks", "1 program", 0, empty)
    plan = [
        (hidden, quant, tokens, config)
        for hidden in args.hidden
        for quant in args.quant
        for tokens in tokens_for(args, quant)
        for config in configs(tokens, hidden, quant, num_sms, **pick)
    ]
    # one compile per Triton specialization of T (1, a multiple of 16, other)
    tasks = {(h, q, t if t == 1 else 16 * (t % 16 == 0), tuple(s)): t for h, q, t, s in plan}
    tasks = sorted(((h, args.top_k, q, t, s) for (h, q, _, s), t in tasks.items()), key=str)
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        list(pool.map(_warm, tasks))
    print(f"compiled {len(tasks)} variants", flush=True)
    if args.warm_only:
        return
    for hidden in args.hidden:
        for quant in args.quant:
            spec = _spec(hidden, args.top_k, quant, max(args.tokens))
            strat = _strategy("fused_tp1", spec)
            for tokens in tokens_for(args, quant):
                n = sets_to_rotate(tokens * hidden * 2 * (args.top_k + 5), max_sets=64)
                inputs = [
                    make_inputs(spec, tokens, seed=i, device="cuda", skip_fraction=0.0)
                    for i in range(n)
                ]
                out = _outputs(strat, inputs[0])
                default = tuple(strat._launcher.config_for(tokens))
                for config in configs(tokens, hidden, quant, num_sms, **pick):
                    us = time_graph(lambda i, c=config: _run_one(strat, inputs[i], out, c), sets=n)
                    mark = " (default)" if tuple(config) == default else ""
                    print(
                        f"{quant:5s} H={hidden} T={tokens:4d} chunk={config.columns:5d} "
                        f"warps={config.warps:2d} pf={config.prefetch} {us:7.2f} us{mark}",
                        flush=True,
                    )
                    launch = f"{config.columns}x{config.warps}" + "+pf" * config.prefetch
                    rows.add(
                        "fused_tp1",
                        "fusion_bridge",
                        f"H={hidden} K={args.top_k} {quant} {launch}",
                        tokens,
                        us,
                        default=int(bool(mark)),
                    )
                inputs = None  # free before the next T
    if args.csv:
        rows.write(args.csv)


if __name__ == "__main__":
    main()
