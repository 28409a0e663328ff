"""Compile `fused_tp1`'s default kernels for the given T and quantizations in parallel processes
(Triton's on-disk cache), so a timing run that follows (benchmarks/tp1_local.py) starts warm. It
calls the strategies only (and the two-launch path's), so it works on any tree.

    python benchmarks/tp1_warm.py [--tokens 1 16 64 256] [--hidden 7168] [--jobs 12] [--tree DIR]

--tree: the tree whose kernels to compile (default: this file's; e.g. another checkout, to time it
with its own benchmarks/tp1_local.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

TREE_VAR = "TP1_WARM_TREE"  # the --tree of the parent, for the worker processes
sys.path.insert(0, os.environ.get(TREE_VAR) or os.path.join(os.path.dirname(__file__), ".."))


def _warm(task) -> str:
    import torch

    from benchmarks.tp1_local import _spec, _strategy

    try:  # the tree's module names (--tree: before the package's folders first)
        from fusion_bridge.synthetic import make_inputs
    except ImportError:
        from fusion_bridge.oracle.synthetic import make_inputs

    hidden, quant, tokens, name = task
    spec = _spec(hidden, 8, quant, max(tokens, 1))
    strat = _strategy(name, spec)
    strat.run(make_inputs(spec, tokens, seed=0, device="cuda"))
    torch.cuda.synchronize()
    return "ok"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168])
    ap.add_argument("--quant", nargs="+", default=["none", "fp8", "nvfp4"])
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--tree", default=None)
    args = ap.parse_args()
    if args.tree:
        os.environ[TREE_VAR] = os.path.abspath(args.tree)
    tasks = [
        (h, q, t, name)
        for h in args.hidden
        for q in args.quant
        for t in args.tokens
        for name in ("fused_tp1", "local_fused_nccl")
    ]
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        print(f"warmed {len(list(pool.map(_warm, tasks)))} calls", flush=True)


if __name__ == "__main__":
    main()
