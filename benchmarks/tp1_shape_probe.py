"""World size 1 on ONE GPU: `fused_tp1`'s default launch config beside whole rows and split rows of
512 / 1024 columns, for one output format, per hidden size and T (the probe behind the swizzled
NVFP4 config rule in `kernels/tp1/configs.py`).

    python benchmarks/tp1_shape_probe.py [--hidden 2880 3072] [--tokens 1 64] [--quant nvfp4]

CUDA graphs, inputs rotated past L2, median us per call of the strategy's own launch at each config.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.harness import add_common, parser  # noqa: E402
from benchmarks.tp1_hidden_sweep import FORMATS  # noqa: E402


def main() -> None:
    ap = parser(__doc__)
    add_common(
        ap, tokens=[1, 64], hidden=[2880, 3072], top_k=8, quant=["nvfp4"], quant_choices=FORMATS
    )
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("tp1_shape_probe.py needs a CUDA GPU")
    from benchmarks.tp1_local import _spec, _strategy
    from benchmarks.tp1_sweep import _outputs, _run_one
    from fusion_bridge.kernels.quant import row_block
    from fusion_bridge.kernels.tp1.configs import Tp1Config, whole_row_warps
    from fusion_bridge.oracle.synthetic import make_inputs
    from fusion_bridge.tuning.timing import sets_to_rotate, time_graph

    for hidden in args.hidden:
        for fmt in args.quant:
            spec = _spec(hidden, args.top_k, fmt, max(args.tokens))
            strat = _strategy("fused_tp1", spec)
            layer_quant = strat._launcher.layer.quant
            for tokens in args.tokens:
                n = sets_to_rotate(tokens * hidden * 2 * (args.top_k + 5), max_sets=64)
                sets = [
                    make_inputs(spec, tokens, seed=i, device="cuda", skip_fraction=0.0)
                    for i in range(n)
                ]
                out = _outputs(strat, sets[0])
                default = strat._launcher.config_for(tokens)
                configs = {
                    "default": default,
                    "whole": Tp1Config(
                        row_block(hidden),
                        whole_row_warps(tokens, hidden, layer_quant.code),
                        0,
                        default.pdl,
                    ),
                }
                for chunk in (512, 1024):
                    warps = max(1, chunk // 256) if tokens > 1 else chunk // 128
                    configs[f"split{chunk}"] = Tp1Config(
                        chunk, warps, int(tokens == 1), default.pdl
                    )
                got = []
                for label, config in configs.items():
                    us = time_graph(
                        lambda i, config=config: _run_one(strat, sets[i], out, config), sets=n
                    )
                    got.append(f"{label}({config.columns}x{config.warps}) {us:.2f}")
                print(f"{fmt:12s} H={hidden} T={tokens:3d}: " + "  ".join(got), flush=True)
                sets = None


if __name__ == "__main__":
    main()
