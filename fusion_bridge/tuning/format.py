"""The tuning table format and every limit a table must meet, in one place.

A table comes from disk (a cache written by `tune`, or a default shipped with the package) or from a
caller (`measured_us=` / `eager_us=`). From disk it is never trusted: `read_table` never raises, it
returns None and a warning that names the file and the first problem found. From a caller, the same
checks raise ValueError naming the argument, before any collective.

Limits (what a table written by `tune` always meets):
- the file is at most MAX_TABLE_BYTES and JSON nested at most MAX_NESTING deep;
- schema_version is SCHEMA_VERSION; `gpu`, `world_size` and `spec` equal this bridge's (a table
  measured on another machine or for another layer says nothing about this one);
- measured_us (and the optional eager_us) is {strategy: {variant: {bucket: us}}}; a bucket is an
  ASCII decimal power of two in [1, MAX_BUCKET]; a time is a number of microseconds in
  [MIN_US, MAX_US] (no epilogue call, not even one kernel replayed in a CUDA graph, takes less
  than MIN_US: a smaller time is not a measurement, and it would win every bucket);
- the optional `spread` ({"fraction": ..., "cases": ..., "how": ...}, what `tune` measured between
  its two passes; tuning.margin_of reads it as the planner's margin) has a fraction in
  [0, MAX_SPREAD]: two passes further apart than that are too noisy to plan from, and a margin that
  large would keep every measured route out.

A caller's table may use ints or ASCII decimal strings as buckets and any real number type (numpy
scalars too) as times; `normalized_measurements` turns it into {strategy: {variant: {int: float}}}.
"""

from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import Optional

from fusion_bridge.env_vars import finite_float

SCHEMA_VERSION = 2
MAX_TABLE_BYTES = 4 << 20  # a real table is tens of kilobytes
MAX_NESTING = 8  # {"measured_us": {strategy: {variant: {bucket: us}}}} is 4 deep
MAX_BUCKET = 1 << 24
MAX_US = 1e7  # ten seconds per call: far beyond any real epilogue
MIN_US = 0.5  # below any CUDA-graph replay of a kernel, and well below every shipped table's times
MAX_SPREAD = 0.5


def _nesting_depth(text: str) -> int:
    """The deepest nesting of [] / {} in JSON text, strings skipped (no recursion, O(len))."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _bucket(key: object) -> Optional[int]:
    """A bucket key (an int, numpy's too, or its ASCII decimal string) as an int when it is a power
    of two in [1, MAX_BUCKET], else None."""
    if isinstance(key, str):
        if not (key.isascii() and key.isdigit() and len(key) <= 9):
            return None
        value = int(key)
    elif isinstance(key, numbers.Integral) and not isinstance(key, bool):
        value = int(key)
    else:
        return None
    return value if 1 <= value <= MAX_BUCKET and value & (value - 1) == 0 else None


def _is_time(us: object) -> bool:
    value = finite_float(us)
    return value is not None and MIN_US <= value <= MAX_US


def measurements_problem(measured: object, what: str) -> Optional[str]:
    """Why `measured` is not {strategy: {variant: {bucket: us}}} within the limits (None: it is).
    Buckets may be ints (a caller's dict) or their decimal strings (JSON)."""
    if not isinstance(measured, dict):
        shape = "{strategy: {variant: {bucket: us}}}"
        return f"{what} is not a dict {shape} but {type(measured).__name__}"
    for name, variants in measured.items():
        if not isinstance(name, str) or not isinstance(variants, dict):
            return f"{what}[{name!r}] is not {{variant: {{bucket: us}}}}"
        for variant, per in variants.items():
            if not isinstance(variant, str) or not isinstance(per, dict):
                return f"{what}[{name!r}][{variant!r}] is not {{bucket: us}}"
            seen: dict[int, object] = {}
            for bucket, us in per.items():
                value = _bucket(bucket)
                if value is None:
                    return (
                        f"{what}[{name!r}][{variant!r}] has bucket {str(bucket)[:40]!r}, not a "
                        f"power of two in [1, {MAX_BUCKET}] written as an int or in ASCII digits"
                    )
                if value in seen:
                    return (
                        f"{what}[{name!r}][{variant!r}] has bucket {value} twice "
                        f"({seen[value]!r} and {bucket!r})"
                    )
                seen[value] = bucket
                if not _is_time(us):
                    return (
                        f"{what}[{name!r}][{variant!r}][{value}] is {str(us)[:40]!r}, not a "
                        f"number of microseconds in [{MIN_US:g}, {MAX_US:g}]"
                    )
    return None


def normalized_measurements(measured: dict) -> dict[str, dict[str, dict[int, float]]]:
    """A table that passed measurements_problem, as {strategy: {variant: {int bucket: float us}}}:
    what the planner reads, whatever key and number types the caller wrote."""
    return {
        name: {v: {_bucket(b): float(us) for b, us in per.items()} for v, per in variants.items()}
        for name, variants in measured.items()
    }


def spread_problem(spread: object) -> Optional[str]:
    """Why a table's `spread` cannot serve as the planner's margin (None: it can, or there is
    none)."""
    if spread is None:
        return None
    fraction = spread.get("fraction") if isinstance(spread, dict) else None
    value = finite_float(fraction)
    if value is None or not 0.0 <= value <= MAX_SPREAD:
        return (
            f"spread.fraction is {repr(fraction)[:40]}, not a number in [0, {MAX_SPREAD:g}] (two "
            "passes further apart are too noisy to plan from)"
        )
    return None


def table_problem(table: object, expect: Optional[dict] = None) -> Optional[str]:
    """Why `table` (parsed JSON) cannot be used (None: it can). `expect`: {"gpu", "world_size",
    "spec"} this bridge needs the table to have been measured for."""
    if not isinstance(table, dict):
        return f"not a JSON object but {type(table).__name__}"
    version = table.get("schema_version")
    if version != SCHEMA_VERSION:
        return (
            f"schema_version {repr(version)[:40]}, this fusion_bridge reads {SCHEMA_VERSION} "
            "(re-run `python -m fusion_bridge tune`)"
        )
    for key, value in (expect or {}).items():
        if table.get(key) != value:
            return f"it was measured for {key}={str(table.get(key))[:200]!r}, not {value!r}"
    problem = measurements_problem(table.get("measured_us"), "measured_us")
    if problem is None and "eager_us" in table:
        problem = measurements_problem(table["eager_us"], "eager_us")
    return problem or spread_problem(table.get("spread"))


def read_table(path: Path, expect: Optional[dict] = None) -> tuple[Optional[dict], Optional[str]]:
    """(table, None), or (None, why it is ignored: the message names the file). Never raises."""
    try:
        size = path.stat().st_size
        if size > MAX_TABLE_BYTES:
            return None, f"tuning table {path} ignored: {size} bytes > {MAX_TABLE_BYTES}"
        text = path.read_text(encoding="utf-8")
        depth = _nesting_depth(text)
        if depth > MAX_NESTING:
            return None, f"tuning table {path} ignored: JSON nested {depth} deep > {MAX_NESTING}"
        table = json.loads(text)
        problem = table_problem(table, expect)
    except Exception as exc:  # noqa: BLE001 - whatever a file holds, the build goes on without it
        return None, f"tuning table {path} ignored: {type(exc).__name__}: {str(exc)[:300]}"
    if problem:
        return None, f"tuning table {path} ignored: {problem}"
    table["path"] = str(path)
    return table, None
