"""The cases of `benchmarks/offline_sass.py`: each product kernel's real launch as the production
launcher makes it, on CPU tensors (H=7168, K=8), adapting to older trees' module names and launch
APIs (a case a tree lacks raises, and the tool prints it as skipped), and the names of the tensors
each case passes (the parameter labels)."""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys

import torch

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

H, K, T = 7168, 8, 64  # T is not specialized (do_not_specialize), any T > 1 compiles the same
SPEC = EpilogueSpec(hidden_size=H, top_k=K, routed_scaling_factor=2.5, quant=QuantSpec.none())


_NAMES: dict = {}  # data_ptr -> the name of a tensor a case passes (its parameter labels)
_REDUCED: list = []  # the finalize case's output


def name_tensors(**tensors) -> None:
    """Remember which tensor is which (EpilogueInputs fields, outputs, workspace tensors), so the
    kernel parameters of a case are labelled by what they receive (`<case>.params.json`)."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.data_ptr():
            _NAMES[t.data_ptr()] = name


def _outputs():
    """residual_out, norm_out and the (unused, quant none) q and sf."""
    ro = torch.empty(T, H, dtype=SPEC.dtype)
    empty = torch.empty(0, dtype=torch.uint8)
    return ro, torch.empty_like(ro), empty, empty


def _call(launch, inp, out) -> None:
    """`launch` (a kernel family's launcher, or a tree's launch function with its layer bound)
    called as this tree takes a call's arguments: the records (`call_records`, issue 46), or the
    tensors by keyword (`call_tensors`, before)."""
    rig = _module(*_RIG)
    if hasattr(rig, "call_records"):
        launch(*rig.call_records(inp, out))
    else:
        launch(**rig.call_tensors(inp, out))


def _family_launcher(module, class_name: str, layer):
    """The family's launcher for `layer` (issue 46: a class), else the tree's module-level
    `launch` with the layer bound."""
    cls = getattr(module, class_name, None)
    if cls is not None:
        return cls(layer)
    return lambda *args, **kwargs: module.launch(layer, *args, **kwargs)


def _symm_launch(module, world: int, inp, out):
    if not hasattr(module, "launch") and not hasattr(module, "OneshotLauncher"):
        # before the restructure (two-shot only, world 1)
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
    cap = 2048 if module is symm_oneshot else 4096
    kind = "oneshot" if module is symm_oneshot else "twoshot"
    group = _emulated_group(kind, SPEC, world, cap, num_sms=132 // world)
    name_tensors(ptrs=group.layers[0].ptrs, state=group.layers[0].state)
    return lambda: _call(_family_launcher(module, "OneshotLauncher", group.layers[0]), inp, out)


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

    table = {}
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
            _call(_family_launcher(symm_oneshot, "OneshotLauncher", group.layers[0]), inp, out)

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
    if hasattr(QuantSpec, "fp8_per_token_group"):  # dynamic FP8 in the norm kernel (issue 49)
        from fusion_bridge.epilogue_tensors import allocate_outputs

        spec = EpilogueSpec(
            hidden_size=H, top_k=K, quant=QuantSpec.fp8_per_token_group(128, "column_major_tma")
        )
        inp = make_inputs(spec, T, seed=0, device="cpu", skip_fraction=0.0)
        dyn = allocate_outputs(spec, T, torch.device("cpu"))
        out = (dyn.residual_out, dyn.norm_out, dyn.quant.view(torch.uint8), dyn.scale)
        norm = dict(eps=spec.eps, weight_bias=0.0, quant=3, quant_scale=1.0, swizzled=True,
                    group=128, scale_layout=2)  # fmt: skip
        table["add_rmsnorm_fp8g"] = (
            add_rmsnorm,
            "_add_rmsnorm_kernel",
            lambda inp=inp, out=out, n=norm: (
                _name_call(inp, out),
                add_rmsnorm.add_rmsnorm_into(*out, out[0], out[0], inp.gamma, **n),
            ),
        )
    table.update(fp8_group_quant_cases())
    return table


def fp8_group_quant_cases() -> dict:
    """The standalone per-token-group FP8 kernel (kernels/fp8_group_quant.py) on a [T, H] bf16
    norm_out: groups of 128 with row-major and TMA scales, and per token."""
    from fusion_bridge.kernels import fp8_group_quant as fgq

    table = {}
    for name, group, layout in (
        ("fp8_group_row", 128, "row_major"),
        ("fp8_group_tma", 128, "column_major_tma"),
        ("fp8_per_token", H, "row_major"),
    ):
        x = torch.empty(T, H, dtype=torch.bfloat16)
        q = torch.empty(T, H, dtype=torch.float8_e4m3fn)
        s = fgq.empty_scales(T, H // group, layout, "cpu")

        def launch(x=x, q=q, s=s, g=group, lay=layout):
            name_tensors(norm_out=x, q=q, sf=s)
            fgq.fp8_group_quant_into(q, s, x, g, lay)

        table[name] = (fgq, "_fp8_group_quant_kernel", launch)
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

    q = {"none": QuantSpec.none(), "fp8": QuantSpec.fp8(0.05), "nvfp4": QuantSpec.nvfp4(336.0)}
    if hasattr(QuantSpec, "fp8_per_token_group"):  # dynamic FP8 (issue 49)
        q.update(fp8g=QuantSpec.fp8_per_token_group(128, "column_major_tma"))
        q.update(fp8t=QuantSpec.fp8_per_token())
    spec = EpilogueSpec(hidden_size=H, top_k=K, routed_scaling_factor=2.5, quant=q[quant])
    inp = make_inputs(spec, tokens, seed=0, device="cpu", skip_fraction=0.0)
    ro = torch.empty(tokens, H, dtype=spec.dtype)
    if getattr(spec.quant, "dynamic_fp8", False):
        from fusion_bridge.epilogue_tensors import allocate_outputs

        dyn = allocate_outputs(spec, tokens, ro.device)
        qb, sf = dyn.quant, dyn.scale
    else:
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

        # kernels/tp1/launch.py's Tp1Dispatcher until issue 46 (tp1/launcher.py's Tp1Launcher)
        host = _module("fusion_bridge.kernels.tp1.launch", "fusion_bridge.kernels.tp1.launcher")
        cls = getattr(host, "Tp1Launcher", None) or host.Tp1Dispatcher
        launcher = cls(LayerRecord.of(spec), num_sms, ro.device)
    return lambda: (_name_call(inp, out), _call(launcher, inp, out))


def _twoshot_launch(world: int, inp, out, spec=SPEC):
    """The large-T two-shot's launch (its default config: TwoshotConfig, TwoshotShape before
    issue 46) of rank 0 of `world` emulated ranks on CPU tensors; the other twoshot kernels'
    launches are stubbed out (`twoshot_others`). A G launch has the R launch's arguments
    (GATHER set by gpu_constexprs)."""
    from fusion_bridge.kernels.quant_codes import quant_args

    pipeline = _module("fusion_bridge.kernels.symm_staged", "fusion_bridge.kernels.symm.twoshot")
    rig = _module(*_TWOSHOT_RIG)
    config_type = (
        getattr(pipeline, "TwoshotConfig", None)
        or getattr(pipeline, "TwoshotShape", None)
        or pipeline.StagedShape
    )
    fields = getattr(config_type, "__dataclass_fields__", None) or config_type._fields
    config = config_type(**({"stream_mode": "one"} if "stream_mode" in fields else {}))
    group = rig.EmulatedTwoshot(world, config.chunk, H, config.slots)
    _name_call(inp, out)
    name_tensors(ptrs=group.ptrs[0], state=group.states[0], buffer=group.bufs[0])
    scalars = (2.5, spec.eps, 0.0)
    layer = rig.twoshot_layer(group.ptrs[0], group.states[0], world, 0, 132 // world, 3, H,
                              scalars, quant_args(spec))  # fmt: skip
    launcher = getattr(pipeline, "TwoshotLauncher", None)
    if launcher is not None:  # issue 46: the records, the config by position
        return lambda: _call(lambda src, dst: launcher(layer)(src, dst, config), inp, out)
    return lambda: _call(
        lambda **tensors: pipeline.launch(layer, shape=config, **tensors), inp, out
    )


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
        "fusion_bridge.kernels.oneshot_shapes",
        "fusion_bridge.kernels.tp1.shapes",
        "fusion_bridge.kernels.tp1.configs",
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
        | {  # dynamic FP8 (issue 49; per token takes whole rows at every T)
            f"tp1_{quant}_{kind}": (
                tp1_launch_module(kind),
                "_tp1_kernel" if kind == "rows" else "_tp1_split_kernel",
                lambda quant=quant, tokens=tokens, sms=sms: _tp1_launch(quant, tokens, sms)(),
            )
            for quant, kind, tokens, sms in (
                ("fp8g", "rows", 64, 0),
                ("fp8g", "split16", 16, 132),
                ("fp8t", "rows", 64, 0),
            )
            if hasattr(QuantSpec, "fp8_per_token_group")
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
