"""Every benchmark script still runs after a move of the package's modules, on CPU:

- `python benchmarks/<script>.py --help` exits 0 (all scripts in one subprocess, each run as
  `__main__` with `--help`, so torch is imported once);
- statically, every import of ours (fusion_bridge, benchmarks) in the script resolves, including the
  ones inside functions that --help never reaches; every attribute taken from a module or class of
  ours exists (read or assigned); and every call of a function or class of ours binds to its
  signature. Imports inside a `try` that catches ImportError (attributes: AttributeError) are the
  scripts' fallbacks for older trees and are not checked.

The shell scripts parse (`bash -n`) and print their usage without arguments."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import pathlib
import subprocess
import sys

import pytest

from tests.helpers import once_per_run

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
# imported, not run
MODULES = (
    "harness.py",
    "offline_cases.py",
    "offline_launches.py",
    "hf_real_shapes_late.py",
    "hf_real_shapes_table.py",
    "eager_cost_items.py",
    "eager_cost_report.py",
)
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.name not in MODULES)
SHELL = sorted(p.name for p in BENCH.glob("*.sh"))
OURS = ("fusion_bridge", "benchmarks")
GUARDS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
ATTRIBUTE_GUARDS = {"AttributeError", "Exception", "BaseException"}
_MISSING = object()

_DRIVER = r"""
import contextlib, io, json, runpy, sys
got = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else str(exc.code))
    except BaseException as exc:
        code = f"{type(exc).__name__}: {exc}"
    got[path] = [code, out.getvalue()]
print(json.dumps(got))
"""


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict:
    # one child per run: xdist workers share it (tests.helpers.once_per_run)
    return once_per_run(tmp_path_factory, "benchmark_helps", lambda _: _helps())


def _helps() -> dict:
    paths = [str(BENCH / name) for name in SCRIPTS]
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {pathlib.Path(k).name: v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_prints_its_help(helps, script):
    code, out = helps[script]
    assert code == 0, f"python benchmarks/{script} --help: {code}"
    assert "usage:" in out or out.strip(), f"benchmarks/{script} --help printed nothing"


def _guarded(node: ast.Try, guards: set) -> bool:
    for handler in node.handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if handler.type is None or any(isinstance(k, ast.Name) and k.id in guards for k in kinds):
            return True
    return False


def _submodule(module, name: str):
    """module.name as a submodule, or None."""
    if not hasattr(module, "__path__"):
        return None
    try:
        return importlib.import_module(f"{module.__name__}.{name}")
    except ImportError:
        return None


def _stored(func) -> set:
    """Names a function binds other than by import (arguments, assignments, loop targets)."""
    args = func.args
    names = {a.arg for a in args.args + args.posonlyargs + args.kwonlyargs}
    names |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    for node in ast.walk(func):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
    return names


class _Checker(ast.NodeVisitor):
    """Resolves our imports and checks the attributes and calls on what they bind."""

    def __init__(self, script: str):
        self.script, self.problems = script, []
        self.scopes: list[dict] = [{}]
        self.shadowed: list[set] = [set()]
        self.guarded = self.attribute_guarded = 0

    def _problem(self, node, text: str) -> None:
        self.problems.append(f"benchmarks/{self.script}:{node.lineno}: {text}")

    def _bind(self, name: str, obj) -> None:
        if name not in self.shadowed[-1]:
            self.scopes[-1][name] = obj

    def _import(self, node, name: str):
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            self._problem(node, f"import {name}: {exc}")
            return None

    def visit_Try(self, node: ast.Try) -> None:
        guarded, attribute = _guarded(node, GUARDS), _guarded(node, ATTRIBUTE_GUARDS)
        self.guarded += guarded
        self.attribute_guarded += attribute
        self.generic_visit(node)
        self.guarded -= guarded
        self.attribute_guarded -= attribute

    def _visit_function(self, node) -> None:
        stored = _stored(node)
        self.scopes.append({k: v for k, v in self.scopes[-1].items() if k not in stored})
        self.shadowed.append(stored)
        self.generic_visit(node)
        self.scopes.pop()
        self.shadowed.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if self.guarded or not alias.name.startswith(OURS):
                continue
            module = self._import(node, alias.name)
            if module is not None:
                bound = alias.asname or alias.name.split(".")[0]
                self._bind(bound, module if alias.asname else sys.modules[bound])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if self.guarded or node.level or not (node.module or "").startswith(OURS):
            return
        module = self._import(node, node.module)
        for alias in node.names if module is not None else ():
            obj = getattr(module, alias.name, _MISSING)
            obj = _submodule(module, alias.name) if obj is _MISSING else obj
            if obj is None:
                self._problem(node, f"from {node.module} import {alias.name}: no such name")
            else:
                self._bind(alias.asname or alias.name, obj)

    def _target(self, node):
        """What a name or a name.attr of ours refers to (None: not ours, or unknown)."""
        if isinstance(node, ast.Name):
            return self.scopes[-1].get(node.id)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            base = self.scopes[-1].get(node.value.id)
            if inspect.ismodule(base) or inspect.isclass(base):
                return getattr(base, node.attr, None)
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and not self.attribute_guarded:
            base = self.scopes[-1].get(node.value.id)
            if inspect.ismodule(base) or inspect.isclass(base):
                missing = not hasattr(base, node.attr)
                if missing and inspect.ismodule(base):  # a submodule not yet imported
                    missing = _submodule(base, node.attr) is None
                if missing:
                    self._problem(node, f"{node.value.id}.{node.attr}: {base!r} has no such name")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        target = self._target(node.func)
        starred = any(isinstance(a, ast.Starred) for a in node.args)
        if target is not None and callable(target) and not starred:
            try:
                signature = inspect.signature(target)
            except (TypeError, ValueError):
                signature = None
            named = {k.arg: k.value for k in node.keywords if k.arg is not None}
            # with **kwargs, only what is spelled out (its positional arguments, its names)
            spread = len(named) < len(node.keywords)
            if signature is not None:
                try:
                    (signature.bind_partial if spread else signature.bind)(*node.args, **named)
                except TypeError as exc:
                    self._problem(node, f"{ast.unparse(node.func)}(...): {exc}")
        self.generic_visit(node)


def _problems(script: str, source: str) -> list:
    checker = _Checker(script)
    checker.visit(ast.parse(source))
    return checker.problems


@pytest.mark.parametrize("script", SCRIPTS + list(MODULES))
def test_script_imports_attributes_and_calls_resolve(script):
    source = (BENCH / script).read_text()
    assert _problems(script, source) == []


def test_the_static_check_catches_a_stale_name_a_removed_global_and_a_changed_signature():
    """The check itself: the three kinds of breakage the module moves made in these scripts."""
    source = """
def f(spec):
    from fusion_bridge.kernels.tp1.launcher import OneshotConfig
    from fusion_bridge.kernels.tp1 import launcher as tp1_launch
    from fusion_bridge.testing.symm_oneshot_rig import emulated_group
    tp1_launch.CAP_REGISTERS = True
    emulated_group("oneshot", spec, 2, 2048, device="cuda", timeout=10)

def g():
    try:  # a fallback for older trees: not checked
        from fusion_bridge.kernels import symm_oneshot
    except ImportError:
        symm_oneshot = None
"""
    found = "\n".join(_problems("broken.py", source))
    assert "OneshotConfig" in found
    assert "CAP_REGISTERS" in found
    assert "emulated_group(...)" in found and "device" in found
    assert "symm_oneshot" not in found


@pytest.mark.parametrize("script", SHELL)
def test_shell_script_parses_and_prints_its_usage(script):
    assert subprocess.run(["bash", "-n", BENCH / script]).returncode == 0
    done = subprocess.run(["bash", BENCH / script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "bash benchmarks/" + script in done.stdout


def test_the_scripts_launch_tables_build_on_cpu():
    """The launch configs the GPU scripts time are host values: build them all here."""
    from benchmarks import tp1_sweep, twoshot_local
    from fusion_bridge.kernels.symm import twoshot
    from fusion_bridge.kernels.tp1.configs import Tp1Config

    for fields in twoshot_local.CONFIGS.values():
        twoshot_local.AblationConfig(**fields).product()  # the product's part validates too
    # the ablation config's defaults are the product's launch
    assert twoshot_local.AblationConfig().product() == twoshot.DEFAULT_CONFIG
    assert not set(twoshot_local.CONFIGS) & set(twoshot_local.VARIANTS)
    for tokens in (1, 16, 64, 4096):
        for quant in ("none", "nvfp4"):
            got = tp1_sweep.configs(tokens, 7168, quant, 132)
            assert got and all(isinstance(s, Tp1Config) for s in got)
            assert len({s.pdl for s in got}) == 1  # every config launches as the default does
