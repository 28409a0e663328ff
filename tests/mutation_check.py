"""Mutation check: apply deliberate small breakages to a copy of the tree, run the tests named for
each, and report the ones the tests did not catch (survivors).

Each mutant (tests/mutants.json) is one observable breakage: an exact text `find` in `file`
(relative to the repository root; it must occur exactly once) replaced by `replace`, the `tests`
(pytest node ids or files) expected to kill it, and `why` (what a user would see). A mutant is
  killed      its tests fail with the edit applied (pytest exit 1)
  survived    its tests pass with the edit applied: a gap in the suite
  stale       `find` does not occur exactly once: the code moved; re-derive the mutant
  error       pytest could not run (collection error, usage error, timeout): look at `output`
  skipped     the mutant's `requires` (e.g. ["transformers>=5.25"]: a family only that release
              has) is not met by the installed packages; the reason is reported, its tests are
              not run, and it counts neither as killed nor as a survivor
`--baseline` first runs every selected mutant's tests on the unmodified copy; a test that fails
there makes every verdict on it meaningless, so the run stops.

Usage (from the repository root, with the package's environment active):
  python tests/mutation_check.py --list
  python tests/mutation_check.py --only planner-tie-last --json
  python tests/mutation_check.py --tag cpu --baseline --json > mutation.json
  python tests/mutation_check.py --mutants my_mutants.json --only x -- -x -q   (extra pytest args)

Run it on each new kernel or protocol change: add the change's mutants to the list, check that each
is killed. It is not part of the CI suite (every mutant costs one pytest run).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_MUTANTS = ROOT / "tests" / "mutants.json"
# what a copy of the tree leaves out (never read by the tests, or large)
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".device", ".wt", ".whl", "build"}
OUTPUT_TAIL = 3000  # characters of pytest's output kept per run


def load_mutants(path: pathlib.Path) -> list[dict]:
    """The mutant list: a JSON array of {id, file, find, replace, tests, why, tags?, requires?}."""
    mutants = json.loads(path.read_text())
    seen = set()
    for m in mutants:
        missing = {"id", "file", "find", "replace", "tests", "why"} - set(m)
        if missing:
            raise ValueError(f"{path}: mutant {m.get('id', m)!r} lacks {sorted(missing)}")
        if m["id"] in seen:
            raise ValueError(f"{path}: mutant id {m['id']!r} appears twice")
        if m["find"] == m["replace"]:
            raise ValueError(f"{path}: mutant {m['id']!r} changes nothing")
        seen.add(m["id"])
    return mutants


def copy_tree(src: pathlib.Path, dst: pathlib.Path) -> None:
    """The working tree (symlinks kept as links)."""
    shutil.copytree(
        src,
        dst,
        symlinks=True,
        # build/ only at the root (setuptools' scratch folder), not a source folder of that name
        ignore=lambda d, names: [
            n
            for n in names
            if n in SKIP_DIRS - {"build"}
            or n.endswith(".egg-info")
            or (n == "build" and pathlib.Path(d).resolve() == src.resolve())
        ],
    )


def apply(tree: pathlib.Path, mutant: dict) -> tuple[Optional[str], Optional[str]]:
    """Edit the copy: (the file's original text, None) when applied, else (None, why not: the
    mutant is stale)."""
    path = tree / mutant["file"]
    if not path.is_file():
        return None, f"{mutant['file']} does not exist"
    text = path.read_text()
    count = text.count(mutant["find"])
    if count != 1:
        return None, f"`find` occurs {count} times in {mutant['file']} (must be exactly once)"
    path.write_text(text.replace(mutant["find"], mutant["replace"]))
    return text, None


def run_tests(tree: pathlib.Path, tests: list[str], extra: list[str], timeout_s: float) -> dict:
    """pytest in the copy: {rc, seconds, failed (node ids), output (tail)}."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tree)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != "."]
    )
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *extra, *tests]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s
        )
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = -1
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
        out += f"\n[mutation_check] timed out after {timeout_s:g} s"
    failed = [
        line[len("FAILED ") :].split(" - ")[0]
        for line in out.splitlines()
        if line.startswith("FAILED ")
    ]
    return {
        "rc": rc,
        "seconds": round(time.monotonic() - start, 1),
        "failed": failed,
        "output": out[-OUTPUT_TAIL:],
    }


def verdict(rc: int) -> str:
    return {0: "survived", 1: "killed"}.get(rc, "error")


def unmet(mutant: dict) -> Optional[str]:
    """Why the installed packages cannot run this mutant's tests (its `requires`, pip-style
    requirement strings such as "transformers>=5.25"), or None."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    for spec in mutant.get("requires", ()):
        req = Requirement(spec)
        try:
            have = version(req.name)
        except PackageNotFoundError:
            return f"needs {spec}; {req.name} is not installed"
        if not req.specifier.contains(have, prereleases=True):
            return f"needs {spec}; installed {req.name} {have}"
    return None


def select(mutants: list[dict], only: list[str], tags: list[str]) -> tuple[list[dict], list[dict]]:
    """(mutants to run, rows of the selected mutants skipped for an unmet `requires`)."""
    unknown = set(only) - {m["id"] for m in mutants}
    if unknown:
        raise SystemExit(f"mutation_check: unknown mutant id(s) {sorted(unknown)}")
    chosen = [m for m in mutants if not only or m["id"] in only]
    if tags:
        chosen = [m for m in chosen if set(tags) & set(m.get("tags", ()))]
    skipped = [
        {**{k: m[k] for k in ("id", "file", "why", "tests")}, "status": "skipped", "detail": why}
        for m in chosen
        if (why := unmet(m)) is not None
    ]
    ids = {row["id"] for row in skipped}
    return [m for m in chosen if m["id"] not in ids], skipped


def markdown(mutants: list[dict]) -> str:
    """The table tests/README.md keeps: mutant, what it breaks, the tests that kill it."""
    lines = ["| mutant | file | what it breaks | killed by |", "|---|---|---|---|"]
    for m in mutants:
        tests = "<br>".join(f"`{t}`" for t in m["tests"])
        why = m["why"].replace("|", "\\|")  # a pipe would end the cell
        lines.append(f"| `{m['id']}` | `{m['file']}` | {why} | {tests} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tests/mutation_check.py",
        description=(
            "Apply each mutant (an exact one-place edit) to a copy of the tree, run the tests "
            "named for it, report survivors. Exit status: 0 when every selected mutant is "
            "killed, 1 when one survived or is stale, 2 on an error (or a failing baseline)."
        ),
        epilog="Arguments after `--` go to pytest (e.g. -- -x -m gpu).",
    )
    parser.add_argument(
        "--mutants",
        type=pathlib.Path,
        default=DEFAULT_MUTANTS,
        help="JSON list of mutants (default: %(default)s)",
    )
    parser.add_argument("--only", nargs="+", default=[], metavar="ID", help="these mutants only")
    parser.add_argument(
        "--tag", nargs="+", default=[], help="mutants with one of these tags only (e.g. cpu, gpu)"
    )
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument(
        "--markdown", action="store_true", help="print the tests/README.md table and exit"
    )
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="first run the selected mutants' tests on the unmodified copy (they must pass)",
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds per pytest run (default %(default)s)"
    )
    parser.add_argument("--root", type=pathlib.Path, default=ROOT, help="tree to copy")
    parser.add_argument(
        "--keep", action="store_true", help="keep the copy (its path is reported) for a look"
    )
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    chosen, skipped = select(load_mutants(args.mutants), args.only, args.tag)
    if args.list:
        for m in chosen:
            print(f"{m['id']:40s} {m['file']}: {m['why']}")
        return 0
    if args.markdown:
        print(markdown(chosen))
        return 0

    def say(msg: str) -> None:
        print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="mutation_check_"))
    tree = workdir / "tree"
    copy_tree(args.root.resolve(), tree)
    report: dict = {"root": str(args.root.resolve()), "copy": str(tree), "mutants": skipped}
    for row in skipped:
        say(f"skipped  {row['id']} ({row['detail']})")
    status = 0
    try:
        if args.baseline:
            tests = list(dict.fromkeys(t for m in chosen for t in m["tests"]))
            base = run_tests(tree, tests, extra, args.timeout)
            report["baseline"] = base
            say(f"baseline: rc={base['rc']} in {base['seconds']} s")
            if base["rc"] != 0:
                say(base["output"])
                status = 2
                chosen = []
        for m in chosen:
            row = {k: m[k] for k in ("id", "file", "why", "tests")}
            original, why_not = apply(tree, m)
            if original is None:
                row.update(status="stale", detail=why_not)
            else:
                try:
                    row.update(run_tests(tree, m["tests"], extra, args.timeout))
                finally:
                    (tree / m["file"]).write_text(original)
                row["status"] = verdict(row["rc"])
            report["mutants"].append(row)
            say(
                f"{row['status']:8s} {m['id']}"
                + (
                    f" ({row['seconds']} s; failed: {', '.join(row['failed']) or '-'})"
                    if "seconds" in row
                    else f" ({row.get('detail')})"
                )
            )
            if row["status"] in ("survived", "stale"):
                status = max(status, 1)
            elif row["status"] == "error":
                status = 2
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    counts: dict[str, int] = {}
    for row in report["mutants"]:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    report["summary"] = counts
    report["survivors"] = [
        r["id"] for r in report["mutants"] if r["status"] not in ("killed", "skipped")
    ]
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        say(f"summary: {counts}; not killed: {report['survivors'] or 'none'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
