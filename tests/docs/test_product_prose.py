"""Product prose says what and why, never how fast, and reads as prose (issue 36).

Every product module (fusion_bridge/**/*.py and kernels/**/*.py, except the emulated-ranks rigs in
fusion_bridge/testing/ and the benchmark command fusion_bridge/cli/bench.py) is read with ast and
tokenize, never imported. Its prose is every docstring (any string statement: module, class,
function and attribute docstrings) and every comment.

(a) No performance figure. A measured time, speed-up, ratio or percentage belongs in
    docs/performance.md with the results file it came from; the code keeps the choice and its
    reason and may point there. What counts as a figure (FIGURE_PATTERNS):
    - a number followed by a time unit: `2.4 us`, `45.6 µs`, `1-3 us`, `~100 ns`, `5 ms`;
    - a ratio written as a decimal or a range followed by x: `1.12x`, `0.14-0.33x` (a bare
      integer count is not: `2x H200` is a machine, `4x W*T*H*2` a size; hex such as 0x3F80 never
      matches, its x being followed by a hex digit);
    - a percentage, a number immediately followed by %: `8%`, `4.7-7.4%` (`j % W` and `(e + 2) % 3`
      are modulo, with a space or a bracket before the %);
    - a series of decimal measurements: `5.70 / 7.09`, `8.1 / 15.4 / 113`.
    Byte sizes that define something (`HEADER_BYTES = 256`, `58.7 MB at H=7168`, "a 60 MB L2") and
    numerical error bounds are not figures and match none of these. A legitimate match is listed in
    FIGURE_EXEMPTIONS with the reason.

(b) No reflow orphan: a line of one or two short words (at most ORPHAN_MAX_CHARS characters) inside
    a paragraph, right after a full line (at least FULL_LINE characters) and before a longer line
    of the same docstring or comment block, as a mechanical wrap leaves when it pushes a line's last
    word onto a line of its own. The last line of a paragraph, a line before a bullet and a heading
    (`Returns:` over indented lines) are not orphans.

Both checks print file:line and the offending text.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT_ROOTS = ("fusion_bridge", "kernels")  # kernels/ is fusion_bridge.kernels (its __init__)
NOT_PRODUCT = ("fusion_bridge/testing/", "fusion_bridge/cli/bench.py")

FIGURE_PATTERNS = {
    "time": re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:\s*-\s*\d+(?:\.\d+)?)?\s*(?:µs|μs|us|ms|ns)\b"),
    "ratio": re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s*-\s*\d+(?:\.\d+)?x\b|(?<![\w.])\d+\.\d+x\b"),
    "percentage": re.compile(r"(?<![\w.])\d+(?:\.\d+)?%(?!\w)"),
    "series": re.compile(r"(?<![\w.])\d+\.\d+\s*/\s*\d+(?:\.\d+)?(?![\w.]*\d)"),
}
# (path, matched text) -> why it is not a performance figure
FIGURE_EXEMPTIONS = {
    ("kernels/quant.py", "1.0 / 0.0"): "the comparisons' outcomes taken as floats (a definition)",
}

ORPHAN_MAX_WORDS = 2
ORPHAN_MAX_CHARS = 14
FULL_LINE = 60


def product_modules() -> list[Path]:
    out = []
    for top in PRODUCT_ROOTS:
        for dirpath, dirnames, filenames in os.walk(ROOT / top):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                path = Path(dirpath) / name
                rel = path.relative_to(ROOT).as_posix()
                if name.endswith(".py") and not rel.startswith(NOT_PRODUCT):
                    out.append(path)
    return out


def checked_modules() -> list[Path]:
    return product_modules()


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def prose_blocks(source: str) -> list[tuple[str, list[tuple[int, str]]]]:
    """(kind, [(line number, text)]) per block of prose: one per docstring (its source lines,
    quotes included), one per run of full-line comments at one column, one per trailing comment;
    a comment's text is what follows its '#' (or '#:')."""
    lines = source.splitlines()
    blocks: list[tuple[str, list[tuple[int, str]]]] = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            span = range(node.value.lineno, node.value.end_lineno + 1)
            blocks.append(("docstring", [(n, lines[n - 1]) for n in span]))
    run: list[tuple[int, str]] = []
    column = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        n, col = tok.start
        text = re.sub(r"^#:?", "", tok.string)
        full_line = not lines[n - 1][:col].strip()
        if full_line and run and run[-1][0] == n - 1 and column == col:
            run.append((n, text))
            continue
        if run:
            blocks.append(("comment", run))
        run, column = [(n, text)], (col if full_line else None)
    if run:
        blocks.append(("comment", run))
    return blocks


def figures(path: Path) -> list[str]:
    rel = _rel(path)
    found = []
    for _, block in prose_blocks(path.read_text(encoding="utf-8")):
        for n, text in block:
            for kind, pattern in FIGURE_PATTERNS.items():
                for m in pattern.finditer(text):
                    if (rel, m.group(0)) not in FIGURE_EXEMPTIONS:
                        found.append(f"{rel}:{n}: {kind} {m.group(0)!r} in {text.strip()!r}")
    return found


def _body(text: str) -> str:
    return text.replace('"""', "").replace("'''", "").strip()


def _indent(text: str) -> int:
    return len(text) - len(text.lstrip())


def orphans(path: Path) -> list[str]:
    rel = _rel(path)
    found = []
    for _, block in prose_blocks(path.read_text(encoding="utf-8")):
        for (_, before), (n, text), (_, after) in zip(block, block[1:], block[2:]):
            prev, cur, nxt = _body(before), _body(text), _body(after)
            if not (prev and cur and nxt):
                continue  # a paragraph starts or ends here
            if len(cur.split()) > ORPHAN_MAX_WORDS or len(cur) > ORPHAN_MAX_CHARS:
                continue
            if len(prev) < FULL_LINE or len(nxt) <= len(cur):
                continue
            if nxt.startswith(("- ", "* ")):
                continue  # the line ends a bullet or paragraph; the next one starts a new one
            if cur.endswith(":") and _indent(after) > _indent(text):
                continue  # a heading over indented lines
            found.append(f"{rel}:{n}: {cur!r} between {prev[-40:]!r} and {nxt[:40]!r}")
    return found


def test_the_walk_finds_the_product_modules():
    names = {_rel(p) for p in product_modules()}
    assert len(names) >= 50
    assert {
        "kernels/symm/oneshot.py",
        "kernels/tp1/split_rows.py",
        "fusion_bridge/spec.py",
    } <= names
    # fusion_bridge/kernels/ holds only the __init__ that points the package at kernels/
    assert {n for n in names if n.startswith("fusion_bridge/kernels/")} == {
        "fusion_bridge/kernels/__init__.py"
    }
    assert not any(n.startswith(NOT_PRODUCT) for n in names)


def test_no_performance_figure_in_product_prose():
    found = [line for path in checked_modules() for line in figures(path)]
    assert not found, (
        "performance figures in product docstrings/comments (move them to docs/performance.md "
        "with their results file; keep the what and the why):\n" + "\n".join(found)
    )


def test_no_reflow_orphan_in_product_prose():
    found = [line for path in checked_modules() for line in orphans(path)]
    assert not found, (
        "one- or two-word lines left inside a paragraph (rejoin the paragraph, lines <= 100):\n"
        + "\n".join(found)
    )


@pytest.mark.parametrize(
    "text",
    [
        "2.4 us against 2.9 us",
        "45.6 µs",
        "it costs ~100 ns",
        "fork and join cost 1-3 us",
        "was 1.12x",
        "0.14-0.33x the floor",
        "4.7-7.4% slower",
        "8% at T=4096",
        "T=64 5.70 / 7.09",
    ],
)
def test_a_figure_is_found(text):
    assert _matches(text), text


@pytest.mark.parametrize(
    "text",
    [
        "-65536 == 0xFFFF0000",
        "bits 0x8000 in bf16",
        "0x3F80-0x3F8F",
        "measured on 2x H200",
        "three Lamport buffers (about 4x W*T*H*2)",
        "2 x 1024 faster than 4 x 512",
        "rows j with j % W == rank",
        "slot (e + 2) % 3",
        "HEADER_BYTES = 256",
        "58.7 MB at H=7168 in bf16",
        "a 60 MB L2",
        "fp8 2.7e-2, nvfp4 9.5e-2",
        "flashinfer 0.7.2.post1 / 0.7.4",
        "timeout: the bridge must be rebuilt",
    ],
)
def test_a_definition_is_not_a_figure(text):
    assert not _matches(text), text


def _matches(text: str) -> list[str]:
    return [m.group(0) for p in FIGURE_PATTERNS.values() for m in p.finditer(text)]


def test_an_orphan_is_found_and_a_paragraph_end_is_not(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    full = "x" * 70
    module = tmp_path / "m.py"
    module.write_text(
        f'"""{full} and\nthat\n{full}.\n\nA paragraph that ends\nhere.\n{full}.\nReturns:\n'
        f'    the outputs, as {full}\n"""\n\n'
        f"# {full} keeps\n# parity\n# {full}.\n"
        f"# - a bullet {full}\n# ends\n# - the next bullet\n"
    )
    found = orphans(module)
    assert [line.split(":")[1] for line in found] == ["2", "13"], found
