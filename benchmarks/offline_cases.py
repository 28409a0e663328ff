"""The cases of `benchmarks/offline_sass.py`: each product kernel's real launch as the production
launcher makes it, on CPU tensors (H=7168, K=8), by name -> (kernel module, kernel name, launch),
and what a GPU call passes differently per case (`gpu_constexprs`). The launches, their adaptation
to older trees' module names and launch APIs (a case a tree lacks raises, and the tool prints it
as skipped) and the names of the tensors each case passes (the parameter labels) are
offline_launches.py's; the names offline_sass.py takes from here are re-exported."""

from __future__ import annotations

import os
import sys

import torch

from fusion_bridge.spec import EpilogueSpec, QuantSpec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the launches beside this file
from offline_launches import (  # noqa: E402, F401 (offline_sass uses the ones not used here)
    SPEC,
    H,
    K,
    T,
    _call,
    _emulated_group,
    _family_launcher,
    _module,
    _name_call,
    _NAMES,
    _outputs,
    _symm_launch,
    _tp1_launch,
    _twoshot_launch,
    make_inputs,
    name_tensors,
    symm_oneshot,
    symm_twoshot,
    symm_twoshot_kernels,
    tp1_launch_module,
)

# after offline_launches: this tree's fusion_bridge.kernels is the one loaded
from fusion_bridge.kernels import add_rmsnorm, finalize_add  # noqa: E402

_REDUCED: list = []  # the finalize case's output


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
