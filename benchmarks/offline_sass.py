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
launches (symm_twoshot, default TwoshotShape, rank 0) twoshot_rows_w1_none, twoshot_finalize_w1,
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

import importlib.util
import inspect
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

import fusion_bridge
from fusion_bridge.spec import EpilogueSpec, QuantSpec


def _module(*names: str):
    """The first of the modules `names` this tree has, or None. Callers list the older trees' names
    first: an editable install of another checkout can supply a newer name that this tree lacks."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    return None


def _tree_kernels() -> None:
    """fusion_bridge.kernels from this tree: an editable install maps the package to the
    installed tree's kernels/ (pyproject package-dir), which PYTHONPATH alone does not override."""
    where = os.path.join(os.path.dirname(os.path.dirname(fusion_bridge.__file__)), "kernels")
    init = os.path.join(where, "__init__.py")
    loaded = sys.modules.get("fusion_bridge.kernels")
    if loaded is not None:  # a namespace package (no __init__.py) has no __file__
        paths = [os.path.realpath(p) for p in getattr(loaded, "__path__", ())]
        if os.path.realpath(where) not in paths:
            print(f"warning: fusion_bridge.kernels from {paths}", file=sys.stderr)
        return
    if not os.path.exists(init):  # kernels/ is no package: the link fusion_bridge/kernels serves
        return
    spec = importlib.util.spec_from_file_location(
        "fusion_bridge.kernels", init, submodule_search_locations=[where]
    )
    sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fusion_bridge.kernels = module


_tree_kernels()
from fusion_bridge.kernels import add_rmsnorm, finalize_add  # noqa: E402

make_inputs = _module(
    "fusion_bridge.synthetic", "fusion_bridge.oracle.synthetic", "fusion_bridge.testing"
).make_inputs
symm_oneshot = _module("fusion_bridge.kernels.symm_oneshot", "fusion_bridge.kernels.symm.oneshot")
# the two-shot pipeline's kernels (named "staged" before; trees before it: its cases skip)
symm_twoshot_kernels = _module(
    "fusion_bridge.kernels.symm_staged_kernels", "fusion_bridge.kernels.symm.twoshot_kernels"
)
# the persistent two-shot kernel: trees before the ring replaced it (its cases then skip)
symm_twoshot = _module("fusion_bridge.kernels.symm_twoshot")
# the rigs of emulated ranks (in kernels/ before the package's folders)
_RIG = ("fusion_bridge.kernels.symm_testing", "fusion_bridge.testing.symm_oneshot_rig")
_TWOSHOT_RIG = (
    "fusion_bridge.kernels.symm_testing_staged",
    "fusion_bridge.testing.symm_twoshot_rig",
)

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
H, K, T = 7168, 8, 64  # T is not specialized (do_not_specialize), any T > 1 compiles the same
SPEC = EpilogueSpec(hidden_size=H, top_k=K, routed_scaling_factor=2.5, quant=QuantSpec.none())


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


_NAMES: dict = {}  # data_ptr -> the name of a tensor a case passes (its parameter labels)
_REDUCED: list = []  # the finalize case's output


def name_tensors(**tensors) -> None:
    """Remember which tensor is which (EpilogueInputs fields, outputs, workspace tensors), so the
    kernel parameters of a case are labelled by what they receive (`<case>.params.json`)."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.data_ptr():
            _NAMES[t.data_ptr()] = name


def _label(value) -> str:
    if isinstance(value, torch.Tensor):
        return _NAMES.get(value.data_ptr(), f"tensor {value.dtype} {tuple(value.shape)}")
    if type(value) is int and value in _NAMES:  # an address passed as an int (own_addr)
        return "&" + _NAMES[value]
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


def _outputs():
    """residual_out, norm_out and the (unused, quant none) q and sf."""
    ro = torch.empty(T, H, dtype=SPEC.dtype)
    empty = torch.empty(0, dtype=torch.uint8)
    return ro, torch.empty_like(ro), empty, empty


def _symm_launch(module, world: int, inp, out):
    if not hasattr(module, "launch"):  # before the restructure (two-shot only, world 1)
        if world != 1:
            raise TypeError("this tree's launcher is adapted at world size 1 only")
        from types import SimpleNamespace

        HEADER_BYTES = _module("fusion_bridge.kernels.symm_common").HEADER_BYTES

        ws = SimpleNamespace(ptrs=torch.zeros(2, dtype=torch.int64), world=1, rank=0, cap=4096)
        ws.state, ws.data_off = torch.zeros(8, dtype=torch.int32), HEADER_BYTES // 2
        ws.num_sms, ws.timeout_ns = 132, 10**10
        args = (inp.gemm2_out, inp.expanded_idx_to_permuted_idx, inp.expert_weights)
        args += (inp.shared_output, inp.residual, inp.gamma, 2.5, SPEC.eps, 0.0, 0, 1.0, False)
        return lambda: module.fused_into(ws, *out, *args)
    call_tensors = _module(*_RIG).call_tensors
    cap = 2048 if module is symm_oneshot else 4096
    kind = "oneshot" if module is symm_oneshot else "twoshot"
    group = _emulated_group(kind, SPEC, world, cap, num_sms=132 // world)
    name_tensors(ptrs=group.layers[0].ptrs, state=group.layers[0].state)
    return lambda: module.launch(group.layers[0], **call_tensors(inp, out))


def _emulated_group(kind: str, spec, world: int, cap: int, num_sms: int):
    """W emulated ranks on CPU tensors; trees before the two-shot got its own rig passed the
    kernel kind first."""
    emulated_group = _module(*_RIG).emulated_group
    lead = (kind,) if "kind" in inspect.signature(emulated_group).parameters else ()
    return emulated_group(*lead, spec, world, cap, device="cpu", num_sms=num_sms)


def quant_cases() -> dict:
    """The kernels that quantize without LEAN, to FP8 and to NVFP4: the standalone quant kernel,
    the norm kernel, the one-shot exchange kernel (its windowed quantize_span)."""
    from fusion_bridge.epilogue_tensors import quant_buffers
    from fusion_bridge.kernels import quant

    call_tensors, table = _module(*_RIG).call_tensors, {}
    for kind, code, scale in (("fp8", 1, 0.05), ("nvfp4", 2, 336.0)):
        qspec = QuantSpec.fp8(scale) if code == 1 else QuantSpec.nvfp4(scale)
        spec = EpilogueSpec(hidden_size=H, top_k=K, routed_scaling_factor=2.5, quant=qspec)
        inp = make_inputs(spec, T, seed=0, device="cpu", skip_fraction=0.0)
        ro = torch.empty(T, H, dtype=spec.dtype)
        q, sf = quant_buffers(T, H, spec.quant.kind, spec.quant.sf_layout, ro.device)
        out = (ro, torch.empty_like(ro), q.view(torch.uint8), torch.empty(0) if sf is None else sf)
        norm = dict(eps=spec.eps, weight_bias=0.0, quant=code, quant_scale=scale, swizzled=True)

        def oneshot(spec=spec, inp=inp, out=out):
            _name_call(inp, out)
            group = _emulated_group("oneshot", spec, 2, 2048, num_sms=66)
            name_tensors(ptrs=group.layers[0].ptrs, state=group.layers[0].state)
            symm_oneshot.launch(group.layers[0], **call_tensors(inp, out))

        table[f"quantize_{kind}"] = (
            quant,
            "_quantize_kernel",
            lambda inp=inp, out=out, c=code, s=scale: (
                _name_call(inp, out),
                quant.quantize_into(*out[2:], out[0], c, s, True),
            ),
        )
        table[f"add_rmsnorm_{kind}"] = (
            add_rmsnorm,
            "_add_rmsnorm_kernel",
            lambda inp=inp, out=out, n=norm: (
                _name_call(inp, out),
                add_rmsnorm.add_rmsnorm_into(*out, out[0], out[0], inp.gamma, **n),
            ),
        )
        table[f"oneshot_w2_{kind}"] = (symm_oneshot, "_oneshot_kernel", oneshot)
        for stage in ("rows", "gather"):  # the two-shot's row launches, quantizing
            table[f"twoshot_{stage}_w2_{kind}"] = (
                symm_twoshot_kernels,
                "_rows_kernel",
                lambda inp=inp, out=out, spec=spec: _twoshot_launch(2, inp, out, spec)(),
            )
    return table


def _name_call(inp, out) -> None:
    """Name a call's inputs and outputs for the parameter labels."""
    fields = ("gemm2_out", "perm", "weights", "shared", "residual", "gamma")
    name_tensors(**dict(zip(fields, inp)))
    name_tensors(**dict(zip(("residual_out", "norm_out", "q", "sf"), out)))


def _tp1_launch(quant: str, tokens: int, num_sms: int):
    """fused_tp1's launch at T as on an H200 (num_sms 132: the split kernel where the GPU would
    take it; PREFETCH and RECIP as a GPU call sets them), on CPU tensors."""
    from fusion_bridge.epilogue_tensors import quant_buffers

    call_tensors = _module(*_RIG).call_tensors
    q = {"none": QuantSpec.none(), "fp8": QuantSpec.fp8(0.05), "nvfp4": QuantSpec.nvfp4(336.0)}
    spec = EpilogueSpec(hidden_size=H, top_k=K, routed_scaling_factor=2.5, quant=q[quant])
    inp = make_inputs(spec, tokens, seed=0, device="cpu", skip_fraction=0.0)
    ro = torch.empty(tokens, H, dtype=spec.dtype)
    qb, sf = quant_buffers(tokens, H, spec.quant.kind, spec.quant.sf_layout, ro.device)
    empty = torch.empty(0, dtype=torch.uint8)
    qb = empty if qb is None else qb.view(torch.uint8)
    out = (ro, torch.empty_like(ro), qb, empty if sf is None else sf)
    old = _module("fusion_bridge.kernels.tp1_launch")  # before kernels/tp1/
    if old is not None:
        SymmLayer = _module("fusion_bridge.kernels.symm_protocol").SymmLayer
        launcher = old.LocalLauncher(SymmLayer.local(spec, ro.device), num_sms, ro.device)
    else:
        from fusion_bridge.kernels.layer import LayerRecord
        from fusion_bridge.kernels.tp1.launch import Tp1Dispatcher

        launcher = Tp1Dispatcher(LayerRecord.of(spec), num_sms, ro.device)
    return lambda: (_name_call(inp, out), launcher(**call_tensors(inp, out)))


def _twoshot_launch(world: int, inp, out, spec=SPEC):
    """symm_twoshot.launch (the large-T two-shot, default TwoshotShape) of rank 0 of `world`
    emulated ranks on CPU tensors; the other twoshot kernels' launches are stubbed out
    (`twoshot_others`). A G launch has the R launch's arguments (GATHER set by gpu_constexprs)."""
    from fusion_bridge.kernels.quant_codes import quant_args

    pipeline = _module("fusion_bridge.kernels.symm_staged", "fusion_bridge.kernels.symm.twoshot")
    rig, call_tensors = _module(*_TWOSHOT_RIG), _module(*_RIG).call_tensors
    shape_type = getattr(pipeline, "TwoshotShape", None) or pipeline.StagedShape
    fields = getattr(shape_type, "__dataclass_fields__", None) or shape_type._fields
    shape = shape_type(**({"stream_mode": "one"} if "stream_mode" in fields else {}))
    group = rig.EmulatedTwoshot(world, shape.chunk, H, shape.slots)
    _name_call(inp, out)
    name_tensors(ptrs=group.ptrs[0], state=group.states[0], buffer=group.bufs[0])
    scalars = (2.5, spec.eps, 0.0)
    layer = rig.twoshot_layer(group.ptrs[0], group.states[0], world, 0, 132 // world, 3, H,
                              scalars, quant_args(spec))  # fmt: skip
    return lambda: pipeline.launch(layer, shape=shape, **call_tensors(inp, out))


def twoshot_others(kernel_name: str) -> tuple:
    """The twoshot kernels a twoshot case does not record (their launches are stubbed out)."""
    if kernel_name not in ("_rows_kernel", "_finalize_kernel", "_sync_kernel"):
        return ()
    names = ("_rows_kernel", "_finalize_kernel", "_sync_kernel")
    return tuple(getattr(symm_twoshot_kernels, n) for n in names if n != kernel_name)


def gpu_constexprs(name: str) -> dict:
    """What a GPU call passes where the CPU launch differs (HW_CVT aside): fp8 divides through
    the reciprocal; the split kernel runs both phases in one launch and polls for ~1 s."""
    # the pipeline's launches (twoshot_w1_none / _w2_none: the persistent kernel, no such options)
    if name.startswith("twoshot_sync"):  # a GPU call's every step, the G launch's wait
        steps = dict(SIGNAL=1, WAIT=1, RELEASE=True, ADVANCE=True, GATE=True, EMU=False)
        return steps | {"USE_PDL": name.endswith("_pdl")}
    if name.startswith(("twoshot_rows", "twoshot_finalize", "twoshot_gather")):
        # a GPU call: L2 hints (l2=2) and PDL unless `_l0`; not LAST
        got = {"L2": 0, "USE_PDL": False} if name.endswith("_l0") else {"L2": 2, "USE_PDL": True}
        gather = {"GATHER": True} if "gather" in name else {}
        return got | ({} if "finalize" in name else {"LAST": False} | gather)
    if not name.startswith("tp1_"):
        return {}
    MAX_POLLS = _module(
        "fusion_bridge.kernels.oneshot_shapes", "fusion_bridge.kernels.tp1.shapes"
    ).MAX_POLLS
    got = {"RECIP": int("_fp8_" in name)} | ({"USE_PDL": 1} if name.endswith("_pdl") else {})
    return got | ({"PHASES": 3, "MAX_POLLS": MAX_POLLS} if "split" in name else {})


def cases(inp, out) -> dict:
    """name -> (kernel module, kernel name, launch): resolved only when the case runs, so a tree
    without one of them (the tree before the restructure) skips that case alone."""
    ro, no, q, sf = out
    reduced = torch.empty_like(ro)
    _REDUCED[:] = [reduced]
    norm = dict(eps=SPEC.eps, weight_bias=0.0, quant=0, quant_scale=1.0, swizzled=False)
    perm, weights = inp.expanded_idx_to_permuted_idx, inp.expert_weights
    return (
        {
            "twoshot_w1_none": (
                symm_twoshot,
                "_twoshot_kernel",
                lambda: _symm_launch(symm_twoshot, 1, inp, out)(),
            ),
            "twoshot_w2_none": (
                symm_twoshot,
                "_twoshot_kernel",
                lambda: _symm_launch(symm_twoshot, 2, inp, out)(),
            ),
            "oneshot_w2_none": (
                symm_oneshot,
                "_oneshot_kernel",
                lambda: _symm_launch(symm_oneshot, 2, inp, out)(),
            ),
            "add_rmsnorm_none": (
                add_rmsnorm,
                "_add_rmsnorm_kernel",
                lambda: add_rmsnorm.add_rmsnorm_into(ro, no, q, sf, ro, ro, inp.gamma, **norm),
            ),
            "finalize_add": (
                finalize_add,
                "_finalize_add_kernel",
                lambda: finalize_add.finalize_add_into(
                    reduced, inp.gemm2_out, perm, weights, inp.shared_output, 2.5
                ),
            ),
        }
        | {  # the two-shot (symm_twoshot): l2=2 + PDL as a GPU call, `_l0`: l2=0, no PDL
            f"twoshot_{kind}_w{world}{suffix}": (
                symm_twoshot_kernels,
                "_finalize_kernel" if kind == "finalize" else "_rows_kernel",
                lambda world=world: _twoshot_launch(world, inp, out)(),
            )
            for kind, world in (
                ("rows", 1),
                ("finalize", 1),
                ("rows", 2),
                ("gather", 2),
                ("rows", 3),
                ("rows", 8),
            )
            for suffix in (("_none", "_none_l0") if kind != "finalize" else ("", "_l0"))
        }
        | {  # the two-shot's sync launch (the call's first, every step on as gpu_constexprs says)
            f"twoshot_sync_w{world}{suffix}": (
                symm_twoshot_kernels,
                "_sync_kernel",
                lambda world=world: _twoshot_launch(world, inp, out)(),
            )
            for world in (2, 8)
            for suffix in ("", "_pdl")
        }
        | {
            f"tp1_{quant}_{kind}": (
                tp1_launch_module(kind),
                "_tp1_kernel" if kind == "rows" else "_tp1_split_kernel",
                lambda quant=quant, tokens=tokens, sms=sms: _tp1_launch(quant, tokens, sms)(),
            )
            for quant in ("none", "fp8", "nvfp4")
            for kind, tokens, sms in (("rows", 64, 0), ("split16", 16, 132))
        }
        | {  # the same launches with programmatic dependent launch (a GPU sm_90+ call's USE_PDL)
            f"tp1_none_{kind}_pdl": (
                tp1_launch_module(kind),
                "_tp1_kernel" if kind == "rows" else "_tp1_split_kernel",
                lambda tokens=tokens, sms=sms: _tp1_launch("none", tokens, sms)(),
            )
            for kind, tokens, sms in (("rows", 64, 0), ("split16", 16, 132))
        }
    )


def tp1_launch_module(kind: str):
    """The module of the world-size-1 kernel (trees before kernels/tp1/: oneshot_local and
    tp1_split at the top of kernels/)."""
    kernels = "fusion_bridge.kernels."
    if kind == "rows":
        return _module(kernels + "oneshot_local", kernels + "tp1.whole_rows")
    return _module(kernels + "tp1_split", kernels + "tp1.split_rows")


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(sys.argv) > 1 else 2
    outdir, wanted = sys.argv[1], sys.argv[2:] or ["twoshot_w1_none"]
    os.makedirs(outdir, exist_ok=True)
    inp = make_inputs(SPEC, T, seed=0, device="cpu", skip_fraction=0.0)
    outputs = _outputs()
    table = cases(inp, outputs) | quant_cases()
    reduced = _REDUCED[0]
    for name in list(table) if wanted == ["all"] else wanted:
        module, kernel_name, launch = table[name]
        _NAMES.clear()  # an address freed by an earlier case may be another tensor's now
        _name_call(inp, outputs)
        name_tensors(reduced=reduced)
        try:
            kernel = getattr(module, kernel_name)
            args, kwargs = recorded_launch(kernel, launch, twoshot_others(kernel_name))
        except (AttributeError, ImportError, TypeError) as exc:  # a case this tree does not have
            print(f"{name}: skipped ({type(exc).__name__}: {exc})")
            continue
        labels = []
        compiled = compile_for_sm90(kernel, args, kwargs, gpu_constexprs(name), labels)
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
