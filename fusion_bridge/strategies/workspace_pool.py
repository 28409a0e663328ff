"""A pool of reference-counted workspaces, shared by every bridge (one per layer) of a process:
created collectively by the first user of a key, freed by the last. Every rank builds and closes its
bridges in the same order, so every rank creates and frees each workspace at the same point."""

from __future__ import annotations

from typing import Callable, Generic, Optional, TypeVar

import torch

from fusion_bridge.reasons import Reason

W = TypeVar("W")
#: what a rank keeps free beyond a workspace, for the activations and kernels around it
HEADROOM_BYTES = 256 << 20


def memory_reason(
    who: str, what: str, need: int, device: torch.device, free: Optional[int] = None
) -> Optional[Reason]:
    """Can this rank hold `need` bytes for `what` (e.g. "the symmetric buffer for 2048 tokens") and
    keep HEADROOM_BYTES free? Checked locally before a collective creation. `free`: the free bytes
    on `device` (default: asks the device)."""
    if free is None:
        free, _ = torch.cuda.mem_get_info(device)
    if need + HEADROOM_BYTES <= free:
        return None
    return Reason(
        "workspace_no_memory",
        f"{who}: {what} needs {need / 2**20:.0f} MiB (+{HEADROOM_BYTES >> 20} MiB headroom) per "
        f"rank, {free / 2**20:.0f} MiB are free",
        "lower EpilogueSpec.max_tokens or free GPU memory",
    )


class WorkspacePool(Generic[W]):
    """key -> (workspace, users)."""

    def __init__(self) -> None:
        self._entries: dict[tuple, list] = {}

    def acquire(self, key: tuple, create: Callable[[], W]) -> W:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = [create(), 0]
        entry[1] += 1
        return entry[0]

    def release(self, key: tuple, workspace: W, free: Callable[[W], None]) -> None:
        """Drop one user of `workspace`; free it with the last (or at once if it was
        never shared)."""
        entry = self._entries.get(key)
        if entry is None or entry[0] is not workspace:
            free(workspace)
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self._entries[key]
            free(workspace)
