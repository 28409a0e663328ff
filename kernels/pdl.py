"""Programmatic dependent launch (PDL, sm_90 and newer): a kernel launched with it may be
scheduled while the kernel before it on the same stream is still running (or draining), so the
launch and scheduling latency of a short launch overlaps the previous one's tail instead of
following it. Under stream capture the same launch becomes a programmatic edge of the CUDA graph.

Safety rule of every kernel of ours that is launched with PDL (`pdl_enter` is its first
statement, before any global memory access): `griddepcontrol.wait` blocks until every grid this
launch depends on has completed and its memory operations are visible. Before it, the kernel
touches no global memory at all, so it can neither read an input the previous kernel is still
writing (the routing weights, the expert rows, a slot row, a flag) nor write an output the
previous kernel is still reading. Every program executes the wait, whatever its row, so that the
grid's completion implies the completion of the grid before it (the chain of edges stays
transitive for the kernel after it, PDL or not). Dependencies that are not a kernel on the same
stream (memcpys, host nodes) stay full dependencies; whether a kernel-to-kernel edge through an
event on another stream becomes programmatic under capture does not matter to our kernels, since
each waits for every grid it depends on before touching memory.

`gdc_launch_dependents` (after the wait) lets the next PDL launch's programs be scheduled as this
grid's programs leave the SMs; they wait in their own `griddepcontrol.wait` until this grid has
completed, so what this kernel writes is visible to them. A kernel whose correctness needs every
one of its programs resident at once (the split-row kernel) is not affected: the next grid is
only scheduled once every program of this one has started. Nor when it is the later grid: its
programs scheduled early wait without polling, and the grid before it is wholly resident already,
so it completes and the rest of the split grid is scheduled.

Off (`USE_PDL` False: the `if` is removed at compile time, the kernel is today's): under
TRITON_INTERPRET=1, on CPU tensors and on GPUs below sm_90. `pdl_ok` decides per device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL never on (pdl_ok)
    gdc_launch_dependents = gdc_wait = None

PDL_OPTIONS = {"launch_pdl": True}  # the KernelLauncher options of a PDL launch


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr):
    """A PDL kernel's first statement: wait for the grid before it (complete, memory visible);
    then, with LAUNCH_DEPENDENTS, let the next PDL grid be scheduled. Nothing when not USE_PDL."""
    if USE_PDL:
        gdc_wait()
        if LAUNCH_DEPENDENTS:
            gdc_launch_dependents()


def _triton_has_launch_pdl() -> bool:
    """This Triton compiles and launches with the `launch_pdl` option (a Triton with the
    intrinsics but not the option would raise at the launch)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - no NVIDIA backend
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_ok(device: torch.device) -> bool:
    """PDL may be used for launches on `device`: a CUDA device of compute capability >= 9.0 (not
    a ROCm device, whose capabilities reuse those numbers), not the Triton interpreter, a Triton
    that has the grid-dependency intrinsics and the `launch_pdl` option."""
    if gdc_wait is None or device.type != "cuda" or torch.version.hip is not None:
        return False
    if not _triton_has_launch_pdl():
        return False
    try:
        from triton import knobs

        if knobs.runtime.interpret:
            return False
    except Exception:  # pragma: no cover
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)
