"""Parity: every available strategy against the fp32 oracle on fresh random inputs
(different per rank)."""

from __future__ import annotations

from typing import Optional

import torch

from fusion_bridge import FusionBridge
from fusion_bridge.cli.launch import run_distributed
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.oracle.numerics import compare, quant_error_bound
from fusion_bridge.oracle.synthetic import make_inputs


def parity_rank(
    rank: int,
    world_size: int,
    spec: EpilogueSpec,
    tokens: int,
    seed: int,
    weight_dtype: torch.dtype = torch.float32,
) -> dict:
    """One rank's {"rows": [{strategy, output, rel_err, max_abs_err, bound, passed}],
    "skipped": {strategy: [reason codes]}}. Collective."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    group = torch.distributed.group.WORLD if world_size > 1 else None
    rows = []
    with FusionBridge(spec, group) as bridge:
        inputs = make_inputs(
            spec, tokens, rank=rank, seed=seed, device=device, weight_dtype=weight_dtype
        )
        ref = bridge.run_strategy("reference", inputs)
        statuses = {s.name: s for s in bridge.statuses}
        for name in bridge.prepared:
            if name == "reference" or not statuses[name].available:
                continue
            got = bridge.run_strategy(name, inputs)
            bound = statuses[name].error_bound
            for output, (err, max_abs) in compare(spec, got, ref).items():
                limit = quant_error_bound(spec, ref, bound) if output == "quant" else bound
                rows.append(
                    {
                        "strategy": name,
                        "output": output,
                        "rel_err": err,
                        "max_abs_err": max_abs,
                        "bound": limit,
                        "passed": bool(err <= limit),
                    }
                )
        skipped = {
            s.name: [r.code for r in s.reasons]
            for s in bridge.statuses
            if s.name != "reference" and (not s.available or s.name not in bridge.prepared)
        }
    return {"rows": rows, "skipped": skipped}


def run_parity(
    spec: EpilogueSpec,
    tokens: int,
    world_size: int = 1,
    seed: int = 0,
    weight_dtype: torch.dtype = torch.float32,
    timeout_s: float = 600.0,
    backend: Optional[str] = None,
) -> list[dict]:
    """Rows with the worst error over ranks, per (strategy, output)."""
    return run_parity_report(spec, tokens, world_size, seed, weight_dtype, timeout_s, backend)[0]


def run_parity_report(
    spec: EpilogueSpec,
    tokens: int,
    world_size: int = 1,
    seed: int = 0,
    weight_dtype: torch.dtype = torch.float32,
    timeout_s: float = 600.0,
    backend: Optional[str] = None,
) -> tuple[list[dict], dict[str, list[str]]]:
    """(rows with the worst error over ranks per (strategy, output),
    {skipped strategy: reason codes}).
    The statuses are agreed across ranks, so rank 0's skipped list is every rank's."""
    if world_size == 1:
        per_rank = [parity_rank(0, 1, spec, tokens, seed, weight_dtype)]
    else:
        per_rank = run_distributed(
            parity_rank,
            world_size,
            spec,
            tokens,
            seed,
            weight_dtype,
            backend=backend,
            timeout_s=timeout_s,
        )
    worst: dict[tuple, dict] = {}
    for result in per_rank:
        for row in result["rows"]:
            key = (row["strategy"], row["output"])
            if key not in worst or not row["rel_err"] <= worst[key]["rel_err"]:
                worst[key] = row
    return list(worst.values()), per_rank[0]["skipped"]
