"""Spawn a real process group on this machine: gloo on CPU, NCCL on GPUs (one GPU per rank).

Used by `python -m fusion_bridge parity --world-size N`, the tests and the benchmarks. Each rank's
return value is pickled to a file and handed back to the parent in rank order; a rank that raises or
a group that outlives `timeout_s` fails the whole run with the rank's error, never hangs the caller.

Ranks are forked from a server process that has imported torch once (multiprocessing's
"forkserver"; "spawn" where the platform has no forkserver), so a group starts without paying
torch's import per rank. The server never touches CUDA, so NCCL ranks start clean. Each rank
takes the caller's environment as it is at the call (the server's own was fixed when it started),
and imports everything else fresh.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fusion_bridge.environment import NO_MULTICAST_ENV


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# imported once in the fork server; nothing here reads the environment at import
SERVER_PRELOAD = ["torch", "torch.distributed"]


def _start_method() -> str:
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(SERVER_PRELOAD)
    return "forkserver"


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    out_dir: str,
    fn: Callable,
    args: tuple,
    environ: dict,
) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the caller's, not the fork server's
    os.environ.update(NO_MULTICAST_ENV)
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        try:
            result = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which raises it
        result = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(path, "wb") as f:
        pickle.dump(result, f)


def run_distributed(
    fn: Callable, world_size: int, *args: Any, backend: str | None = None, timeout_s: float = 300.0
) -> list[Any]:
    """Run fn(rank, world_size, *args) in `world_size` fresh processes; return the results by rank.

    fn must be importable (module level). backend: "gloo" (default on CPU) or "nccl" (default when
    enough GPUs are visible)."""
    if backend is None:
        backend = (
            "nccl"
            if torch.cuda.is_available() and torch.cuda.device_count() >= world_size
            else "gloo"
        )
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"run_distributed: world_size {world_size} with NCCL needs that many GPUs, "
            f"found {torch.cuda.device_count()}"
        )
    os.environ.update(NO_MULTICAST_ENV)
    with tempfile.TemporaryDirectory(prefix="fusion_bridge_") as out_dir:
        ctx = mp.start_processes(
            _rank_main,
            args=(world_size, free_port(), backend, out_dir, fn, args, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method=_start_method(),
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(
                    f"run_distributed: the {world_size}-rank group did not finish in "
                    f"{timeout_s:.0f} s (a collective hang?)"
                )
        results, errors = [], []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            (results if status == "ok" else errors).append(value)
        if errors:
            # every failing rank's error: the first in rank order may only be the echo of another
            # rank's (a peer that raised and left while this one was still connecting)
            raise RuntimeError("\n".join(errors))
        return results
