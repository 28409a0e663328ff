"""The package's layers, stated by folder and read from the source (ast), so they stay true: no
import circle, and no module imports a layer above its own. A module's layer is its room's: the
folder it sits in (`fusion_bridge/plan/`, `kernels/`, ...) or, at the top of the package, its own
name. A new module in an existing folder is placed the moment it is created; a new room must be
given a layer here.

    values        spec, reasons, environment, env_vars, log, registry: plain values, the
                  environment variables and the strategy registry ("module:Class" strings)
    data          epilogue_tensors, oracle/ (the fp32 math and quant references), kernels/
    ranks         ranks/: process-group facts, check-in, agreement
    strategies    strategies/: every strategy and its workspaces
    plan          plan/: token buckets, the strategies' statuses, the pure selection, the report
    tuning        tuning/: measured tables, their format and the timing harness
    call          call/: input checks, the failure protocol, shadow mode, the custom op, tools
    build         build/: arguments, admission, self-test
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
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "fusion_bridge"

LAYERS = {
    "values": {"spec", "reasons", "environment", "env_vars", "log", "registry"},
    "data": {"epilogue_tensors", "oracle", "kernels"},
    "ranks": {"ranks"},
    "strategies": {"strategies"},
    "plan": {"plan"},
    "tuning": {"tuning"},
    "call": {"call"},
    "build": {"build"},
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


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package); the top-level kernels/ is fusion_bridge.kernels."""
    out = {}
    files = [(p, p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / PACKAGE).rglob("*.py")]
    files += [(p, (PACKAGE, "kernels", p.stem)) for p in (ROOT / "kernels").glob("*.py")]
    for path, parts in files:
        if parts[:2] == (PACKAGE, "kernels") and path.is_relative_to(ROOT / PACKAGE):
            continue  # the symlink to ../kernels, counted once above
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
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
