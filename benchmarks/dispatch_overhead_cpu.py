"""Host cost of finalize_epilogue's own work (metadata validation + bucket dispatch) with a no-op
strategy, so no kernel time is included. Runs on CPU; index-value checks (CPU-only) are switched
off to mirror the GPU hot path.

    python benchmarks/dispatch_overhead_cpu.py [--calls 2000] [--rounds 30]
"""

import argparse
import statistics
import sys
import time

from fusion_bridge import EpilogueSpec, FusionBridge
from fusion_bridge.oracle.synthetic import make_inputs


class NoOp:
    name = "noop"

    def run(self, inputs, variant="default"):
        return None


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--calls", type=int, default=2000, help="calls per round")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    spec = EpilogueSpec(hidden_size=7168, top_k=8)
    with FusionBridge(spec, debug=False) as bridge:
        bridge._check_values = False  # as on a GPU without debug mode
        bridge._routes = [(NoOp(), "default", False)] * len(
            bridge._routes
        )  # benchmark only: private state
        samples = []
        inputs = tuple(make_inputs(spec, 1))
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.calls):
                bridge.finalize_epilogue(*inputs)
            samples.append((time.perf_counter() - start) / args.calls * 1e6)
    print(
        f"finalize_epilogue dispatch + validation: {statistics.median(samples):.2f} us per call "
        "(median)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
