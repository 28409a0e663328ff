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
  (0, MAX_US], finite;
- the optional `spread` ({"fraction": ..., "cases": ..., "how": ...}, what `tune` measured between
  its two passes) is read by tuning.margin_of: a fraction outside [0, 1) is ignored (the planner's
  default margin applies).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

SCHEMA_VERSION = 2
MAX_TABLE_BYTES = 4 << 20  # a real table is tens of kilobytes
MAX_NESTING = 8  # {"measured_us": {strategy: {variant: {bucket: us}}}} is 4 deep
MAX_BUCKET = 1 << 24
MAX_US = 1e7  # ten seconds per call: far beyond any real epilogue


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


def _is_bucket(key: object) -> bool:
    if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 9):
        return False
    value = int(key)
    return 1 <= value <= MAX_BUCKET and value & (value - 1) == 0


def _is_time(us: object) -> bool:
    if isinstance(us, bool) or not isinstance(us, (int, float)):
        return False
    try:
        value = float(us)  # a 400-digit int overflows here
    except OverflowError:
        return False
    return math.isfinite(value) and 0 < value <= MAX_US


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
            for bucket, us in per.items():
                key = (
                    str(bucket)
                    if isinstance(bucket, int) and not isinstance(bucket, bool)
                    else bucket
                )
                if not _is_bucket(key):
                    return (
                        f"{what}[{name!r}][{variant!r}] has bucket {str(bucket)[:40]!r}, not a "
                        f"power of two in [1, {MAX_BUCKET}] written in ASCII digits"
                    )
                if not _is_time(us):
                    return (
                        f"{what}[{name!r}][{variant!r}][{key}] is {str(us)[:40]!r}, not a number "
                        f"of microseconds in (0, {MAX_US:g}]"
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
    return problem


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
