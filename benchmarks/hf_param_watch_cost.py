"""Host cost of the parameter check a patched Hugging Face MoE layer runs on every call
(fusion_bridge/integrations/hf_param_watch.py: each parameter the layer reads still the object it
was patched with, with the same dtype, shapes, device and placements), on CPU.

    python benchmarks/hf_param_watch_cost.py [--calls 20000] [--rounds 7] [--family F ...]

For each family: a tiny random model built whole and patched in this process (plain parameters),
then the same model saved with save_pretrained and loaded sharded on 2 spawned gloo ranks with
transformers' TP plan (tp_plan="auto": a plan-sharded shared expert's weights are DTensors) and,
where transformers has it (5.25), with expert parallelism (DistributedConfig(tp_size=2,
ep_size=2): the routed experts are DTensors too). Times `watch.check()` of every patched layer
(`calls` calls a round, the median of `rounds` rounds) and prints, per family and load mode, the
parameters one layer watches and the median microseconds per layer call (the slowest layer; rank
0's). The check's cost grows with the parameters a layer reads, not with the model's size: a
layer holds the same parameters at any hidden size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

DEFAULT_FAMILIES = ("deepseek_v3", "qwen2_moe", "qwen3_5_moe", "gpt_oss")


def _per_layer_us(patch, calls: int, rounds: int) -> tuple[int, float]:
    """(parameters one layer watches, median microseconds of one check()) of the slowest layer."""
    worst = (0, 0.0)
    for layer in patch.layers.values():
        watch = layer.watch
        samples = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                watch.check()
            samples.append((time.perf_counter() - start) / calls * 1e6)
        worst = max(worst, (len(watch.entries), statistics.median(samples)), key=lambda w: w[1])
    return worst


def _rank(rank: int, world: int, saved: dict, calls: int, rounds: int) -> list[dict]:
    """Every saved family loaded sharded on this rank, in each mode this transformers has."""
    import transformers

    from fusion_bridge.integrations.transformers import patch_moe_epilogues

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    modes = {"tp_plan": dict(tp_plan="auto")}
    if hasattr(transformers.DistributedConfig(), "ep_size"):
        config = transformers.DistributedConfig(tp_size=world, ep_size=world)
        modes["tp_ep"] = dict(distributed_config=config)
    out = []
    for family, (path, class_name) in saved.items():
        for mode, kwargs in modes.items():
            model_class = getattr(transformers, class_name)
            model = model_class.from_pretrained(path, dtype=torch.bfloat16, **kwargs).eval()
            patch = patch_moe_epilogues(model)
            params, us = _per_layer_us(patch, calls, rounds)
            patch.unpatch()
            out.append(dict(family=family, mode=mode, params=params, us_per_layer=us))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--calls", type=int, default=20000, help="check() calls a round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--family", action="append", help=f"default: {' '.join(DEFAULT_FAMILIES)}")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import transformers

    from fusion_bridge.cli.launch import run_distributed
    from fusion_bridge.integrations.transformers import patch_moe_epilogues
    from migration.examples.hf_moe_models import TINY, build_model, why_skipped

    families = [f for f in (args.family or DEFAULT_FAMILIES) if why_skipped(f) is None]
    rows = []
    with tempfile.TemporaryDirectory(prefix="hf_param_watch_") as root:
        saved = {}
        for family in families:
            model = build_model(family, TINY)
            patch = patch_moe_epilogues(model)  # one process, the whole model
            params, us = _per_layer_us(patch, args.calls, args.rounds)
            patch.unpatch()
            rows.append(dict(family=family, mode="whole", params=params, us_per_layer=us))
            model.save_pretrained(f"{root}/{family}")
            saved[family] = (f"{root}/{family}", type(model).__name__)
        per_rank = run_distributed(_rank, 2, saved, args.calls, args.rounds, timeout_s=1200)
        rows += per_rank[0]
    if args.json:
        doc = dict(transformers=transformers.__version__, torch=torch.__version__, rows=rows)
        print(json.dumps(doc, indent=2))
        return 0
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for r in sorted(rows, key=lambda r: (families.index(r["family"]), r["mode"])):
        print(f"{r['family']:>12} {r['mode']:>8}: {r['params']:2d} parameters a layer, "
              f"{r['us_per_layer']:.2f} us a layer call (median, slowest layer)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
