"""The package's layers, stated by folder and read from the source (ast), so they stay true: no
import circle, and no module imports a layer above its own. A module's layer is its room's: the
folder it sits in (`fusion_bridge/plan/`, `kernels/`, ...) or, at the top of the package, its own
name. A new module in an existing folder is placed the moment it is created; a new room must be
given a layer here. Every module is read: every .py file under fusion_bridge/ and under the
top-level kernels/ (fusion_bridge.kernels), checked against a second listing of the tree, so no
folder can drop out of the walk; and no product module imports the test rigs (testing/).

    values        spec (+ spec_fields), reasons, environment, env_vars, log, registry: plain
                  values, the environment variables and the strategy registry ("module:Class"
                  strings)
    data          epilogue_tensors, oracle/ (the fp32 math and quant references), kernels/
    ranks         ranks/: process-group facts, check-in, agreement
    strategies    strategies/: every strategy and its workspaces
    plan          plan/: token buckets, the strategies' statuses, the pure selection, the report
    tuning        tuning/: measured tables, their format and the timing harness
    call          call/: input checks, the failure protocol, shadow mode, the custom op, tools
    assembly      assembly/: arguments, admission, self-test
    bridge        bridge.py: FusionBridge
    testing       testing/: the emulated-ranks rigs (no product module imports them)
    facade        fusion_bridge itself (the model author's names)
    integrations  adapters for other people's model code
    cli           the command-line tools

Every import counts: at module level, inside functions (a circle closed at call time is still a
circle) and under `if TYPE_CHECKING:`. `registry` finds strategy classes by their "module:Class"
strings at run time, which is the registry's one job, not an import of a strategy.

The CLI uses the public names only: the facade's and the strategy-author API's `__all__`
(`fusion_bridge`, `fusion_bridge.strategies`), its own modules, and the public names of the tool
modules listed in CLI_TOOL_MODULES; never a strategy module, a kernel or the bridge's internals.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "fusion_bridge"

LAYERS = {
    "values": {"spec", "spec_fields", "reasons", "environment", "env_vars", "log", "registry"},
    "data": {"epilogue_tensors", "oracle", "kernels"},
    "ranks": {"ranks"},
    "strategies": {"strategies"},
    "plan": {"plan"},
    "tuning": {"tuning"},
    "call": {"call"},
    "assembly": {"assembly"},
    "bridge": {"bridge"},
    "testing": {"testing"},
    "facade": {""},
    "integrations": {"integrations"},
    "cli": {"cli", "__main__"},
}
ORDER = list(LAYERS)
# env_vars and log: the CLI validates the FUSION_BRIDGE_* variables and applies the log level first
CLI_TOOL_MODULES = {
    "environment",
    "spec",
    "plan.planner",
    "plan.report",
    "tuning.tables",
    "oracle.numerics",
    "oracle.synthetic",
    "env_vars",
    "log",
}


# Where each package's modules live on disk: the package folder, and the top-level kernels/ folder
# that fusion_bridge/kernels/__init__.py names as fusion_bridge.kernels' __path__ (the project's
# layout keeps kernels/ at the top level). Every .py file under these folders is a module.
SOURCE_ROOTS = {PACKAGE: ROOT / PACKAGE, f"{PACKAGE}.kernels": ROOT / "kernels"}
# top-level folders that hold no package modules (everything else with .py files must be mapped)
NOT_PACKAGE = {"tests", "benchmarks", "migration", "docs", "build", "dist"}


def _walk(top: Path):
    """Every .py file under `top`, recursively (os.walk lists a directory link without entering
    it, so nothing is read twice and nothing hides behind a link: test_every_python_file_...)."""
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
        yield from (Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package), for every .py file under SOURCE_ROOTS."""
    out: dict[str, tuple[Path, bool]] = {}
    for prefix, top in SOURCE_ROOTS.items():
        for path in _walk(top):
            parts = (*prefix.split("."), *path.relative_to(top).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            assert name not in out, f"{name} is both {out[name][0]} and {path}"
            out[name] = (path, is_package)
    return out


MODULES = _modules()


def imports_of(name: str) -> list[tuple[str, str]]:
    """(imported fusion_bridge module, imported name or "") for every import in module `name`."""
    path, is_package = MODULES[name]
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for a in node.names:
                sub = f"{module}.{a.name}"
                found.append((sub, "") if sub in MODULES else (module, a.name))
    return [(m, n) for m, n in found if m == PACKAGE or m.startswith(PACKAGE + ".")]


def layer_of(name: str) -> str:
    inner = name[len(PACKAGE) + 1 :] if name != PACKAGE else ""
    head = inner.split(".")[0]
    for layer, members in LAYERS.items():
        if head in members or (inner == "" and "" in members):
            return layer
    raise AssertionError(f"{name} belongs to no layer: add it to LAYERS in {__file__}")


GRAPH = {name: sorted({m for m, _ in imports_of(name)} - {name}) for name in MODULES}


def test_every_module_has_a_layer():
    for name in MODULES:
        layer_of(name)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_a_higher_layer(name):
    mine = ORDER.index(layer_of(name))
    higher = [m for m in GRAPH[name] if ORDER.index(layer_of(m)) > mine]
    assert not higher, f"{name} ({layer_of(name)}) imports a higher layer: {higher}"


def test_values_import_only_values():
    for name in MODULES:
        if layer_of(name) == "values":
            others = [m for m in GRAPH[name] if layer_of(m) != "values"]
            assert not others, f"{name} is a value module but imports {others}"


def _cycle(graph: dict[str, list[str]]) -> list[str]:
    """One import circle (as a path that returns to its start), or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_no_import_circle():
    assert _cycle(GRAPH) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == ["a", "b", "c", "a"]


def test_the_cli_uses_public_names_only():
    public_api = {
        PACKAGE: set(importlib.import_module(PACKAGE).__all__),
        f"{PACKAGE}.strategies": set(importlib.import_module(f"{PACKAGE}.strategies").__all__),
    }
    tools = {f"{PACKAGE}.{m}" for m in CLI_TOOL_MODULES}
    for name in MODULES:
        if layer_of(name) != "cli":
            continue
        for module, imported in imports_of(name):
            if layer_of(module) == "cli":
                continue
            if module in public_api:
                assert imported in public_api[module], (
                    f"{name} imports {imported or module!r} from {module}, which is not in its "
                    f"__all__ {sorted(public_api[module])}"
                )
            else:
                assert module in tools, (
                    f"{name} imports {module}: the CLI uses {sorted(public_api)}, its own modules "
                    f"and the tool modules {sorted(CLI_TOOL_MODULES)} only"
                )
                assert not imported.startswith("_"), (name, module, imported)


def test_the_integrations_use_the_model_authors_names_only():
    """An adapter is model code written against the package: the facade's `__all__` and its own
    modules, nothing else."""
    public = set(importlib.import_module(PACKAGE).__all__)
    for name in MODULES:
        if layer_of(name) != "integrations":
            continue
        for module, imported in imports_of(name):
            if layer_of(module) == "integrations":
                continue
            assert module == PACKAGE and imported in public, (
                f"{name} imports {imported or module!r} from {module}; an integration uses the "
                f"names in fusion_bridge.__all__ {sorted(public)} only"
            )


def test_every_python_file_of_the_package_is_a_module_here():
    """The walk misses no folder: every .py file of the repository outside the non-package folders
    (found by a second, independent listing: pathlib's glob from the repository root) is one of
    MODULES, and each module is where Python's import system finds it (so the dotted names are
    right; kernels/tp1 and kernels/symm were once skipped)."""
    on_disk = {
        path.resolve()
        for top in ROOT.iterdir()
        if top.is_dir() and top.name not in NOT_PACKAGE and not top.name.startswith(".")
        for path in top.glob("**/*.py")
        if "__pycache__" not in path.parts
    }
    found = {path.resolve() for path, _ in MODULES.values()}
    assert found == on_disk, (
        f"not walked: {sorted(map(str, on_disk - found))}; walked twice or outside the tree: "
        f"{sorted(map(str, found - on_disk))}"
    )
    assert len(MODULES) == len(on_disk)
    for folder in ("kernels/tp1", "kernels/symm", "fusion_bridge/kernels"):
        assert any(p.parent == ROOT / folder for p, _ in MODULES.values()), folder
    for name, (path, _) in MODULES.items():
        spec = importlib.util.find_spec(name)
        assert spec is not None and Path(spec.origin).resolve() == path.resolve(), (name, spec)


def test_no_product_module_imports_the_test_rigs():
    """fusion_bridge/testing/ (the emulated-ranks rigs) serves tests and benchmarks only: no other
    module of the package, kernels/ included, imports it (at any depth, in any function)."""
    rigs = f"{PACKAGE}.testing"
    assert any(name.startswith(rigs + ".") for name in MODULES), f"no {rigs} modules found"
    found = [
        (name, module)
        for name in MODULES
        if not (name == rigs or name.startswith(rigs + "."))
        for module, _ in imports_of(name)
        if module == rigs or module.startswith(rigs + ".")
    ]
    assert not found, f"product modules import the test rigs: {found}"


def test_the_wheel_packages_every_module_folder():
    """pyproject lists its packages by hand: a folder of modules missing from the list (or mapped
    to the wrong folder by package-dir) would be left out of the wheel, though every test run from
    the source tree passes. Each folder that holds modules is exactly one listed package."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = setup.get("package-dir", {})

    def folder(package: str) -> Path:
        parts = package.split(".")
        for i in range(len(parts), 0, -1):  # the longest mapped prefix, as setuptools resolves it
            if ".".join(parts[:i]) in package_dir:
                return ROOT / package_dir[".".join(parts[:i])] / Path(*parts[i:])
        return ROOT / Path(*parts)

    listed = {folder(p).resolve(): p for p in setup["packages"]}
    folders = {path.parent.resolve() for path, _ in MODULES.values()}
    folders.discard((ROOT / PACKAGE / "kernels").resolve())  # the source tree's pointer only
    assert set(listed) == folders, (
        f"folders of modules not packaged: {sorted(map(str, folders - set(listed)))}; listed "
        f"packages without modules: {sorted(listed[f] for f in set(listed) - folders)}"
    )
