"""A/B timing of `auto` between two checkouts of fusion-bridge, on the same machine, in the same
run.

    python benchmarks/ab_auto.py --tree DIR [--world-size 2] [--out result.json]

DIR is a source tree whose `fusion_bridge/` (with `kernels/` copied inside) is imported instead of
the installed package. It spawns one process group, builds FusionBridge(H=7168, K=8) with
tuning="auto" (each checkout uses its own shipped table) and times `finalize_epilogue` per T under
CUDA graphs with inputs rotated beyond L2, max over ranks. Run it alternately for the two trees (A,
B, A, B: `bash benchmarks/two_gpus.sh ab_auto A B`) so the spread between two runs of the same tree
is measured beside the difference between trees. Standard library and the tree's package only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

TOKENS = (1, 16, 64, 256, 1024, 4096)


def _rank(rank: int, world: int, tree: str, port: int, out: str) -> None:
    sys.path.insert(0, os.path.abspath(tree))
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    import fusion_bridge
    from fusion_bridge import EpilogueSpec, FusionBridge

    # the module names of older trees first (an editable install of another checkout can supply
    # a newer name that the tree itself lacks)
    try:  # before the package's folders
        from fusion_bridge.timing import sets_to_rotate, time_graph
    except ImportError:
        from fusion_bridge.tuning.timing import sets_to_rotate, time_graph
    try:  # before the package's folders
        from fusion_bridge.synthetic import make_inputs
    except ImportError:
        try:  # the tree before the selection restructure
            from fusion_bridge.testing import make_inputs
        except ImportError:
            from fusion_bridge.oracle.synthetic import make_inputs
    assert fusion_bridge.__file__.startswith(os.path.abspath(tree)), fusion_bridge.__file__
    spec = EpilogueSpec(hidden_size=7168, top_k=8)
    dev = torch.device("cuda", rank)
    result = {}
    with FusionBridge(spec, dist.group.WORLD if world > 1 else None, debug=False) as bridge:
        for tokens in TOKENS:
            probe = make_inputs(spec, tokens, rank=rank, seed=0, device=dev, skip_fraction=0.0)
            per_set = sum(
                t.numel() * t.element_size()
                for t in (probe.gemm2_out, probe.residual, probe.shared_output)
            )
            count = sets_to_rotate(per_set, max_sets=512)
            sets = [
                make_inputs(spec, tokens, rank=rank, seed=i, device=dev, skip_fraction=0.0)
                for i in range(count)
            ]
            us = time_graph(
                lambda i: bridge.finalize_epilogue(*sets[i]),  # noqa: F821
                sets=count,
                calls=max(count, 20),
            )
            t = torch.tensor([us], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            result[tokens] = {"us": round(t.item(), 2), "strategy": bridge.strategy_for(tokens)}
            del sets, probe
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tree", required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--out", default="ab.json")
    args = p.parse_args()
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        _rank,
        args=(args.world_size, args.tree, port, args.out),
        nprocs=args.world_size,
        start_method="spawn",
    )
    print(json.dumps({"tree": args.tree, **json.load(open(args.out))}))


if __name__ == "__main__":
    main()
