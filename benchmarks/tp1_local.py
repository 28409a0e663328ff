"""World size 1 on ONE GPU: our one-launch kernel (`fused_tp1`: the one-shot kernel with the
exchange left out) per T beside the byte floor and beside today's two-launch path
(`local_fused_nccl` at world size 1: our finalize kernel, then our add+RMSNorm kernel), in one
run; the one-shot kernel with W=2 ranks emulated on this GPU as a measure of the protocol's cost
(arrival checks, slot rotation, clears: the emulated ranks share SMs and L2, so it is no two-GPU
prediction); eager cost at T=1.

    python benchmarks/tp1_local.py [--tokens 1 16 64 ...] [--hidden 7168 4096] [--sweep] [--csv P]
        [--pdl-ab] [--no-two-launch]

CUDA graphs, inputs rotated past L2, median us per call. Byte floor of a one-launch call:
(K + 4) * T * H * 2 bytes (K gathered rows, the shared output and the residual in, residual_out and
norm_out out) plus the quantized output, over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.harness import Rows, add_common, parser  # noqa: E402
from fusion_bridge.tuning.timing import (  # noqa: E402
    copy_bandwidth_gbs,
    sets_to_rotate,
    time_eager,
    time_graph,
    time_graphs_per_rank,
)

# per element of norm_out; nvfp4_linear: nvfp4 with linear (unswizzled) scales
QUANT_BYTES = {"none": 0.0, "fp8": 1.0, "nvfp4": 0.5 + 1 / 16, "nvfp4_linear": 0.5 + 1 / 16}


def _spec(hidden, top_k, quant, max_tokens):
    from fusion_bridge.spec import EpilogueSpec, QuantSpec

    q = {
        "none": QuantSpec.none(),
        "fp8": QuantSpec.fp8(0.05),
        "nvfp4": QuantSpec.nvfp4(336.0),
        "nvfp4_linear": QuantSpec.nvfp4(336.0, "linear"),
    }
    return EpilogueSpec(
        hidden_size=hidden,
        top_k=top_k,
        routed_scaling_factor=2.5,
        quant=q[quant],
        max_tokens=max_tokens,
    )


def _strategy(name, spec):
    from fusion_bridge.environment import detect
    from fusion_bridge.registry import strategy_class

    dev = torch.device("cuda", 0)
    strat = strategy_class(name)(spec, detect(device=dev, probe_flashinfer=False), None, dev)
    strat.prepare()
    return strat


def main() -> None:
    ap = parser(__doc__)
    add_common(
        ap,
        tokens=[1, 16, 64, 256, 1024, 4096, 8192],
        hidden=[7168, 4096],
        top_k=8,
        quant=["none", "fp8", "nvfp4"],
    )
    ap.add_argument("--sweep", action="store_true", help="also sweep the warps per row program")
    ap.add_argument("--emulated", type=int, nargs="*", default=[1, 16, 64, 256])
    ap.add_argument(
        "--pdl-ab",
        action="store_true",
        help="also time the default launch config with programmatic dependent launch off and on "
        "(twice each, alternating), back to back and each after a torch kernel writing its "
        "routing weights",
    )
    ap.add_argument("--no-two-launch", action="store_true", help="skip the two-launch rows")
    args = ap.parse_args()
    from fusion_bridge.kernels.symm import oneshot as symm_oneshot
    from fusion_bridge.kernels.quant import row_block
    from fusion_bridge.kernels.records import RowOutputs, RowSource
    from fusion_bridge.testing.symm_oneshot_rig import call_records, emulated_group
    from fusion_bridge.oracle.synthetic import make_inputs

    bw = copy_bandwidth_gbs(1 << 30)
    rows = Rows()
    rows.add("hbm_copy", "hardware", "1 GiB", 0, None, gbs=round(bw, 1))
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    top_k, cap = args.top_k, max(args.tokens)

    def emit(path, quant, hidden, tokens, us, floor):
        x = us / floor if floor else 0
        shape = f"H={hidden} K={top_k} {quant}"
        extra = dict(floor_us=round(floor, 2), x_floor=round(x, 3)) if floor else {}
        rows.add(path, "fusion_bridge", shape, tokens, us, **extra)
        print(
            f"{path:26s} {quant:5s} H={hidden} T={tokens:5d} {us:9.2f} us  floor {floor:8.2f}"
            f"  x{x:5.2f}",
            flush=True,
        )

    for hidden in args.hidden:
        for quant in args.quant:
            spec = _spec(hidden, top_k, quant, cap)
            one, two = _strategy("fused_tp1", spec), _strategy("local_fused_nccl", spec)
            rb = row_block(hidden)
            for tokens in args.tokens:
                nbytes = (top_k + 4) * tokens * hidden * 2 + QUANT_BYTES[quant] * tokens * hidden
                floor = nbytes / (bw * 1e3)  # bytes / (GB/s) -> us
                n = sets_to_rotate(tokens * hidden * 2 * (top_k + 5), max_sets=64)
                sets = [
                    make_inputs(spec, tokens, seed=i, device="cuda", skip_fraction=0.0)
                    for i in range(n)
                ]
                emit(
                    "one_launch",
                    quant,
                    hidden,
                    tokens,
                    time_graph(lambda i: one.run(sets[i]), sets=n),
                    floor,
                )
                if not args.no_two_launch:
                    emit(
                        "two_launch",
                        quant,
                        hidden,
                        tokens,
                        time_graph(lambda i: two.run(sets[i]), sets=n),
                        floor,
                    )
                if args.pdl_ab:
                    for path, us in _pdl_ab(one, sets, n, tokens, hidden):
                        emit(path, quant, hidden, tokens, us, floor)
                if args.sweep:
                    out = RowOutputs.of(one.run(sets[0]), one._unused)
                    # whole rows at each warps count, PDL as in the strategy's default config
                    launcher = one._launcher
                    base = launcher.config_for(tokens)
                    for warps in (4, 8, 16, 32):

                        def fn(i, w=warps):
                            config = base._replace(columns=rb, warps=w, prefetch=0)
                            launcher(RowSource.of(sets[i]), out, config)

                        emit(
                            f"one_launch_w{warps}",
                            quant,
                            hidden,
                            tokens,
                            time_graph(fn, sets=n),
                            floor,
                        )
                if tokens == 1 and quant == "none" and hidden == args.hidden[0]:
                    # eager: the strategy's call vs one bare cached launch of the same kernel
                    out = RowOutputs.of(one.run(sets[0]), one._unused)
                    launch = one._launcher.bound(RowSource.of(sets[0]), out)

                    def bare(i):
                        launch()

                    emit(
                        "eager_one_launch",
                        quant,
                        hidden,
                        1,
                        time_eager(lambda i: one.run(sets[i]), sets=n),
                        0,
                    )
                    emit("eager_bare_cached_launch", quant, hidden, 1, time_eager(bare, sets=n), 0)
                    emit(
                        "eager_two_launch",
                        quant,
                        hidden,
                        1,
                        time_eager(lambda i: two.run(sets[i]), sets=n),
                        0,
                    )
                del sets
            torch.cuda.empty_cache()
    # the protocol's cost: the one-shot kernel with W=2 ranks emulated on this GPU (own streams)
    hidden = args.hidden[0]
    spec = _spec(hidden, top_k, "none", 2048)
    for tokens in args.emulated:
        world = 2
        group = emulated_group(spec, world, 2048, device="cuda", timeout=10_000_000)
        n = sets_to_rotate(world * tokens * hidden * 2 * (top_k + 5), max_sets=32)
        sets = [
            [
                make_inputs(spec, tokens, rank=r, seed=i, device="cuda", skip_fraction=0.0)
                for r in range(world)
            ]
            for i in range(n)
        ]
        none = torch.empty(0, dtype=torch.uint8, device="cuda")
        outs = [
            (
                torch.empty(tokens, hidden, dtype=spec.dtype, device="cuda"),
                torch.empty(tokens, hidden, dtype=spec.dtype, device="cuda"),
                none,
                none,
            )
            for _ in range(world)
        ]

        def rank_fn(r):
            launcher = symm_oneshot.OneshotLauncher(group.layers[r])
            return lambda i: launcher(*call_records(sets[i][r], outs[r]))

        us = time_graphs_per_rank([rank_fn(r) for r in range(world)], sets=n)
        emit("emulated_w2_oneshot", "none", hidden, tokens, us, 0)
        torch.cuda.synchronize()
        assert not group.errs.any(), group.errs
    if args.csv:
        rows.write(args.csv)


def _pdl_ab(one, sets, n, tokens, hidden):
    """The strategy's default launch config with pdl 0 and 1 (alternating, two rounds): back to
    back ("pdl0" / "pdl1"), and each call after a torch kernel that rewrites its routing weights
    (the same values: "after_torch_pdl0" / "_pdl1"), as a router or GEMM would before it."""
    from fusion_bridge.kernels.records import RowOutputs, RowSource

    outs = RowOutputs.of(one.run(sets[0]), one._unused)
    launcher = one._launcher
    base = launcher.config_for(tokens)
    weights = [s.expert_weights.clone() for s in sets]
    got = []
    for _ in range(2):
        for pdl in (0, 1):
            config = base._replace(pdl=pdl)

            def call(i, config=config):
                launcher(RowSource.of(sets[i]), outs, config)

            def after_torch(i, call=call):
                sets[i].expert_weights.copy_(weights[i])
                call(i)

            got.append((f"pdl{pdl}", time_graph(call, sets=n)))
            got.append((f"after_torch_pdl{pdl}", time_graph(after_torch, sets=n)))
    return got


if __name__ == "__main__":
    main()
