"""What the benchmark scripts share: one long-format CSV schema with its row writer, and the
command-line options most of them take. Nothing here measures: the timers are the package's
(fusion_bridge.tuning.timing) or the script's own.

One row per measured time, columns FIELDS:

- kernel: what was timed (a kernel, a strategy, a composition, a launch variant's label)
- provider: whose code runs: fusion_bridge, flashinfer, torch, nccl, benchmarks (a kernel of the
  script itself), or hardware (a copy: its bandwidth in extra)
- shape: the problem, and the launch shape where the script varies it ("H=7168 K=8 none 1024x4")
- T: tokens per call (0 where the row has none)
- us_median: median microseconds per call; us_p20 / us_p80: the 20th / 80th percentiles where the
  timer reports them (the package's timers return the median alone: empty then)
- gpu, versions (torch, triton, flashinfer), commit (git HEAD, "+dirty" with uncommitted changes;
  $BENCH_COMMIT where the tree has no .git, as on a device machine's copy)
- extra: a JSON object with the row's other values (floors, ratios, workspace sizes, notes)

Result files measured before this schema keep the columns their script wrote then.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import os
import subprocess
from importlib import metadata
from typing import Optional, Sequence

FIELDS = (
    "kernel",
    "provider",
    "shape",
    "T",
    "us_median",
    "us_p20",
    "us_p80",
    "gpu",
    "versions",
    "commit",
    "extra",
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUANTS = ("none", "fp8", "nvfp4")
_VERSIONED = (("torch", "torch"), ("triton", "triton"), ("flashinfer", "flashinfer-python"))


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser whose --help prints the script's docstring as written."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_common(
    ap: argparse.ArgumentParser,
    *,
    tokens: Optional[Sequence[int]] = None,
    hidden: Optional[Sequence[int]] = None,
    top_k: Optional[int] = None,
    quant: Optional[Sequence[str]] = None,
    quant_choices: Sequence[str] = QUANTS,
    csv: bool = True,
    csv_default: Optional[str] = None,
) -> argparse.ArgumentParser:
    """The shared options, each added where its default is given: --tokens, --hidden (lists),
    --top-k, --quant (a list), and --csv (the harness schema)."""
    if tokens is not None:
        ap.add_argument("--tokens", type=int, nargs="+", default=list(tokens), help="tokens T")
    if hidden is not None:
        ap.add_argument("--hidden", type=int, nargs="+", default=list(hidden), help="hidden H")
    if top_k is not None:
        ap.add_argument("--top-k", type=int, default=top_k, help="experts per token K")
    if quant is not None:
        ap.add_argument(
            "--quant", nargs="+", default=list(quant), choices=list(quant_choices), help="norm_out"
        )
    if csv:
        ap.add_argument(
            "--csv", default=csv_default, help="write the rows there (benchmarks/harness.py)"
        )
    return ap


@functools.lru_cache(maxsize=None)
def versions() -> str:
    """'torch=... triton=... flashinfer=...' for the packages installed."""
    found = []
    for name, dist in _VERSIONED:
        try:
            found.append(f"{name}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return " ".join(found)


@functools.lru_cache(maxsize=None)
def commit() -> str:
    """$BENCH_COMMIT, else this tree's short HEAD (+dirty), else 'unknown'."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        git = ["git", "-C", ROOT]
        head = subprocess.run(
            git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            git + ["status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def _us(value) -> object:
    if value is None:
        return ""
    value = float(value)
    return round(value, 3) if math.isfinite(value) else "nan"


class Rows:
    """The rows of one run in the schema; gpu, versions and commit are filled in at write."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add(
        self,
        kernel: str,
        provider: str,
        shape: str,
        tokens: int,
        us: Optional[float],
        p20: Optional[float] = None,
        p80: Optional[float] = None,
        **extra,
    ) -> None:
        self.rows.append(
            dict(
                kernel=kernel,
                provider=provider,
                shape=shape,
                T=int(tokens),
                us_median=_us(us),
                us_p20=_us(p20),
                us_p80=_us(p80),
                extra=json.dumps(extra, sort_keys=True) if extra else "",
            )
        )

    def extend(self, rows: Sequence[dict]) -> None:
        """Rows read back from a file in the schema (read_rows), kept as they are."""
        self.rows.extend(rows)

    def write(self, path: str) -> None:
        """Write every row to `path` (its folder made), run-wide columns filled where empty."""
        fill = dict(gpu=gpu_name(), versions=versions(), commit=commit())
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            for row in self.rows:
                out = {k: row.get(k, "") for k in FIELDS}
                for k, value in fill.items():
                    if out[k] in ("", None):  # rows read back (read_rows) keep their own
                        out[k] = value
                writer.writerow(out)
        print(f"wrote {len(self.rows)} rows to {path}", flush=True)


def read_rows(path: str) -> list[dict]:
    """The rows of a CSV in this schema; ValueError for a file in another one."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != FIELDS:
            raise ValueError(
                f"{path}: columns {reader.fieldnames} are not benchmarks/harness.py's {FIELDS}"
            )
        return list(reader)
