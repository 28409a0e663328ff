"""Issue 47's rule for benchmarks/hf_end_to_end.py: a patched model is never slower than the
model's own. Per (family, T, mode), mode eager or graph (CUDA graphs):

    s      = (max - min) / median of the unpatched rounds (their spread)
    passes = median(patched auto rounds) <= median(unpatched rounds) * (1 + s)

The rounds alternate unpatched and patched in one process, so a row passes when the patched
median is within the unpatched model's own round-to-round spread of it, or below. A row is not
judged (neither pass nor miss) where the unpatched model does not run that way (its forward does
not capture a CUDA graph); a patched forward that does not capture where the unpatched one does
is a miss.

    python benchmarks/hf_verdict.py RUN.json     # the table and summary of a --json file again
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

MODES = ("eager", "graph")


@dataclass
class Verdict:
    """One (family, T, mode) row. us: microseconds per forward (medians over rounds); spread: s;
    passes: True / False, None where the row is not judged (note says why)."""

    family: str
    tokens: int
    mode: str
    unpatched_us: Optional[float]
    patched_us: Optional[float]
    spread: Optional[float]
    passes: Optional[bool]
    note: str = ""

    @property
    def ratio(self) -> Optional[float]:
        """patched / unpatched median."""
        if self.unpatched_us is None or self.patched_us is None:
            return None
        return self.patched_us / self.unpatched_us

    def cell(self) -> str:
        """The row as a table cell: 'ratio (s spread) ok|MISS', or why it is not judged."""
        if self.ratio is None:
            return "MISS: " + self.note if self.passes is False else "n/a"
        return f"{self.ratio:.2f} (s {self.spread:.2f}) {'ok' if self.passes else 'MISS'}"

    def line(self) -> str:
        """One printed line: both medians, s and the verdict."""
        if self.ratio is None:
            return f"{self.mode}: {'MISS' if self.passes is False else 'not judged'}: {self.note}"
        return (
            f"{self.mode}: unpatched {self.unpatched_us:.0f} us, patched {self.patched_us:.0f} us "
            f"= {self.ratio:.3f}x, limit 1 + s = {1 + self.spread:.3f}: "
            + ("pass" if self.passes else "MISS")
        )


def judge(
    family: str,
    tokens: int,
    mode: str,
    unpatched: Sequence[float],
    patched: Sequence[float],
    note: str = "",
) -> Verdict:
    """The verdict from the rounds' values (us, one per round, each round's median forward).
    ValueError for no rounds or a non-positive time; unpatched empty: not judged (note: why);
    patched empty where unpatched is not: a miss (note: why)."""
    if mode not in MODES:
        raise ValueError(f"judge: mode must be one of {MODES}, got {mode!r}")
    for name, values in (("unpatched", unpatched), ("patched", patched)):
        if any(not v > 0 for v in values):
            raise ValueError(f"judge: {name} round times must be > 0 us, got {list(values)}")
    if not unpatched:
        return Verdict(family, tokens, mode, None, None, None, None, note or "no unpatched rounds")
    base = statistics.median(unpatched)
    spread = (max(unpatched) - min(unpatched)) / base
    if not patched:
        return Verdict(family, tokens, mode, base, None, spread, False, note or "no patched rounds")
    mine = statistics.median(patched)
    return Verdict(family, tokens, mode, base, mine, spread, mine <= base * (1 + spread), note)


@dataclass
class Results:
    """What one run found: the verdicts, each family's shape line and its per-T details (the
    breakdown, the logits check), the families skipped (why), failed (the error) and not run (why:
    `stopped`, the deadline or a CUDA context a failure left unusable)."""

    meta: dict = field(default_factory=dict)
    verdicts: list = field(default_factory=list)
    shapes: dict = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    not_run: list = field(default_factory=list)
    stopped: str = "deadline"  # why the families in not_run were not run

    def summary(self) -> list:
        """The summary lines: how many rows pass / miss, the misses, what was not judged or run."""
        judged = [v for v in self.verdicts if v.passes is not None]
        misses = [v for v in judged if not v.passes]
        lines = [
            f"verdict: {len(judged) - len(misses)} of {len(judged)} (family, T, mode) rows pass, "
            f"{len(misses)} miss" + (": " + "; ".join(map(_where, misses)) if misses else "")
        ]
        unjudged = [v for v in self.verdicts if v.passes is None]
        if unjudged:
            lines.append(f"not judged: {len(unjudged)}: " + "; ".join(map(_where, unjudged)))
        for title, items in (("skipped", self.skipped), ("failed", self.errors)):
            if items:  # each reason cut to a line's length here; whole in the JSON
                why = {k: v if len(v) <= 100 else v[:99] + "…" for k, v in items.items()}
                lines.append(
                    f"{title}: {len(items)}: " + "; ".join(f"{k} ({v})" for k, v in why.items())
                )
        if self.not_run:
            lines.append(f"not run ({self.stopped}): {len(self.not_run)}: {' '.join(self.not_run)}")
        return lines

    def table(self) -> list:
        """A markdown table: per family and mode, patched / unpatched and the verdict per T."""
        tokens = sorted({v.tokens for v in self.verdicts})
        lines = ["| family | shape | mode | " + " | ".join(f"T={t}" for t in tokens) + " |"]
        lines.append("|---" * (3 + len(tokens)) + "|")
        cells = {(v.family, v.mode, v.tokens): v.cell() for v in self.verdicts}
        for family in dict.fromkeys(v.family for v in self.verdicts):
            for mode in MODES:
                row = [cells.get((family, mode, t), "") for t in tokens]
                if any(row):
                    shape = self.shapes.get(family, "")
                    lines.append(f"| {family} | {shape} | {mode} | " + " | ".join(row) + " |")
        return lines

    def to_json(self) -> dict:
        verdicts = [dict(asdict(v), ratio=v.ratio) for v in self.verdicts]
        details = {f"{f} T={t}": d for (f, t), d in self.details.items()}
        return dict(
            meta=self.meta,
            verdicts=verdicts,
            shapes=self.shapes,
            details=details,
            skipped=self.skipped,
            errors=self.errors,
            not_run=self.not_run,
            stopped=self.stopped,
            summary=self.summary(),
        )

    def write_json(self, path: str) -> None:
        """Write to_json() to path (its folder made), replacing it whole (a run killed midway
        leaves the last complete file)."""
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        partial = path + ".partial"
        with open(partial, "w") as f:
            json.dump(self.to_json(), f, indent=1, sort_keys=True)
        os.replace(partial, path)

    @classmethod
    def read_json(cls, path: str) -> "Results":
        with open(path) as f:
            data = json.load(f)
        verdicts = [
            Verdict(**{k: v for k, v in d.items() if k != "ratio"}) for d in data["verdicts"]
        ]
        return cls(
            data.get("meta", {}),
            verdicts,
            data.get("shapes", {}),
            {},
            data.get("skipped", {}),
            data.get("errors", {}),
            data.get("not_run", []),
            data.get("stopped", "deadline"),
        )


def _where(v: Verdict) -> str:
    what = f"{v.family} T={v.tokens} {v.mode}"
    return (
        f"{what} ({v.ratio:.3f}x > {1 + v.spread:.3f})"
        if v.ratio is not None
        else f"{what} ({v.note})"
    )


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("json", help="a file hf_end_to_end.py --json wrote")
    results = Results.read_json(ap.parse_args(argv).json)
    print("\n".join(results.table() + [""] + results.summary()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
