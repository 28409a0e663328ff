"""Compare two trees' offline SASS (the OUTDIRs of `benchmarks/offline_sass.py`), case by case:

    python benchmarks/sass_diff.py OLD_DIR NEW_DIR [--diffs DIR]

Per case present in both, one verdict:
- `identical`: the same SASS once the line-info comments (`//## File ...`, source line numbers)
  are dropped;
- `identical but parameter offsets`: the same once, in addition, every constant-bank read of a
  kernel parameter (`c[0x0][0x210 + offset]` on sm_90) is read as the parameter it reads,
  labelled by the value the case passed it (`<case>.params.json`) and the instruction encodings
  (which carry the offsets) are dropped; the parameters whose offset moved are listed;
- `DIFFERENT`: anything else (a unified diff of the labelled SASS goes to --diffs).
Exit status 0 when no case is DIFFERENT and both sides have the same cases.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys

import triton

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PARAM_BASE = 0x210  # sm_90: kernel parameters start at c[0x0][0x210]


def param_offsets(cubin: str) -> list:
    """[(offset, size)] by parameter ordinal, from the cubin's EIATTR_KPARAM_INFO."""
    elf = subprocess.run(
        [f"{BIN}/cuobjdump", "-elf", cubin], capture_output=True, text=True, check=True
    ).stdout
    found = re.findall(
        r"Ordinal\s*:\s*0x([0-9a-f]+)\s+Offset\s*:\s*0x([0-9a-f]+)\s+Size\s*:\s*0x([0-9a-f]+)", elf
    )
    by_ordinal = {int(o, 16): (int(off, 16), int(size, 16)) for o, off, size in found}
    return [by_ordinal[i] for i in sorted(by_ordinal)]


def labelled(base: str) -> tuple[list, dict]:
    """(the SASS lines without line info, encodings or addresses, parameter reads labelled;
    label -> offset)."""
    sass = open(base + ".sass").read()
    labels = json.load(open(base + ".params.json"))
    offsets = param_offsets(base + ".cubin")
    # the compiled code has the user parameters, then Triton's two scratch pointers
    names = labels + [f"scratch{i}" for i in range(len(offsets) - len(labels))]
    where = {name: off for name, (off, _) in zip(names, offsets)}

    def name_of(match):
        at = int(match[1], 16) - PARAM_BASE
        for name, (off, size) in zip(names, offsets):
            if off <= at < off + size:
                return f"c[{name}{'+' + str(at - off) if at > off else ''}]"
        return match[0]

    out = []
    for line in sass.splitlines():
        if line.lstrip().startswith("//"):
            continue
        line = re.sub(r"/\*\s*0x[0-9a-f]+\s*\*/", "", line)  # encodings
        line = re.sub(r"/\*[0-9a-f]{4,}\*/", "", line)  # addresses
        line = re.sub(r"c\[0x0\]\[(0x[0-9a-f]+)\]", name_of, line)
        line = re.sub(r"\s+", " ", line).strip()
        if line:
            out.append(line)
    return out, where


def without_line_info(path: str) -> list:
    return [x for x in open(path).read().splitlines() if not x.lstrip().startswith("//##")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--diffs", help="write <case>.diff here for the cases that differ")
    args = ap.parse_args(argv)

    def cases(d):
        return {f[: -len(".sass")] for f in os.listdir(d) if f.endswith(".sass")}

    old, new = cases(args.old), cases(args.new)
    status = 0 if old == new else 1
    for name in sorted(old ^ new):
        print(f"{name:28s} only in {'old' if name in old else 'new'}")
    for name in sorted(old & new):
        a, b = (os.path.join(d, name) for d in (args.old, args.new))
        if without_line_info(a + ".sass") == without_line_info(b + ".sass"):
            print(f"{name:28s} identical")
            continue
        (la, wa), (lb, wb) = labelled(a), labelled(b)
        if la == lb:
            moved = [f"{k} {wa[k]:#x}->{wb[k]:#x}" for k in wb if k in wa and wa[k] != wb[k]]
            added = sorted(set(wb) - set(wa))
            print(f"{name:28s} identical but parameter offsets: moved {', '.join(moved) or '-'}"
                  f"{'; new (unread) ' + ', '.join(added) if added else ''}")  # fmt: skip
            continue
        status = 1
        diff = list(difflib.unified_diff(la, lb, f"old/{name}", f"new/{name}", lineterm=""))
        print(f"{name:28s} DIFFERENT ({len(la)} vs {len(lb)} instructions, {len(diff)} diff lines)")
        if args.diffs:
            os.makedirs(args.diffs, exist_ok=True)
            with open(os.path.join(args.diffs, name + ".diff"), "w") as f:
                f.write("\n".join(diff) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
