"""What the cases of `benchmarks/offline_sass.py` (offline_cases.py) launch through: this tree's
kernels and launchers as the production launcher makes the launches, on CPU tensors (H=7168,
K=8), adapted to older trees' module names and launch APIs (a launch a tree lacks raises, and the
tool prints its case as skipped), and the names of the tensors each launch passes (the parameter
labels). Importing it loads fusion_bridge.kernels from this tree (`_tree_kernels`)."""

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


def name_tensors(**tensors) -> None:
    """Remember which tensor is which (EpilogueInputs fields, outputs, workspace tensors), so the
    kernel parameters of a case are labelled by what they receive (`<case>.params.json`)."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.data_ptr():
            _NAMES[t.data_ptr()] = name


def _name_call(inp, out) -> None:
    """Name a call's inputs and outputs for the parameter labels."""
    fields = ("gemm2_out", "perm", "weights", "shared", "residual", "gamma")
    name_tensors(**dict(zip(fields, inp)))
    name_tensors(**dict(zip(("residual_out", "norm_out", "q", "sf"), out)))


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


def tp1_launch_module(kind: str):
    """The module of the world-size-1 kernel (trees before kernels/tp1/: oneshot_local and
    tp1_split at the top of kernels/)."""
    kernels = "fusion_bridge.kernels."
    if kind == "rows":
        return _module(kernels + "oneshot_local", kernels + "tp1.whole_rows")
    return _module(kernels + "tp1_split", kernels + "tp1.split_rows")
