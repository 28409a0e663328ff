"""Moved to fusion_bridge.cli.launch (kept while callers move over)."""

from .cli.launch import NO_MULTICAST_ENV, free_port, run_distributed  # noqa: F401
