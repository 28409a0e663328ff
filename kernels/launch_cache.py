"""Launch a Triton kernel at the cost of a launch: after the first normal launch, call the compiled
kernel's low-level launcher directly, keyed by what Triton's own cache key depends on.

Why: `kernel[grid](...)` re-derives per call what is fixed for us: it binds the arguments by
name, specializes each one in C, formats the options dict into a string for the cache key, looks
the kernel up, builds a launch-metadata dict for the (empty) launch hooks and goes through
`CudaLauncher.__call__`. `KernelLauncher` keeps, per specialization key, the compiled kernel's
launch function and everything that is constant for it, and launches with the grid, the current
stream and the arguments.

The key mirrors Triton's specialization (checked against `native_specialize_impl` by
tests/kernels/test_launch_cache.py) and is never coarser than it:

- tensor arguments: dtype and `data_ptr() & 15` (Triton: dtype and 16-byte alignment);
- int arguments: type, `== 1` (Triton passes 1 as a constexpr), `% 16 == 0` and the int32 / int64
  range (i32 / i64 / u64); so T = 1, T = 16 and T = 3 are three keys, T = 3 and T = 5 one;
- float arguments: type only (Triton never specializes them);
- a None argument: that it is None (Triton makes it a compile-time constant);
- a tuple argument (a record of kernels/records.py): each field as above, in order, as Triton
  specializes a tuple field by field;
- the constexpr values, num_warps, the current device, `knobs.runtime.debug` and
  the compile options of `triton_launchers.KEY_OPTIONS` (the options in Triton's key).

Anything else falls back to the normal launch, which compiles or finds the right kernel; its result
is then remembered under the new key (at most `MAX_ENTRIES` per kernel, oldest dropped first). The
fast path is never taken while a launch hook or a stages-inspection hook is registered (profilers
such as proton), and the normal launch is used forever, without an error, when a Triton internal
it needs is missing: under TRITON_INTERPRET=1 (no compiled launcher), with a Triton minor version
whose launcher layout is not known, or with FUSION_BRIDGE_LAUNCH_CACHE=0.
`KernelLauncher.disabled_reason` says why.

Which Triton internals it relies on, and how each Triton minor version that pyproject allows (3.6
to 3.9) lays out its launchers' arguments: kernels/triton_launchers.py.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from fusion_bridge.kernels.triton_launchers import (  # noqa: F401 (ENV_VAR, triton_version: re-exported)
    ENV_VAR,
    Runtime,
    launch_entry,
    triton_runtime,
    triton_version,
)
from fusion_bridge.log import get_logger

MAX_ENTRIES = 64

_log = get_logger("kernels.launcher")


def _make_key_fn(kinds: Sequence, addresses: bool = False) -> Callable:
    """A key function for arguments of these kinds ('t' tensor, 's' scalar, 'n' None, a tuple of
    kinds: a record, keyed field by field as Triton specializes it), generated once (as Triton
    generates its binder): one call, no loop; a record is unpacked once. Raises (AttributeError,
    TypeError, ValueError) on an argument of an unexpected kind, which the caller treats as 'no
    fast path'.

    addresses: it returns (key, the arguments with each tensor replaced by its `data_ptr()`, read
    once for both; records as plain tuples): what `BoundLaunch` launches with."""
    names = [f"a{i}" for i in range(len(kinds))]
    lines, parts = [], []

    def key_of(name, kind) -> str:
        """Adds `name`'s key parts; returns the expression of the argument as launched."""
        if isinstance(kind, tuple):  # a record: its fields, flattened in order
            fields = [f"{name}_{j}" for j in range(len(kind))]
            lines.append(f"    {', '.join(fields)}{',' if len(fields) == 1 else ''} = {name}")
            given = [key_of(field_name, field_kind) for field_name, field_kind in zip(fields, kind)]
            return f"({', '.join(given)},)"
        if kind == "t":
            if addresses:
                lines.append(f"    {name}_p = {name}.data_ptr()")
                parts.append(f"{name}.dtype, {name}_p & 15")
                return f"{name}_p"
            parts.append(f"{name}.dtype, {name}.data_ptr() & 15")
        elif kind == "n":  # None: a compile-time constant to Triton
            parts.append(f"{name} is None")
        else:
            parts.append(
                f"type({name}), (None if type({name}) is float else ({name} == 1, {name} % 16 == "
                "0, "
                f"-2147483648 <= {name} <= 2147483647, {name} <= 9223372036854775807))"
            )
        return name

    given = [key_of(name, kind) for name, kind in zip(names, kinds)]
    head = "device, debug, options, num_warps, constexprs"
    key = f"({head}, {', '.join(parts)})"
    src = (
        f"def key({head}, {', '.join(names)}):\n"
        + "".join(line + "\n" for line in lines)
        + (f"    return {key}, ({', '.join(given)},)\n" if addresses else f"    return {key}\n")
    )
    namespace: dict = {}
    exec(src, namespace)  # noqa: S102 (generated from a fixed template, no user input)
    return namespace["key"]


def _kind(a: Any):
    if isinstance(a, torch.Tensor):
        return "t"
    if type(a) in (int, float):
        return "s"
    if a is None:
        return "n"
    if isinstance(a, tuple):  # a record (kernels/records.py): Triton specializes each field
        fields = tuple(_kind(f) for f in a)
        return None if None in fields else fields
    return None  # bools and anything else: Triton specializes them otherwise; not cached


def _kinds(args: Sequence[Any]) -> Optional[tuple]:
    kinds = tuple(_kind(a) for a in args)
    return None if None in kinds else kinds


class KernelLauncher:
    """`launcher(grid, args, constexprs, num_warps)` launches `kernel[grid](*args, **dict(zip(
    constexpr_names, constexprs)), num_warps=num_warps)`, through the cached low-level launcher when
    the specialization key was seen before. `args` are the runtime arguments in parameter order;
    the constexpr parameters must be the kernel's trailing parameters. `options`: compile options
    passed to every launch (`kernel[grid](..., **options)`), e.g. {"maxnreg": 64}."""

    def __init__(
        self,
        kernel,
        constexpr_names: Sequence[str],
        runtime: Optional[Runtime] = None,
        max_entries: int = MAX_ENTRIES,
        options: Optional[dict] = None,
    ):
        self.kernel = kernel
        self.constexpr_names = tuple(constexpr_names)
        # compile options fixed for every launch of this launcher (e.g. maxnreg): they are part of
        # Triton's key, and constant here, so the launcher's own key needs no field for them
        self.options = dict(options or {})
        self.max_entries = max_entries
        self._entries: dict = {}
        self._key_fn: Optional[Callable] = None
        self._kinds: Optional[tuple[str, ...]] = None
        self._runtime = runtime
        self._runtime_resolved = runtime is not None
        self.disabled_reason: Optional[str] = self._signature_reason()

    @property
    def name(self) -> str:
        fn = getattr(self.kernel, "fn", None)
        return getattr(fn, "__name__", type(self.kernel).__name__)

    @property
    def entries(self) -> int:
        return len(self._entries)

    def _signature_reason(self) -> Optional[str]:
        names = getattr(self.kernel, "arg_names", None)
        if names is None:
            return f"{self.name}: the kernel has no arg_names"
        n = len(self.constexpr_names)
        if n and tuple(names[-n:]) != self.constexpr_names:
            return (
                f"{self.name}: constexprs {self.constexpr_names} are not the kernel's trailing "
                "parameters "
                f"{tuple(names[-n:])}"
            )
        self._n_args = len(names) - n
        return None

    def _disable(self, reason: str) -> None:
        self.disabled_reason = reason
        self._entries.clear()
        self._key_fn = None
        _log.info(
            "launch cache off for %s: %s (normal Triton launches are used)", self.name, reason
        )

    def __call__(self, grid: tuple, args: tuple, constexprs: tuple, num_warps: int) -> None:
        key_fn = self._key_fn
        if key_fn is None:
            self._normal(grid, args, constexprs, num_warps, None)
            return
        knobs = self._knobs
        try:
            if (
                knobs.launch_enter_hook.calls
                or knobs.launch_exit_hook.calls
                or knobs.add_stages_inspection_hook is not None
            ):
                key = None  # hooks expect Triton's own launch; a stages hook changes Triton's key
            else:
                device = self._get_device()
                key = key_fn(
                    device,
                    knobs.debug,
                    self._key_options(self._compilation_knobs),
                    num_warps,
                    constexprs,
                    *args,
                )
        except (
            Exception
        ):  # an argument of another kind, a hook that is not a HookChain: normal launch
            key = None
        entry = self._entries.get(key)
        if entry is None:
            self._normal(grid, args, constexprs, num_warps, key)
            return
        fn, prefix, as_tuple, _ = entry
        n = len(grid)
        try:
            if as_tuple:  # the shared C launcher (3.7+): the arguments as one tuple
                fn(
                    grid[0],
                    grid[1] if n > 1 else 1,
                    grid[2] if n > 2 else 1,
                    self._get_stream(device),
                    *prefix,
                    (*args, *constexprs),
                )
            else:
                fn(
                    grid[0],
                    grid[1] if n > 1 else 1,
                    grid[2] if n > 2 else 1,
                    self._get_stream(device),
                    *prefix,
                    *args,
                    *constexprs,
                )
        except Exception as exc:
            self._fast_failed(exc, grid, args, constexprs, num_warps)

    def _launch_normally(self, grid, args, constexprs, num_warps):
        kwargs = dict(zip(self.constexpr_names, constexprs))
        return self.kernel[grid](*args, **kwargs, num_warps=num_warps, **self.options)

    def _fast_failed(self, exc, grid, args, constexprs, num_warps) -> None:
        """The cached launcher raised. The C launcher checks its arguments before launching, so
        nothing ran: launch normally. If that works, the fast path is wrong for this Triton: switch
        it off. If it raises too, the error is the caller's: let Triton's own error through."""
        self._launch_normally(grid, args, constexprs, num_warps)
        self._disable(f"the cached launcher raised {type(exc).__name__}: {exc}")

    def _normal(self, grid, args, constexprs, num_warps, key) -> None:
        compiled = self._launch_normally(grid, args, constexprs, num_warps)
        if self.disabled_reason is None:
            try:
                self._remember(compiled, key, args, constexprs, num_warps)
            except Exception as exc:  # a missing internal: normal launches from now on
                self._disable(f"{type(exc).__name__}: {exc}")

    def _remember(self, compiled, key, args, constexprs, num_warps) -> None:
        if not self._runtime_resolved:
            self._runtime, reason = triton_runtime()
            self._runtime_resolved = True
            if reason is not None:
                self._disable(reason)
                return
        if len(args) != self._n_args or len(constexprs) != len(self.constexpr_names):
            # a call that does not fit the signature: Triton raised or will; nothing to cache
            return
        if getattr(self.kernel, "used_global_vals", None) or getattr(
            self.kernel, "pre_run_hooks", None
        ):
            self._disable(
                "the kernel uses global values or pre-run hooks, which Triton checks per launch"
            )
            return
        if compiled is None or hasattr(compiled, "result"):
            if compiled is None:
                self._disable("the normal launch returned no compiled kernel")
            return  # asynchronous compile: try again next time
        kinds = _kinds(args)
        if kinds is None:
            return
        rt = self._runtime
        if self._kinds is None:
            self._knobs, self._compilation_knobs = rt.runtime_knobs, rt.compilation_knobs
            self._key_options = rt.key_options
            self._get_device, self._get_stream = rt.get_current_device, rt.get_current_stream
            self._kinds, self._key_fn = kinds, _make_key_fn(kinds)
        elif kinds != self._kinds:
            # another argument layout than the cached one: not cached (the key fn would refuse it)
            return
        if key is None:
            knobs = rt.runtime_knobs
            if not (_idle(knobs.launch_enter_hook) and _idle(knobs.launch_exit_hook)):
                return
            if getattr(knobs, "add_stages_inspection_hook", None) is not None:
                return
            key = self._key_fn(
                rt.get_current_device(),
                knobs.debug,
                rt.key_options(rt.compilation_knobs),
                num_warps,
                constexprs,
                *args,
            )
        self._entries.pop(key, None)
        while len(self._entries) >= self.max_entries:
            del self._entries[next(iter(self._entries))]
        self._entries[key] = launch_entry(compiled, rt.launch_layout)


def _idle(hook) -> bool:
    return hook is None or not getattr(hook, "calls", True)


def _holds_tensor(kinds) -> bool:
    return any(_holds_tensor(k) if isinstance(k, tuple) else k == "t" for k in kinds)
