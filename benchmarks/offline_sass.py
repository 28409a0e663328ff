"""Compile our kernels for the H200 (sm_90) on a machine without a GPU, exactly as the production
launcher would specialize them, and print registers, spills and SASS instruction counts.

    cd <tree> && PYTHONPATH=$PWD python <this file> OUTDIR [CASE ...]

Run it from the root of the tree to compile (PYTHONPATH selects it, or `TREE=<tree> bash
benchmarks/device.sh offline_sass ...`; it adapts to the module names of older trees: before the
package's folders, commit 338b6e9 and earlier, and the two-shot's launch API before the kernel
restructure, commit 5a52f1a). Each case calls the real launcher with
CPU tensors (H=7168, K=8), records the launch instead of running it, binds the arguments with
Triton's own CUDA specialization (alignment, divisibility, constexprs), compiles, and writes
OUTDIR/<case>.{cubin,ptx,ttgir,sass,json}. HW_CVT is set as on a GPU. Cases: twoshot_w1_none (the
default), twoshot_w2_none, oneshot_w2_none, add_rmsnorm_none, finalize_add, the two-shot's
launches (symm_twoshot, default TwoshotConfig, rank 0) twoshot_rows_w1_none, twoshot_finalize_w1,
twoshot_rows_w2_none, twoshot_gather_w2_none, twoshot_rows_w3_none, twoshot_rows_w8_none with l2=2
and PDL as a GPU call (each also `_l0`: l2=0, no PDL; the rows ones not LAST),
twoshot_sync_w2 / _w8 (each also `_pdl`; every step on), tp1_*, *_fp8 and *_nvfp4 (the kernels
that quantize without LEAN, and the two-shot's row launches at W=2);
`all` for every one. A tree without one of the kernels (kernels/symm_twoshot.py: the ring
replaced it) prints its cases as skipped.
The SASS carries line info (nvdisasm -g), so instructions can be attributed to source lines.
OUTDIR/<case>.params.json labels the kernel's parameters, in the order the compiled code has them
(records flattened), by the value each receives: `benchmarks/sass_diff.py OLD NEW` compares two
trees' SASS with the constant-bank offsets read as those labels.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

# the cases beside this file, whatever tree is on PYTHONPATH (TREE=: another tree's package)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import offline_cases as C  # noqa: E402
from offline_cases import _outputs, _tp1_launch, _twoshot_launch  # noqa: E402, F401 (tests use them)

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def recorded_launch(kernel, launch, others=()) -> tuple:
    """(args, kwargs) of the first launch of `kernel` that `launch()` makes; nothing runs (nor do
    the launches of the `others` kernels)."""
    calls = []
    kernel.run = lambda *args, grid, warmup, **kwargs: calls.append((args, kwargs))
    for other in others:
        other.run = lambda *args, **kwargs: None
    try:
        launch()
    finally:
        for k in (kernel, *others):
            del k.run
    return calls[0]


def _label(value) -> str:
    if isinstance(value, torch.Tensor):
        return C._NAMES.get(value.data_ptr(), f"tensor {value.dtype} {tuple(value.shape)}")
    if type(value) is int and value in C._NAMES:  # an address passed as an int (own_addr)
        return "&" + C._NAMES[value]
    return f"{type(value).__name__} {value!r}"


def param_labels(values, types) -> list:
    """The kernel's parameters as the compiled code has them (records flattened, constexprs and
    None left out), each labelled by the value it receives."""
    out = []
    for value, ty in zip(values, types):
        if isinstance(ty, tuple):
            out += param_labels(value, ty)
        elif ty != "constexpr":
            out.append(_label(value))
    return out


def _with_gpu_values(kernel, kwargs: dict, gpu: dict) -> dict:
    """kwargs with a GPU call's constexprs: a kernel parameter by name, or a field of a
    constexpr record (a NamedTuple: RowForm.HW_CVT, the two-shot's PIPE.USE_PDL) that has it."""
    kwargs = dict(kwargs)
    for name, value in gpu.items():
        if name in kernel.arg_names:
            kwargs[name] = value
            continue
        for key, rec in kwargs.items():
            if hasattr(rec, "_fields") and name in rec._fields:
                kwargs[key] = rec._replace(**{name: value})
    return kwargs


def compile_for_sm90(kernel, args, kwargs, gpu_constexprs=None, labels=None):
    """Compile for sm_90 as a GPU call would; `labels` (a list) receives the parameter labels."""
    backend = make_backend(TARGET)
    kwargs = {"debug": False, "instrumentation_mode": "", **kwargs}
    kwargs = _with_gpu_values(kernel, kwargs, {"HW_CVT": True} | (gpu_constexprs or {}))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound, specialization, options
    )
    if labels is not None:
        labels += param_labels(list(bound.values()), list(signature.values()))
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=TARGET, options=options.__dict__)


def summary(compiled, base: str) -> dict:
    with open(base + ".cubin", "wb") as f:
        f.write(compiled.asm["cubin"])
    for kind in ("ptx", "ttgir"):
        with open(f"{base}.{kind}", "w") as f:
            f.write(compiled.asm[kind])
    tool = [f"{BIN}/cuobjdump", "--dump-resource-usage", base + ".cubin"]
    usage = subprocess.run(tool, capture_output=True, text=True, check=True).stdout
    tool = [f"{BIN}/nvdisasm", "-c", "-g", base + ".cubin"]
    sass = subprocess.run(tool, capture_output=True, text=True, check=True).stdout
    with open(base + ".sass", "w") as f:
        f.write(sass)
    regs = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    ops = Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", sass, re.M))
    return {
        "registers": int(regs[1]),
        "stack": int(regs[2]),
        "local": int(regs[4]),
        "spill_stores": ops["STL"] + ops["STL.64"] + ops["STL.128"],
        "spill_loads": ops["LDL"] + ops["LDL.64"] + ops["LDL.128"],
        "instructions": sum(ops.values()),
        "num_warps": compiled.metadata.num_warps,
        "ops": dict(ops.most_common()),
    }


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(sys.argv) > 1 else 2
    outdir, wanted = sys.argv[1], sys.argv[2:] or ["twoshot_w1_none"]
    os.makedirs(outdir, exist_ok=True)
    inp = C.make_inputs(C.SPEC, C.T, seed=0, device="cpu", skip_fraction=0.0)
    outputs = _outputs()
    table = C.cases(inp, outputs) | C.quant_cases()
    reduced = C._REDUCED[0]
    for name in list(table) if wanted == ["all"] else wanted:
        module, kernel_name, launch = table[name]
        C._NAMES.clear()  # an address freed by an earlier case may be another tensor's now
        C._name_call(inp, outputs)
        C.name_tensors(reduced=reduced)
        try:
            kernel = getattr(module, kernel_name)
            args, kwargs = recorded_launch(kernel, launch, C.twoshot_others(kernel_name))
        except (AttributeError, ImportError, TypeError) as exc:  # a case this tree does not have
            print(f"{name}: skipped ({type(exc).__name__}: {exc})")
            continue
        labels = []
        compiled = compile_for_sm90(kernel, args, kwargs, C.gpu_constexprs(name), labels)
        found = summary(compiled, os.path.join(outdir, name))
        with open(os.path.join(outdir, name + ".params.json"), "w") as f:
            json.dump(labels, f, indent=0)
        with open(os.path.join(outdir, name + ".json"), "w") as f:
            json.dump(found, f, indent=1)
        shown = {k: v for k, v in found.items() if k != "ops"}
        print(name, json.dumps(shown), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
