"""A pool of reference-counted workspaces, shared by every bridge (one per layer) of a process:
created collectively by the first user of a key, freed by the last. Every rank builds and closes its
bridges in the same order, so every rank creates and frees each workspace at the same point."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

W = TypeVar("W")


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
        """Drop one user of `workspace`; free it with the last (or at once if it was never
        shared)."""
        entry = self._entries.get(key)
        if entry is None or entry[0] is not workspace:
            free(workspace)
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self._entries[key]
            free(workspace)
