"""Programmatic dependent launch is gated (kernels/pdl.py): on CPU tensors, under the interpreter
and below sm_90 our kernels are launched as before (USE_PDL 0, launchers without `launch_pdl`),
whatever the launch config asks; on sm_90+ a config's pdl picks the PDL launchers, whose
USE_PDL constexpr is then 1 (the pair is what makes a PDL launch safe). Planning only: nothing is
launched (the GPU behaviour: tests/kernels/test_pdl_late_writer.py)."""

import pytest
import torch

from fusion_bridge.kernels import pdl as P
from fusion_bridge.kernels.symm import twoshot as symm_twoshot
from fusion_bridge.kernels.tp1 import launcher as tp1_launch
from fusion_bridge.kernels.layer import LayerRecord
from fusion_bridge.spec import EpilogueSpec


def _plan(launcher, tokens, pdl):
    config = launcher.config_for(tokens)._replace(pdl=pdl)
    return launcher.plan(tokens, 8, True, True, (tokens, 0), config)


def _local(pdl_ok):
    spec = EpilogueSpec(hidden_size=4096, top_k=8)
    launcher = tp1_launch.Tp1Launcher(LayerRecord.of(spec), 132, torch.device("cpu"))
    launcher.pdl_ok = pdl_ok  # as Tp1Launcher found the device
    return launcher


def test_pdl_is_off_on_cpu_and_under_the_interpreter():
    assert not P.pdl_ok(torch.device("cpu"))
    assert not _local(P.pdl_ok(torch.device("cpu"))).pdl_ok


@pytest.mark.parametrize("capability,expected", [((8, 0), False), ((9, 0), True), ((10, 0), True)])
def test_pdl_needs_sm90_and_no_interpreter(monkeypatch, capability, expected):
    from triton import knobs

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(knobs.runtime, "interpret", False)
    assert P.pdl_ok(torch.device("cuda", 0)) is expected
    monkeypatch.setattr(knobs.runtime, "interpret", True)
    assert not P.pdl_ok(torch.device("cuda", 0))


def test_pdl_is_off_on_rocm_and_with_a_triton_without_the_launch_option(monkeypatch):
    from triton import knobs

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(knobs.runtime, "interpret", False)
    assert P.pdl_ok(torch.device("cuda", 0))  # the case below differs in one thing each
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not P.pdl_ok(torch.device("cuda", 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(P, "_triton_has_launch_pdl", lambda: False)
    assert not P.pdl_ok(torch.device("cuda", 0))


def test_this_triton_has_the_launch_option():
    assert P._triton_has_launch_pdl()  # Triton 3.6, the tested pin


@pytest.mark.parametrize("tokens", [1, 16, 300])  # split rows, split rows, whole rows
def test_fused_tp1_takes_the_pdl_launchers_exactly_where_allowed(tokens):
    """The config's pdl with the device allowing it: a kernel launcher with launch_pdl and USE_PDL
    1; either off: a kernel launcher without it and USE_PDL 0 (today's launch)."""
    for allowed in (False, True):
        for pdl in (0, 1):
            plan = _plan(_local(allowed), tokens, pdl)
            on = bool(allowed and pdl)
            assert plan.constexprs.USE_PDL == int(on), (allowed, pdl, plan.constexprs)
            assert bool(plan.kernel.options.get("launch_pdl")) is on, (allowed, pdl)


def test_the_twoshot_launches_use_pdl_only_where_allowed(monkeypatch):
    """Every launch of a twoshot call (F, R, sync) records its launcher: with TwoshotConfig.pdl on,
    PDL launchers with USE_PDL True only where `pdl_ok` says so."""
    from fusion_bridge.kernels.records import LayerScalars, RowOutputs, RowSource
    from fusion_bridge.kernels.symm.twoshot import _call_launches

    names = [n + s for n in ("_LAUNCH_F", "_LAUNCH_R", "_LAUNCH_S") for s in ("", "_PDL")]
    reals = {name: getattr(symm_twoshot, name) for name in names}
    for allowed in (False, True):
        monkeypatch.setattr(symm_twoshot, "pdl_ok", lambda device, a=allowed: a)
        made = []
        for name, real in reals.items():
            monkeypatch.setattr(
                symm_twoshot, name, lambda g, a, c, w, real=real: made.append((real, c))
            )
        layer = type("L", (), {})()
        layer.world, layer.rank, layer.hidden = 1, 0, 256
        layer.quant = type("Q", (), {"code": 0, "swizzled": 0, "scale": 1.0})()
        layer.ptrs = layer.state = torch.zeros(2, dtype=torch.int64)
        layer.own_addr = layer.ptrs.data_ptr()
        layer.routed_scaling, layer.eps, layer.weight_bias, layer.timeout_us = 1.0, 1e-6, 0.0, 1
        layer.scalars = LayerScalars(1.0, 1e-6, 0.0, 1.0)
        x = torch.zeros(3, 256, dtype=torch.bfloat16)
        src = RowSource(x, torch.zeros(3, 2, dtype=torch.int32), x, None, x, x[0])
        config = symm_twoshot.TwoshotConfig(pdl=True)
        calls = _call_launches(layer, config, src, RowOutputs(x, x, x, x), False)
        for p in calls.plans:
            calls.f(p)()
            calls.r(p, False)()
        calls.sync(0, signal=1)()
        assert len(made) == 3
        for real, consts in made:
            assert consts[0].USE_PDL is allowed, (real.name, consts)  # PIPE, the call's Pipeline
            assert bool(real.options.get("launch_pdl")) is allowed, real.name
