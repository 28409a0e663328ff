"""The environment a bridge runs in, as a plain value.

Capability checks are pure functions of (EpilogueSpec, Environment), so tests build Environment
values directly instead of needing hardware. `detect()` reads the real machine.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import os
import re
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


# NVLink multicast (NCCL NVLS, symmetric-memory multicast, NVSHMEM NVLS) can take the GPUs of a
# shared
# host out of service; nothing in this library uses it, and these variables keep every library off
# it.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


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
    multicast_off: bool = (
        True  # every NO_MULTICAST_ENV variable set as required (detect() reads it)
    )
    symm_mem_error: Optional[str] = None  # why PyTorch symmetric memory is unusable; None: usable

    def replace(self, **changes) -> "Environment":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def version_tuple(version: str) -> tuple[int, ...]:
    """'0.7.2.post1' -> (0, 7, 2, 1); '2.13.0+cpu' -> (2, 13, 0). Good enough to order releases."""
    parts = re.findall(r"\d+", version.split("+")[0])
    return tuple(int(p) for p in parts)


@functools.lru_cache(maxsize=None)
def _triton_probe() -> tuple[Optional[str], Optional[str]]:
    """(version, None) when triton imports, else (None, the error). Under TRITON_INTERPRET=1
    importing
    triton loads its interpreter, which needs numpy: that error is the real cause, so keep it."""
    try:
        import triton

        return triton.__version__, None
    except Exception as exc:  # ImportError (triton or numpy missing), or a broken install
        return None, f"{type(exc).__name__}: {exc}"[:300]


@functools.lru_cache(maxsize=None)
def _flashinfer_probe() -> tuple[Optional[str], Optional[str]]:
    """(version, None) when flashinfer.comm imports, else (None, the error). Importing costs ~3
    s."""
    try:
        importlib.import_module("flashinfer.comm")
        return importlib.metadata.version("flashinfer-python"), None
    except Exception as exc:  # ImportError, or a broken native dependency
        return None, f"{type(exc).__name__}: {exc}"[:300]


@functools.lru_cache(maxsize=None)
def _symm_mem_probe() -> Optional[str]:
    from .strategies.symm_workspace import probe_symm_mem  # the API list lives beside its only user

    return probe_symm_mem()


def _group_is_single_node(group) -> bool:
    """True when every rank of `group` runs on this host. Collective: all ranks must call it."""
    hosts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return len(set(hosts)) == 1


def default_device(device: Optional[torch.device | str] = None) -> torch.device:
    """The device a bridge works on: `device` if given (a bare "cuda" becomes the current cuda:N, so
    it
    compares equal to the tensors' devices), else the current CUDA device, else the CPU."""
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def check_process_group(group) -> None:
    """Refuse a bridge that would silently run alone on one rank of a multi-process launch.

    Under torchrun (or any launcher that sets WORLD_SIZE > 1) with no explicit group and no
    initialised default process group, each rank would build its own world-size-1 bridge and skip
    the all-reduce: the ranks' outputs would differ with no error. A single process (WORLD_SIZE
    unset or 1) keeps working without a group."""
    if group is not None or (dist.is_available() and dist.is_initialized()):
        return
    raw = os.environ.get("WORLD_SIZE", "").strip()
    try:
        launched = int(raw) if raw else 1
    except ValueError:
        return  # not a launcher's value: nothing to infer from it
    if launched > 1:
        raise RuntimeError(
            f"FusionBridge: WORLD_SIZE={launched} in the environment (a multi-process launch, e.g. "
            "torchrun), but torch.distributed has no initialised default process group and no "
            "`group` was given, so this rank would all-reduce with nobody. Call "
            "torch.distributed.init_process_group() on every rank before building the bridge "
            "(torchrun sets the rendezvous variables; it does not create the group), or pass "
            "group=<your tensor-parallel group>."
        )


def detect(
    group=None, device: Optional[torch.device] = None, *, probe_flashinfer: bool = True
) -> Environment:
    """Read the environment of this process. With a process group this is collective."""
    device = default_device(device)
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
        multicast_off=all(os.environ.get(k) == v for k, v in NO_MULTICAST_ENV.items()),
        symm_mem_error=_symm_mem_probe(),
    )
