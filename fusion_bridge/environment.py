"""The environment a bridge runs in, as a plain value.

Capability checks are pure functions of (EpilogueSpec, Environment), so tests build Environment
values directly instead of needing hardware. `detect()` reads the real machine.

The fields below are what several strategies need (device, SM, world size, library versions). A
fact only one strategy needs is that strategy's `Probe`: it declares the probe on its class,
detect() runs every registered strategy's probes and stores their values in `Environment.probes`,
and the strategy reads its value back with `probe.value_in(env)`. So this module knows no strategy,
and a new strategy with a new probe adds no field here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist


# NVLink multicast (NCCL NVLS, symmetric-memory multicast, NVSHMEM NVLS) can take the GPUs of a
# shared host out of service; nothing in this library uses it, and these variables keep every
# library off it. The one home of this list: our tools and tests set it in every process they start
# (the library itself never requires it); `info` reports whether this process has it.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@dataclass(frozen=True)
class Probe:
    """A fact about this process that one strategy's capability checks need (e.g. whether PyTorch
    symmetric memory imports). `read()` measures it (detect() calls it at every bridge build: cache
    it if it is slow); `documented` is what `read()` returns on a machine set up as the README says,
    the value a hand-built Environment without this probe stands for (golden tests, explain --gpu).
    Values must be plain (None, bool, int, float, str): they travel in reports and JSON."""

    name: str
    read: Callable[[], Any]
    documented: Any = None

    def value_in(self, env: "Environment") -> Any:
        """The probe's value in `env`; its documented value when `env` was built without it."""
        return env.probes.get(self.name, self.documented)


@dataclass(frozen=True)
class Environment:
    device_type: str = "cpu"  # "cpu" or "cuda"
    sm: Optional[int] = None  # e.g. 90 for H100/H200, 100 for B200; None on CPU
    gpu_name: Optional[str] = None
    world_size: int = 1
    single_node: bool = True
    torch_version: str = torch.__version__
    triton_version: Optional[str] = None  # None: not importable
    triton_error: Optional[str] = (
        None  # why triton did not import (e.g. the interpreter needs numpy)
    )
    flashinfer_version: Optional[str] = None  # None: not importable
    flashinfer_error: Optional[str] = None
    triton_interpret: bool = False  # TRITON_INTERPRET=1: Triton kernels run on CPU (tests only)
    #: the registered strategies' probe values by probe name (see Probe); a probe absent here takes
    #: its documented value
    probes: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = {f.name for f in dataclasses.fields(self)}
        clash = sorted(set(self.probes) & names)
        if clash:
            raise ValueError(f"Environment: probe names {clash} clash with Environment fields")
        object.__setattr__(self, "probes", dict(self.probes))  # a copy: the value cannot change

    def __hash__(self) -> int:
        fields = tuple(
            getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "probes"
        )
        return hash((fields, tuple(sorted(self.probes.items()))))

    def replace(self, **changes) -> "Environment":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain values; each probe appears as a field of its own name (as in reports since v1)."""
        out = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "probes"
        }
        out.update(self.probes)
        return out


def version_tuple(version: str) -> tuple[int, ...]:
    """'0.7.2.post1' -> (0, 7, 2, 1); '2.13.0+cpu' -> (2, 13, 0). Good enough to order releases."""
    parts = re.findall(r"\d+", version.split("+")[0])
    return tuple(int(p) for p in parts)


@functools.lru_cache(maxsize=None)
def _triton_probe() -> tuple[Optional[str], Optional[str]]:
    """(version, None) when triton imports, else (None, the error). Under TRITON_INTERPRET=1
    importing triton loads its interpreter, which needs numpy: that error is the real
    cause, so keep it."""
    try:
        import triton

        return triton.__version__, None
    except Exception as exc:  # ImportError (triton or numpy missing), or a broken install
        return None, f"{type(exc).__name__}: {exc}"[:300]


@functools.lru_cache(maxsize=None)
def _flashinfer_probe() -> tuple[Optional[str], Optional[str]]:
    """(version, None) when flashinfer.comm imports, else (None, the error). Importing takes
    seconds (docs/performance.md), hence once per process."""
    try:
        importlib.import_module("flashinfer.comm")
        return importlib.metadata.version("flashinfer-python"), None
    except Exception as exc:  # ImportError, or a broken native dependency
        return None, f"{type(exc).__name__}: {exc}"[:300]


def _group_is_single_node(group) -> bool:
    """True when every rank of `group` runs on this host. Collective: all ranks must call it."""
    hosts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return len(set(hosts)) == 1


def default_device(device: Optional[torch.device | str] = None) -> torch.device:
    """The device a bridge works on: `device` if given (a bare "cuda" becomes the current cuda:N, so
    it compares equal to the tensors' devices), else the current CUDA device, else the CPU. Raises
    ValueError for a device this process cannot use (a CUDA device on a CPU build, or
    another kind)."""
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    given, device = device, torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda[:N]' or 'cpu', got {given!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device must be one this process can use, got {str(given)!r} but torch "
            f"{torch.__version__} sees no CUDA device (a CPU build, or no GPU visible)"
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def detect(
    group=None,
    device: Optional[torch.device] = None,
    *,
    probe_flashinfer: bool = True,
    probes: Optional[Mapping[str, Probe]] = None,
) -> Environment:
    """Read the environment of this process. With a process group this is collective.

    probes: name -> Probe to run (default: every registered strategy's probes, as
    registry.environment_probes() collects them).
    """
    device = default_device(device)
    if probes is None:
        from fusion_bridge.registry import (
            environment_probes,
        )  # imports the strategy classes, lazily

        probes = environment_probes()
    world_size, single_node = 1, True
    if group is not None or (dist.is_available() and dist.is_initialized()):
        world_size = dist.get_world_size(group)
        single_node = _group_is_single_node(group) if world_size > 1 else True
    fi_version, fi_error = _flashinfer_probe() if probe_flashinfer else (None, "not probed")
    triton_version, triton_error = _triton_probe()
    sm = gpu_name = None
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        sm, gpu_name = major * 10 + minor, torch.cuda.get_device_name(device)
    return Environment(
        device_type=device.type,
        sm=sm,
        gpu_name=gpu_name,
        world_size=world_size,
        single_node=single_node,
        torch_version=torch.__version__,
        triton_version=triton_version,
        triton_error=triton_error,
        flashinfer_version=fi_version,
        flashinfer_error=fi_error,
        triton_interpret=os.environ.get("TRITON_INTERPRET", "0") == "1",
        probes={name: probe.read() for name, probe in probes.items()},
    )


def multicast_is_off(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether every NO_MULTICAST_ENV variable holds its required value in `environ` (default: this
    process's environment)."""
    environ = os.environ if environ is None else environ
    return all(environ.get(k) == v for k, v in NO_MULTICAST_ENV.items())
