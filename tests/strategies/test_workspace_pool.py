"""strategies/workspace_pool.py: the one memory check every workspace-backed strategy runs before
its collective creation (FlashInfer's IPC workspace and our symmetric buffers alike)."""

import torch

from fusion_bridge.strategies.workspace_pool import HEADROOM_BYTES, memory_reason

CPU = torch.device("cpu")  # never asked: `free` is given


def test_memory_reason_keeps_the_headroom_free():
    need = 100 << 20
    assert memory_reason("x", "the buffer", need, CPU, free=need + HEADROOM_BYTES) is None
    reason = memory_reason("x", "the buffer", need, CPU, free=need + HEADROOM_BYTES - 1)
    assert reason is not None and reason.code == "workspace_no_memory"
    assert reason.message.startswith("x: the buffer needs 100 MiB (+256 MiB headroom) per rank")
    assert "max_tokens" in reason.hint
