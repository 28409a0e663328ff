"""The machine code of every kernel we launch with programmatic dependent launch (PDL), compiled
for the H200 (sm_90) on this CPU machine exactly as a GPU call specializes it: the grid-dependency
wait (SASS `ACQBULK`, PTX `griddepcontrol.wait`) comes before every global memory instruction of
the kernel, and the early launch of dependents (`PREEXIT`) is there exactly where the kernel asks
for it.

Why a CPU test: a GPU test can only catch an access above the wait when a late writer happens to
race it (tests/kernels/test_pdl_late_writer.py does that for fused_tp1's routing weights), and for
the twoshot
two-shot no test on one GPU can (its readers already follow an event). A compiler or code change
that moves a load, store, atomic, prefetch or L2 discard above the wait shows here.

The compiles run in one child process (the CPU tests run Triton's interpreter, whose kernels
cannot
be compiled): `python tests/kernels/test_pdl_machine_code.py OUTDIR` prints each case's problems as
JSON.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import triton

from fusion_bridge.spec import EpilogueSpec
from fusion_bridge.oracle.synthetic import make_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
if not all(os.path.exists(os.path.join(NVIDIA_BIN, t)) for t in ("ptxas", "nvdisasm")):
    pytest.skip("this Triton has no ptxas / nvdisasm to compile for sm_90", allow_module_level=True)

# global-memory and L2 instructions of sm_90 SASS (shared memory, constant banks: not listed)
GLOBAL_MEMORY = re.compile(r"^(LDG|STG|LD|ST|ATOMG|ATOM|RED|REDG|CCTL|LDGSTS|UBLKCP|UTMALDG)\b")
SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)")


def opcodes(compiled, outdir: str, name: str) -> list:
    from benchmarks import offline_sass as offline

    offline.summary(compiled, os.path.join(outdir, name))  # writes <name>.sass (nvdisasm)
    sass = open(os.path.join(outdir, f"{name}.sass")).read()
    return [m[1] for m in map(SASS_LINE.match, sass.splitlines()) if m]


def check(ops: list, launches_dependents: bool) -> list:
    problems = []
    waits = [i for i, op in enumerate(ops) if op.startswith("ACQBULK")]
    if not waits:
        return ["no grid-dependency wait (ACQBULK) in the kernel"]
    early = [op for op in ops[: waits[0]] if GLOBAL_MEMORY.match(op)]
    if early:
        problems.append(f"global memory before the wait: {early}")
    if ("PREEXIT" in ops) != launches_dependents:
        problems.append(f"PREEXIT present: {'PREEXIT' in ops}, expected {launches_dependents}")
    return problems


def discard_problems(ops: list) -> list:
    """The twoshot row launches' L2 discards (`discard.global.L2`, SASS CCTL) of the slot rows they
    read (`.cg` loads, SASS LDG ... .STRONG.GPU): each program drops a line that other threads of
    it may have read, so every discard must come after a block barrier that comes after every
    slot-row load (static order; the row loop's body holds all three)."""
    loads = [i for i, op in enumerate(ops) if op.startswith("LDG") and ".STRONG.GPU" in op]
    discards = [i for i, op in enumerate(ops) if op.startswith("CCTL")]
    barriers = [i for i, op in enumerate(ops) if op.startswith("BAR")]
    if not loads or not discards:
        return [f"expected slot-row loads and discards, found {len(loads)} and {len(discards)}"]
    if not any(loads[-1] < b < discards[0] for b in barriers):
        return ["a discard is not behind a block barrier behind the last slot-row load"]
    return []


TP1 = {  # case -> (quant, T, SMs: 0 whole rows, else the split kernel's launch at that T)
    "tp1_whole_rows_nvfp4": ("nvfp4", 64, 0),
    "tp1_split_rows_fp8": ("fp8", 16, 132),
}

TWOSHOT = {  # case -> (recorded kernel, the constexprs of a GPU call, lets dependents in early)
    "twoshot_finalize": ("_finalize_kernel", {"USE_PDL": True, "L2": 2}, True),
    "twoshot_reduce": ("_rows_kernel", {"USE_PDL": True, "L2": 2}, True),
    "twoshot_gather": (
        "_rows_kernel",
        {"USE_PDL": True, "L2": 2, "GATHER": True, "LAST": True},
        True,
    ),
    "twoshot_sync": (
        "_sync_kernel",
        {"USE_PDL": True, "EMU": False, "SIGNAL": 1, "WAIT": 1, "RELEASE": True, "GATE": True}
        | {"ADVANCE": True},
        False,  # row programs parked behind a spinning sync would take SMs from the finalize
    ),
}

DISCARDING = ("twoshot_reduce", "twoshot_gather")  # L2=2: they drop the slot rows they read


def _tp1_compiled(quant: str, tokens: int, num_sms: int):
    from benchmarks import offline_sass as offline
    from fusion_bridge.kernels.tp1 import whole_rows
    from fusion_bridge.kernels.tp1 import split_rows as tp1_split
    from fusion_bridge.kernels.tp1.configs import MAX_POLLS

    kernel = tp1_split._tp1_split_kernel if num_sms else whole_rows._tp1_kernel
    args, kwargs = offline.recorded_launch(kernel, offline._tp1_launch(quant, tokens, num_sms))
    gpu = {"USE_PDL": 1, "RECIP": int(quant == "fp8")}
    if num_sms:  # both phases in one launch, as a GPU call
        gpu |= {"PHASES": 3, "MAX_POLLS": MAX_POLLS}
    return offline.compile_for_sm90(kernel, args, kwargs, gpu)


def _twoshot_launches() -> dict:
    """The two-shot pipeline's first finalize, rows and sync launch of one call (W=2 emulated on
    CPU tensors, as the offline tool's twoshot cases launch it): kernel name -> (kernel, args,
    kwargs); nothing runs."""
    from benchmarks import offline_sass as offline
    from fusion_bridge.kernels.symm import twoshot_kernels as kernels

    spec = EpilogueSpec(hidden_size=7168, top_k=8, routed_scaling_factor=2.5)
    inp = make_inputs(spec, 64, seed=0, device="cpu", skip_fraction=0.0)
    seen = {}
    all_kernels = (kernels._finalize_kernel, kernels._rows_kernel, kernels._sync_kernel)

    def recorder(kernel):
        return lambda *args, grid, warmup, **kwargs: seen.setdefault(
            kernel.fn.__name__, (kernel, args, kwargs)
        )

    for kernel in all_kernels:
        kernel.run = recorder(kernel)
    try:
        offline._twoshot_launch(2, inp, offline._outputs())()
    finally:
        for kernel in all_kernels:
            del kernel.run
    return seen


def compile_and_check(outdir: str) -> dict:
    """case -> its problems (empty: the wait comes first). Run with the interpreter off."""
    from benchmarks import offline_sass as offline

    found = {}
    for case, (quant, tokens, num_sms) in TP1.items():
        compiled = _tp1_compiled(quant, tokens, num_sms)
        found[case] = check(opcodes(compiled, outdir, case), launches_dependents=True)
    launches = _twoshot_launches()
    for case, (name, gpu, launches_dependents) in TWOSHOT.items():
        kernel, args, kwargs = launches[name]
        compiled = offline.compile_for_sm90(kernel, args, kwargs, gpu)
        ops = opcodes(compiled, outdir, case)
        found[case] = check(ops, launches_dependents)
        if case in DISCARDING:
            found[f"{case}:discard"] = discard_problems(ops)
    return found


@pytest.fixture(scope="module")
def compiled_cases(tmp_path_factory):
    from tests.helpers import once_per_run  # here: this file is also the child's script

    return once_per_run(tmp_path_factory, "pdl_sass", _compile_cases)  # xdist workers share it


def _compile_cases(outdir):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, os.path.abspath(__file__), str(outdir)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(TP1) + list(TWOSHOT))
def test_each_pdl_kernel_waits_before_any_global_memory_access(case, compiled_cases):
    assert compiled_cases[case] == [], (case, compiled_cases[case])


@pytest.mark.parametrize("case", DISCARDING)
def test_the_row_launches_drop_slot_rows_only_behind_a_barrier_behind_every_read(
    case, compiled_cases
):
    assert compiled_cases[f"{case}:discard"] == [], (case, compiled_cases[f"{case}:discard"])


def test_the_discard_check_sees_a_discard_before_the_barrier_or_the_last_read():
    fine = ["LDG.E.128.STRONG.GPU", "FADD", "BAR.SYNC.DEFER_BLOCKING", "CCTL.E.RML2", "STG.E"]
    assert not discard_problems(fine)
    assert discard_problems(["LDG.E.128.STRONG.GPU", "CCTL.E.RML2", "BAR.SYNC", "STG.E"])
    assert discard_problems(["BAR.SYNC", "LDG.E.128.STRONG.GPU", "CCTL.E.RML2"])
    assert discard_problems(["LDG.E.128.STRONG.GPU", "BAR.SYNC"])  # no discard at all


def test_the_check_sees_an_access_above_the_wait_and_a_missing_wait():
    """The check itself (what the tests above rely on), on opcode lists."""
    fine = ["S2R", "ACQBULK", "PREEXIT", "LDG.E.128", "STG.E"]
    assert not check(fine, launches_dependents=True)
    assert check(["LDG.E", "ACQBULK", "PREEXIT"], True)
    assert check(["ATOMG.E.ADD", "ACQBULK"], False)
    assert check(["CCTL.E.PF2", "ACQBULK"], False)
    assert check(["S2R", "LDG.E"], False) == ["no grid-dependency wait (ACQBULK) in the kernel"]
    assert check(fine, launches_dependents=False)  # PREEXIT where none was asked for
    assert not check(["LDS", "ULDC", "ACQBULK"], False)  # shared memory, constant banks


if __name__ == "__main__":
    print(json.dumps(compile_and_check(sys.argv[1])))
