"""Spawn a real process group on this machine: gloo on CPU, NCCL on GPUs (one GPU per rank).

Used by `python -m fusion_bridge parity --world-size N`, the tests and the benchmarks. Each rank's
return value is pickled to a file and handed back to the parent in rank order; a rank that raises or
a group that outlives `timeout_s` fails the whole run with the rank's error, never hangs the caller.

Ranks are forked from a server process that has imported torch once (multiprocessing's
"forkserver"; "spawn" where the platform has no forkserver), so a group starts without paying
torch's import per rank. The server never touches CUDA, so NCCL ranks start clean. Each rank
takes the caller's environment as it is at the call, plus NO_MULTICAST_ENV (the server's own was
fixed when it started; the caller's own environment is left as it was), and imports everything
else fresh.

The launcher owns its processes: whatever ends the wait (a rank's failure, the timeout, Ctrl-C in
the caller, any exception) kills every rank still running before it propagates, and each rank
watches the caller's process and exits within about a second of its death (a rank is the fork
server's child, not the caller's, so nothing else would end it). A rank that exits without a
result (killed by a signal, os._exit) is reported with its rank and its exit code or signal.
Right after joining the group each gloo rank waits at a barrier, so no rank tears the group down
while a peer is still connecting to it (gloo's "connectFullMesh failed ... Connection closed by
peer" on the late rank).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import tempfile
import threading
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
    caller: int,
) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the caller's (with NO_MULTICAST_ENV), not the fork server's
    _exit_with(caller)
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        if backend == "gloo":
            dist.barrier()  # every rank has finished connecting before any can leave
        try:
            result = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which raises it
        result = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    _write_result(path, result, rank)


def _write_result(path: str, result: tuple, rank: int) -> None:
    """Pickle `result` to `path` whole or not at all: written under a temporary name and renamed,
    so a rank killed mid-write (the launcher ends every rank once one dies) leaves no truncated
    file for the parent to misread; a result that cannot be pickled is reported as this rank's
    error."""
    partial = f"{path}.partial"
    try:
        with open(partial, "wb") as f:
            pickle.dump(result, f)
    except Exception as exc:
        with open(partial, "wb") as f:
            pickle.dump(("error", f"rank {rank}: its result could not be pickled: {exc!r}"), f)
    os.replace(partial, path)


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
    environ = {**os.environ, **NO_MULTICAST_ENV}  # the ranks'; the caller's own is left alone
    with tempfile.TemporaryDirectory(prefix="fusion_bridge_") as out_dir:
        ctx = mp.start_processes(
            _rank_main,
            args=(world_size, free_port(), backend, out_dir, fn, args, environ, os.getpid()),
            nprocs=world_size,
            join=False,
            start_method=_start_method(),
        )
        try:
            _wait(ctx, world_size, timeout_s)
        finally:
            _kill_all(ctx.processes)  # none left running, whatever ended the wait
        results, errors = [], []
        for rank, process in enumerate(ctx.processes):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {rank}: {_exit_text(process.exitcode)} without a result")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            (results if status == "ok" else errors).append(value)
        if errors:
            # every failing rank's error: the first in rank order may only be the echo of another
            # rank's (a peer that raised and left while this one was still connecting)
            raise RuntimeError("\n".join(errors))
        return results


def _wait(ctx, world_size: int, timeout_s: float) -> None:
    """Until every rank has ended; TimeoutError past `timeout_s`. A rank that ends oddly (a signal,
    a non-zero exit) ends the wait at once: its peers would otherwise wait for it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ctx.join(timeout=1.0):
                return
        except mp.ProcessExitedException:
            return  # reported per rank by the caller, from the exit codes
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"run_distributed: the {world_size}-rank group did not finish in "
                f"{timeout_s:.0f} s (a collective hang?)"
            )


def _kill_all(processes) -> None:
    """SIGKILL every rank still alive and reap it (a rank's own cleanup may hang on a peer)."""
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join(5)


def _exit_text(code) -> str:
    """'exited with code 3', 'was killed by SIGABRT', from a multiprocessing exit code."""
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _exit_with(caller: int, period_s: float = 0.5) -> None:
    """Exit this rank soon after the process `caller` is gone (a daemon thread polls it)."""

    def watch() -> None:
        while True:
            time.sleep(period_s)
            try:
                os.kill(caller, 0)
            except ProcessLookupError:
                os.kill(os.getpid(), signal.SIGKILL)  # no cleanup can wait on a peer
            except PermissionError:
                pass  # alive, another user's: cannot happen for our own caller

    threading.Thread(target=watch, name="fusion_bridge-caller-watch", daemon=True).start()
