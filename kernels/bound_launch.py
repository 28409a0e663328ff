"""`BoundLaunch`: one launch of a `KernelLauncher` with everything but the per-call records bound
once (a plan's launch: `fused_tp1` binds one per launch shape), keyed per call by what can change
between its calls only. Its cache and key follow `launch_cache`'s rules (kernels/launch_cache.py
says them); this module adds the binding and the addresses passed as ints."""

from __future__ import annotations

from typing import Callable, Optional

from fusion_bridge.kernels.launch_cache import KernelLauncher, _holds_tensor, _kinds, _make_key_fn


class BoundLaunch:
    """One launch of `launcher` with its grid, constexprs, warps and trailing arguments bound once
    (e.g. per T: sizes, a layer's scalars), called with the leading arguments that change per call
    (the records of tensors): `bound(*lead)` launches `launcher(grid, (*lead, *fixed), constexprs,
    num_warps)`.

    Its own cache is keyed by what can change between its calls: the current device, the debug
    knob, the key's compile options and the leading arguments (each tensor's dtype and 16-byte
    alignment, as `KernelLauncher` keys them). The bound part of the launcher's key is the same on
    every call, so a key here names exactly one of the launcher's keys. A miss (or hooks, or a
    launcher whose fast path is off) goes through the launcher itself, which launches normally or
    from its own cache; its entry is then kept here too.

    From its own entry it passes each leading tensor as its address (read once, for the key too):
    Triton's C launcher takes an int as given, where for a tensor it calls `data_ptr()` and asks the
    driver whether the address is device memory (which refuses a CPU tensor: the bridge's checks
    do that before, call/validation.py). Through the launcher (a miss, hooks): the tensors. `fixed`
    holds no tensor (its address could change under the same object), only ints, floats, None and
    records of them."""

    def __init__(self, launcher: KernelLauncher, grid: tuple, constexprs: tuple, num_warps: int,
                 fixed: tuple = ()):  # fmt: skip
        kinds = _kinds(fixed)
        if kinds is None or _holds_tensor(kinds):
            raise TypeError(f"BoundLaunch: fixed must hold no tensor, got kinds {kinds}")
        self.launcher, self.grid, self.constexprs = launcher, grid, constexprs
        self.num_warps, self.fixed = num_warps, tuple(fixed)
        self._tail = (*self.fixed, *constexprs)  # what follows the leading arguments, spread
        n = len(grid)
        self._grid3 = (grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1)
        self._entries: dict = {}
        self._key_fn: Optional[Callable] = None
        self._lead_kinds: Optional[tuple] = None

    def __call__(self, *lead) -> None:
        launcher = self.launcher
        key = None
        if launcher._key_fn is not None:  # the launcher's fast path is on and has its runtime
            knobs = launcher._knobs
            try:
                if not (
                    knobs.launch_enter_hook.calls
                    or knobs.launch_exit_hook.calls
                    or knobs.add_stages_inspection_hook is not None
                ):
                    device = launcher._get_device()
                    key_fn = self._key_fn or self._make_key(lead)
                    key, given = key_fn(
                        device, knobs.debug, launcher._key_options(launcher._compilation_knobs),
                        None, None, *lead,
                    )  # fmt: skip
            except Exception:  # a leading argument of another kind: the launcher's own path
                key = None
        entry = self._entries.get(key) if key is not None else None
        if entry is None:
            self._through_launcher(lead, key)
            return
        fn, prefix, as_tuple, _ = entry
        gx, gy, gz = self._grid3
        try:
            if as_tuple:
                fn(gx, gy, gz, launcher._get_stream(device), *prefix, (*given, *self._tail))
            else:
                fn(gx, gy, gz, launcher._get_stream(device), *prefix, *given, *self._tail)
        except Exception as exc:
            self._entries.clear()
            launcher._fast_failed(exc, self.grid, (*lead, *self.fixed), self.constexprs,
                                  self.num_warps)  # fmt: skip

    def _make_key(self, lead: tuple) -> Callable:
        kinds = _kinds(lead)
        if kinds is None:
            raise TypeError("a leading argument of a kind the launch cache does not key")
        self._key_fn = _make_key_fn(kinds, addresses=True)
        self._lead_kinds = kinds
        return self._key_fn

    def _through_launcher(self, lead: tuple, key) -> None:
        """The launcher's own call; then its entry for these arguments, kept under `key`."""
        launcher, args = self.launcher, (*lead, *self.fixed)
        launcher(self.grid, args, self.constexprs, self.num_warps)
        if key is None or launcher._key_fn is None or launcher.disabled_reason is not None:
            return
        if _kinds(lead) != self._lead_kinds:
            return
        try:
            full = launcher._key_fn(
                launcher._get_device(),
                launcher._knobs.debug,
                launcher._key_options(launcher._compilation_knobs),
                self.num_warps,
                self.constexprs,
                *args,
            )
        except Exception:  # noqa: BLE001 - arguments the launcher does not key: never cached
            return
        entry = launcher._entries.get(full)
        if entry is not None:
            while len(self._entries) >= launcher.max_entries:
                del self._entries[next(iter(self._entries))]
            self._entries[key] = entry
