"""NVLink multicast: the product never requires the three variables that switch it off (our kernels
never use it), never hands a kernel a multicast pointer, and holds no multimem instruction; our own
tools and tests set the variables in every process they start (test_cli.py checks the tools)."""

import re
from pathlib import Path

import pytest

from fusion_bridge import EpilogueSpec
from fusion_bridge.environment import NO_MULTICAST_ENV, Environment, detect
from fusion_bridge.plan.planner import static_statuses
from fusion_bridge.kernels.symm.protocol import LAYOUTS
from fusion_bridge.strategies import symm_workspace as sw

ROOT = Path(__file__).resolve().parents[2]
H200_TP2 = Environment(
    device_type="cuda",
    sm=90,
    gpu_name="NVIDIA H200",
    world_size=2,
    triton_version="3.6.0",
    flashinfer_version="0.7.2.post1",
)
SYMM = ("symm_fused_oneshot", "symm_fused_twoshot")


@pytest.mark.parametrize(
    "allowed", [{}, {"NCCL_NVLS_ENABLE": "1"}, dict.fromkeys(NO_MULTICAST_ENV)]
)
def test_the_symmetric_memory_strategies_do_not_ask_for_the_multicast_variables(
    monkeypatch, allowed
):
    # this process's environment as a user leaves it: variables unset, or multicast allowed
    for name in NO_MULTICAST_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in allowed.items():
        if value is not None:
            monkeypatch.setenv(name, value)
    probes = detect(probe_flashinfer=False).probes
    assert probes["multicast_off"] is False  # what `info` reports
    env = H200_TP2.replace(probes={"multicast_off": False, "symm_mem_error": None})
    spec = EpilogueSpec(hidden_size=7168, top_k=8)
    for status in static_statuses(spec, env):
        if status.name in SYMM:
            assert status.reasons == (), (status.name, status.reasons)
    for layout in LAYOUTS:
        who = f"symm_fused_{layout.name}"
        assert sw.reasons(spec, env, who, probe=lambda: None, layout=layout) == []


def test_no_kernel_holds_a_multimem_instruction_or_reads_a_multicast_pointer():
    kernels = sorted((ROOT / "kernels").glob("*.py"))
    assert kernels
    for path in kernels:
        text = path.read_text()
        assert not re.search(r"multimem|multicast_ptr|mc_ptr", text, re.I), path.name
    # in the package, the multicast pointer is read in one place: the check that refuses a handle
    # exposing one after the process asked for multicast off (never passed to a kernel)
    readers = [
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "fusion_bridge").rglob("*.py")
        if "multicast_ptr" in p.read_text()
    ]
    assert readers == ["fusion_bridge/strategies/symm_workspace.py"]
    source = (ROOT / "fusion_bridge/strategies/symm_workspace.py").read_text()
    uses = [line.strip() for line in source.splitlines() if "multicast_ptr" in line]
    assert all(
        u.startswith(("HANDLE_API", "if multicast_is_off() and", "handle's `buffer_ptrs`"))
        for u in uses
    ), uses
