"""Measured selection: time every candidate per token bucket, cache the table, ship defaults.

A candidate is a strategy, or for local_fused one of its all-reduce+norm sub-paths. Timing uses CUDA
graphs with inputs rotated beyond L2, and takes the max over ranks, so every rank holds the same table
and makes the same choice. Tables are cached on disk keyed by GPU name, world size, library versions
and spec; shipped defaults (fusion_bridge/tables/) match on GPU name, world size and spec alone.
Which table a bridge uses is decided on rank 0 and broadcast, so ranks never disagree.

Cache directory: $FUSION_BRIDGE_CACHE_DIR, else ~/.cache/fusion_bridge.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .environment import Environment
from .spec import EpilogueSpec
from .synthetic import make_inputs
from .timing import sets_to_rotate, time_graph

TABLES_DIR = Path(__file__).with_name("tables")
SUBPATH_SEP = "/"  # candidate label for a sub-path: "local_fused/nccl_local_norm"


def cache_dir() -> Path:
    return Path(os.environ.get("FUSION_BRIDGE_CACHE_DIR") or Path.home() / ".cache" / "fusion_bridge")


def spec_key(spec: EpilogueSpec) -> dict:
    d = spec.to_dict()
    # these do not change the timing; max_tokens only adds buckets (unmeasured ones use the static order)
    for field in ("eps", "weight_bias", "routed_scaling_factor", "max_tokens"):
        d.pop(field)
    return d


def table_key(spec: EpilogueSpec, env: Environment, with_versions: bool) -> str:
    fields = {"gpu": env.gpu_name, "world_size": env.world_size, "spec": spec_key(spec)}
    if with_versions:
        fields.update(torch=env.torch_version, triton=env.triton_version, flashinfer=env.flashinfer_version)
    return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _slug(env: Environment) -> str:
    return "".join(c if c.isalnum() else "_" for c in (env.gpu_name or "cpu")).strip("_").lower()


def cache_path(spec: EpilogueSpec, env: Environment) -> Path:
    return cache_dir() / f"{_slug(env)}_tp{env.world_size}_{table_key(spec, env, True)}.json"


def default_table_path(spec: EpilogueSpec, env: Environment) -> Path:
    return TABLES_DIR / f"{_slug(env)}_tp{env.world_size}_{table_key(spec, env, False)}.json"


def load_table(spec: EpilogueSpec, env: Environment, group) -> Optional[dict]:
    """The table every rank uses: rank 0's cache, else rank 0's shipped default, else None. Collective."""
    table = None
    rank0 = env.world_size == 1 or dist.get_rank(group) == 0
    if rank0:
        for path in (cache_path(spec, env), default_table_path(spec, env)):
            if path.is_file():
                table = json.loads(path.read_text())
                table["path"] = str(path)
                break
    if env.world_size > 1:
        box = [table]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                   group=group)
        table = box[0]
    return table


def save_table(table: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
    tmp.replace(path)


def as_measurements(table: dict) -> dict[str, dict[int, float]]:
    """{candidate: {bucket: us}} with int buckets (JSON keys are strings)."""
    return {name: {int(b): us for b, us in per.items()} for name, per in table["measured_us"].items()}


def per_strategy(measured: dict[str, dict[int, float]]) -> tuple[dict[str, dict[int, float]], dict[int, str]]:
    """Collapse sub-path candidates: a strategy's time per bucket is its fastest sub-path's, and the
    winning sub-path per bucket is returned for local_fused."""
    best: dict[str, dict[int, float]] = {}
    subpaths: dict[int, str] = {}
    for label, per in measured.items():
        name, _, sub = label.partition(SUBPATH_SEP)
        for bucket, us in per.items():
            if bucket not in best.setdefault(name, {}) or us < best[name][bucket]:
                best[name][bucket] = us
                if sub:
                    subpaths[bucket] = sub
    return best, subpaths


def progress_bar(total: int, label: str, enabled: bool) -> Callable[[str], None]:
    done = [0]

    def step(what: str) -> None:
        done[0] += 1
        if enabled:
            filled = int(30 * done[0] / total)
            sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (30 - filled)}] {done[0]}/{total} {what:40s}")
            if done[0] == total:
                sys.stderr.write("\n")
            sys.stderr.flush()
    return step


def measure(bridge, candidates: list[tuple[str, Callable]], buckets: list[int], rotate: bool = True,
            progress: bool = True, seed: int = 0) -> dict[str, dict[int, float]]:
    """Time each candidate (label, run(inputs)) at each bucket's largest T. Collective; max over ranks."""
    spec, env, dev = bridge.spec, bridge.env, bridge.device
    rank = dist.get_rank(bridge.group) if env.world_size > 1 else 0
    step = progress_bar(len(buckets) * len(candidates), "tune", progress and rank == 0)
    out: dict[str, dict[int, float]] = {label: {} for label, _ in candidates}
    for tokens in buckets:
        probe = make_inputs(spec, tokens, rank=rank, seed=seed, device=dev, skip_fraction=0.0)
        per_set = sum(t.numel() * t.element_size() for t in (probe.gemm2_out, probe.residual, probe.shared_output)
                      if t is not None)
        count = sets_to_rotate(per_set, max_sets=512) if rotate else 1
        sets = [probe] + [make_inputs(spec, tokens, rank=rank, seed=seed + i, device=dev, skip_fraction=0.0)
                          for i in range(1, count)]
        times = []
        for label, run in candidates:
            times.append(time_graph(lambda i, run=run, inputs=sets: run(inputs[i]), sets=count,
                                    calls=max(count, 20)))
            step(f"T={tokens} {label}")
        t = torch.tensor(times, dtype=torch.float64, device=dev)
        if env.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=bridge.group)
        for (label, _), us in zip(candidates, t.tolist()):
            out[label][tokens] = us
        del sets, probe
    return out
