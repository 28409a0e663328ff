"""Host overhead of finalize_epilogue over the raw kernel launches, eager mode, one GPU.

    CUDA_VISIBLE_DEVICES=0 python benchmarks/host_overhead.py
"""

import json
import sys

from fusion_bridge import EpilogueSpec, FusionBridge, QuantSpec
from fusion_bridge.bench import host_overhead_us


def main() -> int:
    results = []
    for quant in (QuantSpec.none(), QuantSpec.nvfp4(336.0)):
        spec = EpilogueSpec(hidden_size=7168, top_k=8, quant=quant)
        with FusionBridge(spec, debug=False) as bridge:
            for tokens in (1, 64):
                r = host_overhead_us(bridge, tokens)
                r.update(tokens=tokens, quant=quant.kind.value)
                results.append(r)
    for r in results:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
