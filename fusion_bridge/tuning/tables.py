"""Measured selection: time every (strategy, launch variant) per token bucket, keep the table on
disk, ship default tables for known GPUs.

Timing uses CUDA graphs with inputs rotated beyond L2 and takes the max over ranks, so every rank
holds the same numbers. Which table a bridge uses is decided on rank 0 and broadcast, so ranks never
disagree. Cached tables are keyed by GPU name, world size, library versions and spec; shipped
defaults (fusion_bridge/tuning/shipped/) by GPU name, world size and spec alone.

Table format (schema_version 2), JSON:
    {"schema_version": 2, "gpu": ..., "world_size": ..., "spec": {...}, "versions": {...},
     "measured_us": {strategy: {variant: {bucket upper bound (str): microseconds}}},  CUDA graphs
     "eager_us": {...same shape...}}  optional: eager wall time per call, this host only
A table in another format is ignored with a warning that says why (never a crash). Eager times
depend on the host's CPU, so shipped tables carry graph times only; eager plans come from
a local `tune`.

Cache directory: $FUSION_BRIDGE_CACHE_DIR, else ~/.cache/fusion_bridge.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from fusion_bridge import env_vars
from fusion_bridge.tuning import format as table_format
from fusion_bridge.ranks.process_group import my_rank
from fusion_bridge.environment import Environment
from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.plan.status import StrategyStatus
from fusion_bridge.oracle.synthetic import make_inputs
from fusion_bridge.tuning.timing import sets_to_rotate, time_eager, time_graph

SCHEMA_VERSION = table_format.SCHEMA_VERSION
TABLES_DIR = Path(__file__).with_name("shipped")


def cache_dir() -> Path:
    return Path(
        env_vars.read("FUSION_BRIDGE_CACHE_DIR") or Path.home() / ".cache" / "fusion_bridge"
    )


def spec_key(spec: EpilogueSpec) -> dict:
    """The spec as far as it can change a timing: the table key. Values, not shapes, are left out:
    eps, weight_bias, routed_scaling_factor and the quant scales (FP8 `scale`, NVFP4 `global_scale`:
    calibrated per layer, so keying on them would give every layer of a quantized model its own
    table and none would ever be found); max_tokens only adds buckets (unmeasured ones take the
    static order). The quant kind and scale layouts (and the FP8 group size) stay: they change the
    work.
    shared_output_replicated (added after the shipped tables) is left out at its default, so every
    table keyed before it is still found; set, it stays in (rank 0 and the others may differ in
    what their shared add reads, and no table was measured so)."""
    d = spec.to_dict()
    for field in ("eps", "weight_bias", "routed_scaling_factor", "max_tokens"):
        d.pop(field)
    if not d["shared_output_replicated"]:
        d.pop("shared_output_replicated")
    # None, not removed: an unquantized spec (scales None) keeps the key its shipped tables have
    d["quant"] = dict(d["quant"], scale=None, global_scale=None)
    # the dynamic FP8 fields (group_size, scale_layout: added after the shipped tables) are in
    # to_dict only when set, so every table keyed before them is still found; set, they change the
    # work and stay in
    return d


def table_key(spec: EpilogueSpec, env: Environment, with_versions: bool) -> str:
    fields = {"gpu": env.gpu_name, "world_size": env.world_size, "spec": spec_key(spec)}
    if with_versions:
        fields.update(
            torch=env.torch_version, triton=env.triton_version, flashinfer=env.flashinfer_version
        )
    return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _slug(env: Environment) -> str:
    return "".join(c if c.isalnum() else "_" for c in (env.gpu_name or "cpu")).strip("_").lower()


def cache_path(spec: EpilogueSpec, env: Environment) -> Path:
    return cache_dir() / f"{_slug(env)}_tp{env.world_size}_{table_key(spec, env, True)}.json"


def default_table_path(spec: EpilogueSpec, env: Environment) -> Path:
    return TABLES_DIR / f"{_slug(env)}_tp{env.world_size}_{table_key(spec, env, False)}.json"


def _jsonable(measured: dict[str, dict[str, dict[int, float]]]) -> dict:
    return {
        name: {v: {str(b): us for b, us in per.items()} for v, per in variants.items()}
        for name, variants in measured.items()
    }


def make_table(
    spec: EpilogueSpec,
    env: Environment,
    measured: dict[str, dict[str, dict[int, float]]],
    eager: Optional[dict[str, dict[str, dict[int, float]]]] = None,
    spread: Optional[dict] = None,
) -> dict:
    """The table `tune` saves; `spread`: spread_summary() of its two passes (the
    planner's margin)."""
    table = {
        "schema_version": SCHEMA_VERSION,
        "gpu": env.gpu_name,
        "world_size": env.world_size,
        "spec": spec_key(spec),
        "versions": {
            "torch": env.torch_version,
            "triton": env.triton_version,
            "flashinfer": env.flashinfer_version,
        },
        "measured_us": _jsonable(measured),
    }
    if eager:
        table["eager_us"] = _jsonable(eager)
    if spread is not None:
        table["spread"] = spread
    return table


SPREAD_QUANTILE = 0.9


def spread_summary(differences: list[float]) -> Optional[dict]:
    """The spread a table records: of the relative differences |a - b| / mean between the two
    passes that timed each (strategy, variant, bucket), the 90th percentile (most cases differ
    less; a high quantile rather than the maximum, which one disturbed case would set). None
    without cases."""
    if not differences:
        return None
    ordered = sorted(differences)
    value = ordered[max(0, math.ceil(SPREAD_QUANTILE * len(ordered)) - 1)]
    return {
        "fraction": round(value, 4),
        "cases": len(ordered),
        "how": "90th percentile over every (strategy, variant, bucket) of |a - b| / mean, a and b "
        "the CUDA-graph times of two passes (the second in reverse order), max over ranks",
    }


def margin_of(table: Optional[dict]):
    """The planner's Margin from a table's recorded spread; None (the planner's default) when the
    table has none (tables tuned before `tune` recorded it) or one outside the format's limits
    (format.spread_problem). Never raises."""
    from fusion_bridge.plan.planner import Margin

    spread = (table or {}).get("spread")
    if spread is None or table_format.spread_problem(spread):  # never raises, whatever it holds
        return None
    return Margin(
        float(spread["fraction"]),
        f"spread between tune's two passes (90th percentile of {spread.get('cases', '?')} cases)",
    )


def table_expectation(spec: EpilogueSpec, env: Environment) -> dict:
    """What a table must have been measured for to be used by this bridge."""
    return {"gpu": env.gpu_name, "world_size": env.world_size, "spec": spec_key(spec)}


def read_table(path: Path, expect: Optional[dict] = None) -> Optional[dict]:
    """The table at `path`, or None with a warning naming the file and why it is ignored. Never
    raises (the limits: fusion_bridge.tuning.tables.format)."""
    table, problem = table_format.read_table(Path(path), expect)
    if problem:
        warnings.warn(f"fusion_bridge: {problem}", stacklevel=2)
    return table


def _first_usable_table(spec: EpilogueSpec, env: Environment) -> Optional[dict]:
    expect = table_expectation(spec, env)
    for path in (cache_path(spec, env), default_table_path(spec, env)):
        if path.is_file():
            table = read_table(path, expect)
            if table is not None:
                if path == default_table_path(spec, env):
                    table.pop("eager_us", None)  # another host's CPU: its eager times do not apply
                return table
    return None


def load_table(spec: EpilogueSpec, env: Environment, group) -> Optional[dict]:
    """The table every rank uses: rank 0's cache, else rank 0's shipped default, else
    None. Collective."""
    table = None
    if my_rank(group) == 0:
        try:  # rank 0's peers wait in the broadcast below: nothing here may raise
            table = _first_usable_table(spec, env)
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"fusion_bridge: tuning tables ignored: {exc!r}"[:500], stacklevel=2)
            table = None
    if env.world_size > 1:
        box = [table]
        dist.broadcast_object_list(
            box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group
        )
        table = box[0]
    return table


def save_table(table: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps({k: v for k, v in table.items() if k != "path"}, indent=1, sort_keys=True)
    )
    tmp.replace(path)


def as_measurements(
    table: dict, key: str = "measured_us"
) -> dict[str, dict[str, dict[int, float]]]:
    """{strategy: {variant: {bucket: us}}} with int buckets (JSON keys are strings); key "eager_us"
    gives the eager wall times ({} when the table has none)."""
    return {
        name: {v: {int(b): us for b, us in per.items()} for v, per in variants.items()}
        for name, variants in table.get(key, {}).items()
    }


def token_ranges(
    statuses: list[StrategyStatus],
) -> dict[tuple[str, str], tuple[int, Optional[int]]]:
    """(strategy, variant) -> the token counts it can take: what tuning may measure."""
    return {(s.name, v): s.token_range(v) for s in statuses for v in s.variants}


Candidate = tuple[str, str, Callable]  # (strategy, variant, run(inputs))


def measure(
    spec: EpilogueSpec,
    env: Environment,
    group,
    device: torch.device,
    candidates: list[Candidate],
    buckets: list[int],
    rotate: bool = True,
    progress: bool = True,
    seed: int = 0,
    eager_out: Optional[dict] = None,
    token_ranges: Optional[dict[tuple[str, str], tuple[int, Optional[int]]]] = None,
    spread_out: Optional[list] = None,
) -> dict[str, dict[str, dict[int, float]]]:
    """Time each candidate at each bucket's largest T under CUDA graphs. Collective; max over ranks.
    With `eager_out` (a dict), also the eager wall time per call of back-to-back calls, into it.
    With `spread_out` (a list), every case is timed in two passes (the second in reverse order,
    so drift shows), the mean is kept and |a - b| / mean of each case is appended to the list.
    `token_ranges`: (strategy, variant) -> the (fewest, most) T it can take (planner.token_ranges);
    a T outside is not measured for it (every rank holds the same ranges, so every rank skips the
    same cases). A candidate without an entry is measured at every T."""
    token_ranges = token_ranges or {}

    def can_take(name: str, variant: str, tokens: int) -> bool:
        low, high = token_ranges.get((name, variant), (1, None))
        return low <= tokens and (high is None or tokens <= high)

    rank = my_rank(group)
    bar = _progress(len(buckets) * len(candidates), progress and rank == 0)
    out: dict[str, dict[str, dict[int, float]]] = {}
    for tokens in buckets:
        fits = [c for c in candidates if can_take(c[0], c[1], tokens)]
        bar.update(len(candidates) - len(fits))
        probe = make_inputs(spec, tokens, rank=rank, seed=seed, device=device, skip_fraction=0.0)
        per_set = sum(
            t.numel() * t.element_size()
            for t in (probe.gemm2_out, probe.residual, probe.shared_output)
            if t is not None
        )
        count = sets_to_rotate(per_set, max_sets=512) if rotate else 1
        sets = [probe] + [
            make_inputs(spec, tokens, rank=rank, seed=seed + i, device=device, skip_fraction=0.0)
            for i in range(1, count)
        ]
        times, walls, again = [], [], []
        calls = [
            lambda i, run=run, variant=variant: run(sets[i], variant)  # noqa: F821 (bound before, deleted after)
            for _, variant, run in fits
        ]
        for (name, variant, _), call in zip(fits, calls):
            times.append(time_graph(call, sets=count, calls=max(count, 20)))
            if eager_out is not None:
                walls.append(time_eager(call, sets=count))
            bar.set_postfix_str(f"T={tokens} {name}:{variant}", refresh=False)
            bar.update()
        if spread_out is not None:  # the second pass, in reverse order
            again = [time_graph(c, sets=count, calls=max(count, 20)) for c in reversed(calls)][::-1]
        t = torch.tensor(times + walls + again, dtype=torch.float64, device=device)
        if env.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        values = t.tolist()
        if spread_out is not None:
            first, second = values[: len(fits)], values[len(fits) + len(walls) :]
            values[: len(fits)] = [(a + b) / 2 for a, b in zip(first, second)]
            spread_out += [abs(a - b) / ((a + b) / 2) for a, b in zip(first, second) if a + b > 0]
        for i, (name, variant, _) in enumerate(fits):
            out.setdefault(name, {}).setdefault(variant, {})[tokens] = values[i]
            if eager_out is not None:
                eager_out.setdefault(name, {}).setdefault(variant, {})[tokens] = values[
                    len(fits) + i
                ]
        del sets, probe
    bar.close()
    return out


def _progress(total: int, enabled: bool):
    """A progress bar on stderr (tqdm, which flashinfer installs; a silent stand-in otherwise)."""
    try:
        from tqdm import tqdm
    except ImportError:
        enabled = False
    if not enabled:

        class _Silent:
            def set_postfix_str(self, *a, **k): ...
            def update(self, *a): ...
            def close(self): ...

        return _Silent()
    return tqdm(total=total, desc="tune", unit="case", dynamic_ncols=True)
