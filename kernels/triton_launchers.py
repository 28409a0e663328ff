"""The installed Triton's launch internals, per minor version: what the launch cache
(kernels/launch_cache.py) reads per call, and the positional layout of the launchers it calls.

Each Triton minor version that pyproject allows (3.6 to 3.9) is ported: its facts below were read
from that version's `triton/runtime/jit.py` and `triton/backends/nvidia/driver.py`, and
tests/kernels/test_launch_cache_versions.py checks them against those files (the installed
Triton's, or its wheel's); the GPU tests (tests/kernels/test_launch_cache_compiled.py) have run
the fast path with 3.6, whose layout differs from 3.7's on. A launcher's positional layout cannot
be feature-detected, so the version picks it; a version not in `LAUNCH_LAYOUTS` gets Triton's own
(slower) launch. Relied on:

- `JITFunction.run(...)` (what `kernel[grid](...)` calls) returns the `CompiledKernel` it launched
  and puts the compile options `KEY_OPTIONS[version]` into its cache key (3.9 adds
  `knobs.compilation.fpsan_homomorphic_casts`; from 3.7 a stages-inspection hook adds its own
  field, so the fast path steps aside while one is set); `JITFunction.arg_names`,
  `.used_global_vals` and `.pre_run_hooks` (we cache only when both are empty: Triton re-checks
  globals per call and runs the hooks);
- `CompiledKernel.run` (a `CudaLauncher`, called as `RUN_LAYOUT`: grid, stream, function, packed
  metadata, launch metadata, the two hooks, then every argument in parameter order, constexpr
  slots included), `.function` and `.packed_metadata`; an object with `.result` (asynchronous
  compile) is not cached. An entry holds the `CompiledKernel` too: from 3.9 it unloads its module
  when it is collected;
- `CudaLauncher.launch`, the C launcher, called directly when both scratch sizes
  (`.global_scratch_size`, `.profile_scratch_size`) are 0 (Triton then passes None for both) and
  no GSan instrumentation is compiled in (`.gsan_enabled`, 3.8+), else `CudaLauncher.__call__`.
  Its layout (`LAUNCH_LAYOUTS`) changed in 3.7: 3.6 generates one C launcher per kernel, which
  takes the scratch pointers before the metadata and the arguments spread; 3.7 to 3.9 call one
  shared C launcher, which takes the scratch pointers after the hooks, then the launcher's
  `.arg_annotations` and `.kernel_signature`, then the arguments as one tuple;
- `triton.runtime.driver.active.get_current_device` / `.get_current_stream` (the same functions
  Triton's launch uses) and `triton.knobs.runtime.launch_enter_hook` / `launch_exit_hook`
  (`HookChain`s; the fast path needs their `.calls` empty and passes None, as Triton does
  without hooks).
"""

from __future__ import annotations

import operator
import os
import re
from typing import Any, Callable, Optional

ENV_VAR = "FUSION_BRIDGE_LAUNCH_CACHE"  # "0" switches the fast path off

# The positional slots of the calls the fast path makes, named after Triton's own parameters and
# CudaLauncher attributes; "*args" is the kernel's arguments spread (constexpr slots included),
# "args" the same as one tuple. RUN_LAYOUT: CompiledKernel.run (CudaLauncher.__call__), as
# JITFunction.run calls it (the same on every version below).
RUN_LAYOUT = (
    *("grid_x", "grid_y", "grid_z", "stream", "function", "packed_metadata", "launch_metadata"),
    *("launch_enter_hook", "launch_exit_hook", "*args"),
)
_LAUNCH_HEAD = ("grid_x", "grid_y", "grid_z", "stream", "function")
_PER_CALL = 4  # grid_x, grid_y, grid_z, stream: passed per call; the slots after, per entry
_FLAGS = ("launch_cooperative_grid", "launch_pdl")
_SCRATCH = ("global_scratch", "profile_scratch")
_META = ("packed_metadata", "launch_metadata", "launch_enter_hook", "launch_exit_hook")
# CudaLauncher.launch, the C launcher: 3.6 generates one per kernel; 3.7 made it one shared launcher
# that reads each kernel's argument annotations and signature and takes the arguments as a tuple.
LAUNCH_PER_KERNEL = (*_LAUNCH_HEAD, *_FLAGS, *_SCRATCH, *_META, "*args")
LAUNCH_SHARED = (
    *_LAUNCH_HEAD,
    *_FLAGS,
    *_META,
    *_SCRATCH,
    "arg_annotations",
    "kernel_signature",
    "args",
)
LAUNCH_LAYOUTS = {
    (3, 6): LAUNCH_PER_KERNEL,
    (3, 7): LAUNCH_SHARED,
    (3, 8): LAUNCH_SHARED,
    (3, 9): LAUNCH_SHARED,
}
# the triton.knobs.compilation values JITFunction.run puts into its compile options (the cache key)
KEY_OPTIONS = {
    (3, 6): ("instrumentation_mode",),
    (3, 7): ("instrumentation_mode",),
    (3, 8): ("instrumentation_mode",),
    (3, 9): ("instrumentation_mode", "fpsan_homomorphic_casts"),
}
# slots a fast launch fills from the CudaLauncher's attributes (the rest are None or per call)
_LAUNCHER_ATTRIBUTES = (*_FLAGS, "arg_annotations", "kernel_signature")


class Runtime:
    """What a fast launch reads from Triton per call, and the layouts of Triton `version`'s
    launchers. Tests pass a fake one."""

    def __init__(
        self,
        get_current_device: Callable[[], int],
        get_current_stream: Callable[[int], int],
        runtime_knobs: Any,
        compilation_knobs: Any,
        version: tuple[int, int],
    ):
        self.get_current_device = get_current_device
        self.get_current_stream = get_current_stream
        # .launch_enter_hook, .launch_exit_hook, .add_stages_inspection_hook, .debug
        self.runtime_knobs = runtime_knobs
        self.compilation_knobs = compilation_knobs  # its KEY_OPTIONS[version] attributes
        self.launch_layout = LAUNCH_LAYOUTS[version]
        self.key_options = operator.attrgetter(*KEY_OPTIONS[version])


def triton_version() -> Optional[tuple[int, int]]:
    try:
        import triton

        m = re.match(r"(\d+)\.(\d+)", triton.__version__)
        return (int(m.group(1)), int(m.group(2))) if m else None
    except Exception:
        return None


def triton_runtime() -> tuple[Optional[Runtime], Optional[str]]:
    """(the installed Triton's runtime, None) or (None, why the fast path is off)."""
    from fusion_bridge import env_vars

    if not env_vars.read(ENV_VAR):
        return None, f"{ENV_VAR}={os.environ.get(ENV_VAR)}"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":  # the first reason: nothing is compiled
        return None, "TRITON_INTERPRET=1: no compiled launcher"
    version = triton_version()
    if version not in LAUNCH_LAYOUTS:
        known = ", ".join(f"{a}.{b}" for a, b in LAUNCH_LAYOUTS)
        return None, (
            f"Triton {version} is not a version whose launcher layout is known ({known}); "
            "the normal launch is used"
        )
    try:
        from triton import knobs
        from triton.runtime import driver

        if knobs.runtime.interpret:
            return None, "TRITON_INTERPRET=1: no compiled launcher"
        active = driver.active
        rt = Runtime(
            active.get_current_device,
            active.get_current_stream,
            knobs.runtime,
            knobs.compilation,
            version,
        )
        for chain in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
            if not hasattr(chain, "calls"):
                return None, "triton.knobs.runtime launch hooks are not HookChains"
        # feature detection: what every fast launch reads
        knobs.runtime.debug, knobs.runtime.add_stages_inspection_hook  # noqa: B018
        rt.key_options(knobs.compilation)
        return rt, None
    except Exception as exc:  # any missing internal: the normal launch
        return None, f"Triton runtime internals unavailable: {type(exc).__name__}: {exc}"


def launch_entry(compiled, layout: tuple[str, ...]) -> tuple[Callable, tuple, bool, Any]:
    """(launch function, the arguments between the stream and the kernel's own arguments, whether
    those go as one tuple, the CompiledKernel: held so that its module stays loaded). The C
    launcher in `layout` when the launch needs no scratch and no GSan, else CudaLauncher.__call__
    (RUN_LAYOUT)."""
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    if not callable(run):
        raise TypeError("CompiledKernel.run is not callable")
    values = dict.fromkeys((*_SCRATCH, *_META[1:]))  # None: no scratch, no hooks, no metadata
    values.update(function=function, packed_metadata=packed)
    launch = getattr(run, "launch", None)
    if (
        callable(launch)
        and getattr(run, "global_scratch_size", None) == 0
        and getattr(run, "profile_scratch_size", None) == 0
        and not getattr(run, "gsan_enabled", False)
        and all(hasattr(run, a) for a in _LAUNCHER_ATTRIBUTES if a in layout)
    ):
        values.update((a, getattr(run, a)) for a in _LAUNCHER_ATTRIBUTES if a in layout)
        prefix = tuple(values[slot] for slot in layout[_PER_CALL:-1])
        return launch, prefix, layout[-1] == "args", compiled
    return run, tuple(values[slot] for slot in RUN_LAYOUT[_PER_CALL:-1]), False, compiled
