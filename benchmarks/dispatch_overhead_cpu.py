"""Host cost of finalize_epilogue's own work (metadata validation + bucket dispatch) with a no-op
strategy, so no kernel time is included. Runs on CPU; index-value checks (CPU-only) are switched off
to
mirror the GPU hot path.

    python benchmarks/dispatch_overhead_cpu.py
"""

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
    spec = EpilogueSpec(hidden_size=7168, top_k=8)
    with FusionBridge(spec, debug=False) as bridge:
        bridge._check_values = False  # as on a GPU without debug mode
        bridge._routes = [(NoOp(), "default", False)] * len(
            bridge._routes
        )  # benchmark only: private state
        args = tuple(make_inputs(spec, 1))
        samples = []
        for _ in range(30):
            start = time.perf_counter()
            for _ in range(2000):
                bridge.finalize_epilogue(*args)
            samples.append((time.perf_counter() - start) / 2000 * 1e6)
    print(
        f"finalize_epilogue dispatch + validation: {statistics.median(samples):.2f} us per call "
        "(median)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
