"""The launch cache's facts about each Triton minor version (kernels/triton_launchers.py) against
that version's own sources, on CPU: the positional layout of `CompiledKernel.run` as
`JITFunction.run` calls it, the compile options `JITFunction.run` puts into its cache key, the
layout of `CudaLauncher.launch` (the C launcher the fast path calls) as `CudaLauncher.__call__`
calls it, and the attributes the fast path reads; then the arguments the cache really passes (a
fake launcher records them) are read back slot by slot with the layout taken from the source.

The sources: the installed Triton when it is that minor version, else the files taken from that
version's wheel (`pip download`, kept in ~/.cache/fusion_bridge/triton-sources/); a version whose
wheel cannot be had skips, saying so (conftest counts skips per reason)."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from fusion_bridge.kernels import triton_launchers as tl
from fusion_bridge.kernels.launch_cache import KernelLauncher
from tests.kernels.test_launch_cache import (
    STREAM,
    FakeCompiled,
    FakeCudaLauncher,
    FakeKernel,
    fake_runtime,
    tensors,
)

ROOT = Path(__file__).resolve().parents[2]
# the newest patch release of each minor version pyproject allows (3.7.1 over 3.7.0)
NEWEST_PATCH = {(3, 6): "3.6.0", (3, 7): "3.7.1", (3, 8): "3.8.0", (3, 9): "3.9.0"}
FILES = ("runtime/jit.py", "backends/nvidia/driver.py", "compiler/compiler.py")
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
CACHE = CACHE / "fusion_bridge" / "triton-sources"


def _installed() -> tuple[str, Path] | None:
    try:
        import triton
    except ImportError:
        return None
    return importlib.metadata.version("triton"), Path(triton.__file__).parent


def sources(minor: tuple[int, int]) -> Path:
    """The folder holding `triton/<FILES>` of this minor version."""
    installed = _installed()
    if installed and tuple(int(x) for x in installed[0].split(".")[:2]) == minor:
        return installed[1]
    version = NEWEST_PATCH[minor]
    folder = CACHE / version / "triton"
    if all((folder / f).is_file() for f in FILES):
        return folder
    from filelock import FileLock  # a dependency of torch

    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE / f"{version}.lock")):  # xdist workers: one download
        if all((folder / f).is_file() for f in FILES):
            return folder
        with tempfile.TemporaryDirectory() as tmp:
            run = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
                + ["--retries", "0", "--timeout", "30", "-q", "-d", tmp, f"triton=={version}"],
                capture_output=True,
                text=True,
                timeout=900,
            )
            wheels = list(Path(tmp).glob("triton-*.whl"))
            if run.returncode or not wheels:
                why = (run.stderr.strip().splitlines() or ["no wheel"])[-1][:200]
                pytest.skip(f"Triton {version}'s wheel could not be downloaded ({why})")
            staging = Path(tmp) / "src"
            with zipfile.ZipFile(wheels[0]) as wheel:
                for f in FILES:
                    wheel.extract(f"triton/{f}", staging)
            (CACHE / version).mkdir(exist_ok=True)
            os.replace(staging / "triton", folder)
    return folder


@pytest.fixture(params=sorted(NEWEST_PATCH), ids=lambda v: f"triton{v[0]}.{v[1]}")
def version(request):
    return request.param


def _tree(folder: Path, name: str) -> ast.Module:
    return ast.parse((folder / name).read_text())


def _method(module: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    for node in module.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"no {cls}.{name}")


def _calls(fn: ast.FunctionDef, target: str) -> list[ast.Call]:
    """Calls of `target` (dotted source text, e.g. kernel.run) anywhere in fn."""
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func) == target]


def run_slots(folder: Path) -> list[str]:
    """CompiledKernel.run's positional slots, as JITFunction.run calls it."""
    (call,) = _calls(_method(_tree(folder, "runtime/jit.py"), "JITFunction", "run"), "kernel.run")
    out = []
    for arg in call.args:
        if isinstance(arg, ast.Starred):
            out.append("*args")
        elif isinstance(arg, ast.Name) and re.fullmatch(r"grid_[012]", arg.id):
            out.append("grid_" + "xyz"[int(arg.id[-1])])
        else:
            out.append(arg.attr if isinstance(arg, ast.Attribute) else arg.id)
    return out


def launch_slots(folder: Path) -> list[str]:
    """CudaLauncher.launch's positional slots, as CudaLauncher.__call__ calls it: __call__'s
    parameters bound to run_slots, `self.X` as X, the spread varargs as the run slots they hold,
    the varargs as one tuple (directly or through a plain alias, `kernel_args = args`) as
    "args"."""
    call_fn = _method(_tree(folder, "backends/nvidia/driver.py"), "CudaLauncher", "__call__")
    params = [a.arg for a in call_fn.args.args][1:]  # without self
    run = run_slots(folder)
    bound = dict(zip(params, run))
    spread = run[len(params) :]
    varargs = {call_fn.args.vararg.arg}
    for node in call_fn.body:  # kernel_args = args
        if isinstance(node, ast.Assign) and ast.unparse(node.value) in varargs:
            varargs |= {ast.unparse(t) for t in node.targets}
    (call,) = _calls(call_fn, "self.launch")
    out: list[str] = []
    for arg in call.args:
        text = ast.unparse(arg)
        if isinstance(arg, ast.Starred):
            assert ast.unparse(arg.value) in varargs, text
            out += spread
        elif text in varargs:
            out.append("args")
        elif text.startswith("self."):
            out.append(text[len("self.") :])
        else:
            out.append(bound.get(text, text))
    return out


def _self_attributes(fn: ast.FunctionDef) -> set[str]:
    return {
        t.attr
        for n in ast.walk(fn)
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"
    }


def test_the_ported_versions_are_the_ones_pyproject_allows():
    """Every Triton minor version pyproject allows has a launcher layout and key options, and the
    cache claims no other: widening the range fails here until the new version is ported."""
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"triton>=(\d+)\.(\d+),<(\d+)\.(\d+)"', text)
    assert m, "pyproject's triton requirement is not of the form triton>=A.B,<C.D"
    lo_major, lo, hi_major, hi = map(int, m.groups())
    assert lo_major == hi_major == 3, m.group(0)
    allowed = {(3, minor) for minor in range(lo, hi)}
    assert set(tl.LAUNCH_LAYOUTS) == set(tl.KEY_OPTIONS) == set(NEWEST_PATCH) == allowed


def test_compiled_kernel_run_takes_the_run_layout(version):
    folder = sources(version)
    assert run_slots(folder) == list(tl.RUN_LAYOUT)
    run = _method(_tree(folder, "runtime/jit.py"), "JITFunction", "run")
    last = run.body[-1]
    assert isinstance(last, ast.Return) and ast.unparse(last.value) == "kernel", (
        "JITFunction.run no longer returns the CompiledKernel it launched"
    )
    compiled = _tree(folder, "compiler/compiler.py")
    init = _self_attributes(_method(compiled, "CompiledKernel", "__init__"))
    assert {"function", "packed_metadata"} <= init
    names = [n.name for n in ast.walk(compiled) if isinstance(n, ast.FunctionDef)]
    assert "run" in names or "run" in init


def test_the_key_holds_the_compile_options_jit_run_adds(version):
    """JITFunction.run sets kwargs["debug"] (from knobs.runtime) and one kwargs entry per
    knobs.compilation value: those are part of Triton's key, so they must be part of ours."""
    run = _method(_tree(sources(version), "runtime/jit.py"), "JITFunction", "run")
    options = {}
    for node in ast.walk(run):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
            target = node.targets[0]
            if ast.unparse(target.value) == "kwargs":
                options[target.slice.value] = ast.unparse(node.value)
    assert "knobs.runtime.debug" in options.pop("debug")
    assert options == {name: f"knobs.compilation.{name}" for name in tl.KEY_OPTIONS[version]}


def test_the_c_launcher_takes_the_layout_of_its_version(version):
    folder = sources(version)
    assert launch_slots(folder) == list(tl.LAUNCH_LAYOUTS[version])
    driver = _tree(folder, "backends/nvidia/driver.py")
    attributes = _self_attributes(_method(driver, "CudaLauncher", "__init__"))
    needed = {"launch", "global_scratch_size", "profile_scratch_size"}
    needed |= {a for a in tl.LAUNCH_LAYOUTS[version] if a in tl._LAUNCHER_ATTRIBUTES}
    assert needed <= attributes, needed - attributes
    # a scratch size of 0 is passed as None (what the fast path passes)
    call_fn = _method(driver, "CudaLauncher", "__call__")
    (alloc,) = [n for n in call_fn.body if getattr(n, "name", "") == "allocate_scratch"]
    assert "if size > 0:" in ast.unparse(alloc) and ast.unparse(alloc.body[-1]) == "return None"
    # GSan (3.8+) adds arguments in __call__: the fast path must know the attribute that says so
    gsan = "gsan_enabled" in ast.unparse(call_fn)
    assert gsan == ("gsan_enabled" in attributes) == (version >= (3, 8))


SENTINELS = {
    "launch_cooperative_grid": "cooperative-flag",
    "launch_pdl": "pdl-flag",
    "arg_annotations": "annotations",
    "kernel_signature": b"signature",
}


def _read_back(call: tuple, slots: list[str], args: tuple) -> dict:
    """{slot: value} of one recorded call, read with a layout; the kernel arguments checked."""
    out, rest = {}, list(call)
    for slot in slots:
        if slot == "*args":
            assert tuple(rest) == args, rest
            rest = []
        elif slot == "args":
            assert rest.pop(0) == args
        else:
            out[slot] = rest.pop(0)
    assert not rest, f"{len(rest)} arguments left over"
    return out


EXPECTED = {
    **dict(grid_x=3, grid_y=7, grid_z=1, stream=STREAM, function="function1"),
    **dict(packed_metadata=(4, 1, 0), launch_metadata=None),
    **dict(
        launch_enter_hook=None, launch_exit_hook=None, global_scratch=None, profile_scratch=None
    ),
}


def _launcher(version, scratch=0, gsan=None):
    run = FakeCudaLauncher(deep=True)
    for name, value in SENTINELS.items():
        setattr(run, name, value)
    run.global_scratch_size = scratch
    if gsan is not None:
        run.gsan_enabled = gsan
    kernel = FakeKernel(lambda i: FakeCompiled(i, run))
    return (
        kernel,
        run,
        KernelLauncher(kernel, ("BLOCK", "FLAG"), runtime=fake_runtime(version=version)),
    )


def test_the_cache_passes_each_argument_where_the_versions_launcher_reads_it(version):
    """What the cache really passes to the C launcher, read back with the layout parsed from that
    version's driver.py: every slot holds what Triton itself would pass there."""
    kernel, run, launch = _launcher(version)
    x, y = tensors()
    for _ in range(2):  # the first launches normally, the second through the cache
        launch((3, 7), (x, y, 3, 0.5), (256, True), 4)
    assert len(kernel.normal) == 1 and run.calls == [] and len(run.launch_calls) == 1
    got = _read_back(run.launch_calls[0], launch_slots(sources(version)), (x, y, 3, 0.5, 256, True))
    assert got == {s: {**EXPECTED, **SENTINELS}[s] for s in got}


def _through_cudalauncher_call(version, **launcher):
    kernel, run, launch = _launcher(version, **launcher)
    x, y = tensors()
    for _ in range(2):
        launch((3, 7), (x, y, 3, 0.5), (256, True), 4)
    assert len(kernel.normal) == 1 and run.launch_calls == [] and len(run.calls) == 1
    got = _read_back(run.calls[0], run_slots(sources(version)), (x, y, 3, 0.5, 256, True))
    assert got == {s: EXPECTED[s] for s in got}


def test_a_launch_with_scratch_goes_through_cudalauncher_call(version):
    """Triton allocates scratch in CudaLauncher.__call__: then the cache calls that, with the
    layout JITFunction.run uses, read back from the version's jit.py."""
    _through_cudalauncher_call(version, scratch=128)


@pytest.mark.parametrize(
    "version", [v for v in NEWEST_PATCH if v >= (3, 8)], ids=lambda v: f"triton{v[0]}.{v[1]}"
)
def test_a_launch_with_gsan_goes_through_cudalauncher_call(version):
    """GSan (3.8+) adds its arguments in CudaLauncher.__call__: the cache calls that."""
    _through_cudalauncher_call(version, gsan=True)
