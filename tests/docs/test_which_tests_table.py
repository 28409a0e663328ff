"""tests/README.md's "Which tests do I run after changing X?" table sends a developer to every test
folder that catches a change: for each mutant of tests/mutants.json (a one-place change to a
module, with the tests that kill it), the table's row for that module names the folder of every
killing test."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _rows() -> list[tuple[list[str], str]]:
    """(the backticked names of the 'you changed' column, the rest of the row) per table row."""
    text = (ROOT / "tests" / "README.md").read_text()
    table = text.split("## Which tests do I run after changing X?")[1].split("\n## ")[0]
    rows = []
    for line in table.splitlines():
        cells = line.split(" | ")
        if line.startswith("| ") and len(cells) >= 2 and not line.startswith("| you changed"):
            rows.append((re.findall(r"`([^`]+)`", cells[0]), " | ".join(cells[1:])))
    return rows


def _match(path: str, token: str) -> int:
    """How specifically `token` names the module at `path` (0: not at all)."""
    if token.endswith("/"):
        return len(token) if path.startswith(token) or f"/{token}" in f"/{path}" else 0
    stem = Path(path).stem
    return len(token) if path.endswith(token) or stem == token else 0


def _row_for(path: str, rows) -> str:
    scored = [(max((_match(path, t) for t in tokens), default=0), rest) for tokens, rest in rows]
    best = max(scored, key=lambda s: s[0])
    assert best[0], f"no row of the table names {path}"
    return best[1]


def test_every_killing_test_folder_is_in_the_row_of_the_module_it_guards():
    rows = _rows()
    missing = []
    for mutant in json.loads((ROOT / "tests" / "mutants.json").read_text()):
        path = mutant["file"].removeprefix("fusion_bridge/")
        row = _row_for(path, rows)
        for test in mutant["tests"]:
            folder = "/".join(test.split("::")[0].split("/")[:2])
            if f"`{folder}" not in row:
                missing.append(f"{mutant['file']}: {folder} (mutant {mutant['id']})")
    assert not missing, "\n".join(sorted(set(missing)))
