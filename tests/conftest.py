"""Test setup. On a machine without a GPU the Triton kernels run under the interpreter (set before
any
kernel module is imported). Tests marked `gpu` skip without CUDA.

The suite tests the default (non-debug) path: FUSION_BRIDGE_DEBUG is removed from the environment,
so
a shell that exports it cannot hide a check that only debug mode makes. Tests of debug mode ask for
it
explicitly (FusionBridge(..., debug=True) or monkeypatch.setenv)."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("FUSION_BRIDGE_DEBUG", None)

from fusion_bridge.environment import NO_MULTICAST_ENV  # noqa: E402  (after TRITON_INTERPRET is set)

os.environ.update(NO_MULTICAST_ENV)


if not HAS_CUDA:  # about a third less CPU per interpreted kernel (tests/helpers.py says why)
    from tests.helpers import patch_the_interpreter_once_per_launch  # noqa: E402

    patch_the_interpreter_once_per_launch()

    # The spawned gloo ranks fork from a server that has these imported (tests/spawn_preload.py
    # says which and why): each rank would otherwise import flashinfer and transformers again.
    from fusion_bridge.cli import launch  # noqa: E402

    launch.SERVER_PRELOAD.append("tests.spawn_preload")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (on a GPU machine: `python -m pytest -m gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Skips in one line per reason (the GPU tests skip by the hundred without CUDA: one line says
    so, instead of one SKIPPED line per test); failures and errors are reported as usual (-rfE)."""
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{count} skipped: {reason}")


@pytest.fixture
def one_torch_thread():
    """One intra-op torch thread for the test (restored after it): tiny models do each op in
    microseconds with one thread, while several threads on a shared or busy CPU spend far longer
    waiting for each other. A module opts in with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
