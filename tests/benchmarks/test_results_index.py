"""benchmarks/results/README.md is the folder's index, and it is kept true: every file its tables
list (the first cell of each row, in backticks) exists; every file in the folder is listed; every
script it names (`benchmarks/<name>.py|.sh`, `python -m benchmarks.<name>`, `device.sh <name>`,
`two_gpus.sh <step>`) and every repository path it names exists."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
INDEX = "README.md"

# names in lower case: NAME, STEP and <file> are placeholders
_SCRIPT = re.compile(r"(?<![\w/.])benchmarks/([a-z0-9_][\w.-]*\.(?:py|sh))\b")
_MODULE = re.compile(r"python3? -m benchmarks\.(\w+)")
_DEVICE = re.compile(r"device\.sh ([a-z0-9_]+)\b")
_TWO_GPUS = re.compile(r"two_gpus\.sh ([a-z0-9_]+)\b")
_RESULT = re.compile(r"benchmarks/results/([\w.-]+)(?![\w.$<-])")  # not ..._$Q.json
_PATH = re.compile(r"(?<![\w/.])((?:fusion_bridge|kernels|tests|docs)/[\w./*-]+\.(?:py|json|md))")
_STEP = re.compile(r"^\s+([a-z_]+(?: \| [a-z_]+)*)\)", re.M)


def listed(text: str) -> dict:
    """File name -> line, from the first cell of every table row."""
    names = {}
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("|") and not set(line) <= set("|-: "):
            for name in re.findall(r"`([^`]+)`", line.split("|")[1]):
                names[name] = number
    return names


def problems(text: str, folder: pathlib.Path, root: pathlib.Path) -> list:
    """What is wrong with the index `text` of `folder`, in a repository at `root`."""
    found = []
    names = listed(text)
    if not names:
        found.append("the index lists no file")
    for name, line in names.items():
        if "/" in name or not (folder / name).is_file():
            found.append(f"line {line}: `{name}` is listed but is no file in {folder.name}/")
    for path in sorted(folder.iterdir()):
        if path.name != INDEX and path.name not in names:
            found.append(f"{path.name} is in {folder.name}/ but not in its index")
    scripts = set(_SCRIPT.findall(text)) | {f"{m}.py" for m in _MODULE.findall(text)}
    for name in sorted(scripts):
        if not (root / "benchmarks" / name).is_file():
            found.append(f"benchmarks/{name} is named but does not exist")
    for name in sorted(set(_DEVICE.findall(text)) - {"tune", "bench"}):
        if not (root / "benchmarks" / f"{name}.py").is_file():
            found.append(f"device.sh {name}: no benchmarks/{name}.py")
    two_gpus = root / "benchmarks" / "two_gpus.sh"
    arms = _STEP.findall(two_gpus.read_text()) if two_gpus.is_file() else []
    steps = {step for arm in arms for step in arm.split(" | ")}
    for step in sorted(set(_TWO_GPUS.findall(text)) - steps):
        found.append(f"two_gpus.sh {step}: no such step")
    for name in sorted(set(_RESULT.findall(text))):
        if not (folder / name).is_file():
            found.append(f"benchmarks/results/{name} is named but does not exist")
    for path in sorted(set(_PATH.findall(text))):
        if not any(root.glob(path)):
            found.append(f"{path} is named but does not exist")
    return found


def test_the_results_index_matches_the_folder_and_the_scripts():
    assert problems((RESULTS / INDEX).read_text(), RESULTS, ROOT) == []


def test_the_check_fails_on_an_unlisted_file_a_missing_file_and_a_missing_script(tmp_path):
    folder = tmp_path / "benchmarks" / "results"
    folder.mkdir(parents=True)
    (tmp_path / "benchmarks" / "tp1_local.py").write_text("")
    (tmp_path / "benchmarks" / "two_gpus.sh").write_text("case $step in\n  tune | bench) x ;;\n")
    for name in ("kept.csv", "stray.txt"):
        (folder / name).write_text("")
    text = """
| file | command | tree | what |
|---|---|---|---|
| `kept.csv` | `bash benchmarks/device.sh tp1_local --csv benchmarks/results/kept.csv` | x | y |
| `gone.csv` | `python benchmarks/ring_local.py`, `python -m benchmarks.floor` | x | y |
| `alone.csv` | `bash benchmarks/device.sh ring_local`, `two_gpus.sh floor` | x | y |
"""
    found = "\n".join(problems(text, folder, tmp_path))
    assert "`gone.csv` is listed but is no file" in found
    assert "stray.txt is in results/ but not in its index" in found
    assert "benchmarks/ring_local.py is named but does not exist" in found
    assert "benchmarks/floor.py is named but does not exist" in found
    assert "device.sh ring_local: no benchmarks/ring_local.py" in found
    assert "two_gpus.sh floor: no such step" in found
    assert "kept.csv" not in found
