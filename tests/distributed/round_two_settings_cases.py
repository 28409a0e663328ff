"""The rank side of issue 42's items 6-9 (settings checked early, the Hugging Face patch, negative
views, errors that name what is wrong), run by `every_item` of tests/distributed/round_two_cases.py
in the same spawned gloo group as items 1-5, with its conventions (rank 1 errs, summaries come
back)."""

from __future__ import annotations

import copy
import json
import os
import tempfile
import warnings

import torch

from tests.distributed.round_two_cases import ERRING, _good_call, _Inject, outcome
from tests.distributed.test_rank_disagreement import SPEC, _build, _good


# ================================================================ item 6: settings checked early
def _bad_table(path, spec, env, **changes) -> None:
    from fusion_bridge.tuning import tables

    measured = {"separate": {"default": {1: 5.0, 2: 6.0}}}
    table = tables.make_table(spec, env, measured, spread={"fraction": 0.01, "cases": 2})
    for key, value in changes.items():
        if key == "spread":
            table["spread"] = value
        else:
            table["measured_us"]["separate"]["default"]["1"] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table).replace('"HUGE"', "9" * 400))


def item6_settings(rank, world_size, group) -> dict:
    """measured_us with string (and numpy) bucket keys on one rank only; a planning failure on one
    rank; tuning tables from disk with values that must be refused at read (a 400-digit spread, a
    0.999 spread, a 1e-3 us time), loaded collectively as a bridge on a GPU would."""
    import numpy as np

    import fusion_bridge.assembly.build as build_module
    from fusion_bridge.environment import Environment
    from fusion_bridge.tuning import tables

    out = {}
    ints = {"separate": {"default": {1: 5.0, 8: 6.0}}}
    mine = (
        {"separate": {"default": {"1": np.float32(5.0), np.int64(8): 6.0}}}
        if rank == ERRING
        else ints
    )
    try:
        with _build(group, strategy="auto", measured_us=mine) as bridge:
            out["string_keys"] = {
                "plan": bridge.plan.to_dict() if hasattr(bridge.plan, "to_dict") else None,
                "call": _good_call(bridge, world_size, rank, 5, seed=600),
            }
    except BaseException as exc:  # noqa: BLE001
        out["string_keys"] = {"kind": type(exc).__name__, "msg": str(exc)}
    if rank == ERRING:
        _Inject(build_module, "select_for_modes", RuntimeError("planner (injected)"))
    try:
        _build(group).close()
        out["planning"] = {"kind": "built"}
    except BaseException as exc:  # noqa: BLE001
        out["planning"] = {"kind": type(exc).__name__, "msg": str(exc)}
    env = Environment(world_size=world_size, gpu_name="NVIDIA H200", device_type="cuda", sm=90)
    for name, changes in (
        ("spread_400_digits", {"spread": {"fraction": "HUGE", "cases": 2}}),
        ("spread_0.999", {"spread": {"fraction": 0.999, "cases": 2}}),
        ("time_1e-3_us", {"time": 1e-3}),
    ):
        with tempfile.TemporaryDirectory() as cache:
            os.environ["FUSION_BRIDGE_CACHE_DIR"] = cache
            try:
                if rank == 0:
                    _bad_table(tables.cache_path(SPEC, env), SPEC, env, **changes)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    table = tables.load_table(SPEC, env, group)
                    margin = tables.margin_of(table)
                out[name] = {
                    "kind": "ok",
                    "table": table is not None,
                    "margin": None if margin is None else margin.fraction,
                    "warnings": [str(w.message) for w in caught],
                }
            except BaseException as exc:  # noqa: BLE001
                out[name] = {"kind": type(exc).__name__, "msg": str(exc)[:300]}
            finally:
                os.environ.pop("FUSION_BRIDGE_CACHE_DIR")
            torch.distributed.barrier(group=group)
    return out


# ================================================================ item 7: the Hugging Face patch
def item7_hf_patch(rank, world_size, group) -> dict:
    """Ranks whose models differ by two experts swapped, by two rows of one expert swapped; models
    with a NaN weight at one place, its payload bits differing per rank; the patch under debug
    mode."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skipped": "transformers is not installed"}
    from fusion_bridge.integrations.transformers import patch_moe_epilogues
    from migration.examples.hf_moe import TINY, build_model

    out = {}
    built = build_model("deepseek_v3", TINY, seed=0)  # the same on every rank; copied per case
    for case in ("experts_swapped", "rows_swapped", "same_nan", "debug"):
        model = copy.deepcopy(built)
        experts = model.model.layers[1].mlp.experts
        with torch.no_grad():
            if case == "experts_swapped" and rank == ERRING:
                experts.gate_up_proj[[0, 1]] = experts.gate_up_proj[[1, 0]].clone()
            if case == "rows_swapped" and rank == ERRING:
                experts.down_proj[2, [0, 1]] = experts.down_proj[2, [1, 0]].clone()
            if case == "same_nan":  # a NaN on every rank, with another payload on each
                experts.down_proj[3, 0, 0] = float("nan")
                bits = experts.down_proj.view(torch.int16)
                bits[3, 0, 0] = (0x7FC0, -0x3F)[rank % 2]  # -0x3F: 0xFFC1, a negative NaN
                assert torch.isnan(experts.down_proj[3, 0, 0])
        options = {"debug": True} if case == "debug" else {}
        try:
            patch = patch_moe_epilogues(
                model, group, self_test=False, tuning="off", build_timeout_s=30.0, **options
            )
        except BaseException as exc:  # noqa: BLE001
            out[case] = {"kind": type(exc).__name__, "msg": str(exc)}
            continue
        result = {"kind": "patched"}
        if case == "debug":
            prompt = torch.randint(
                1, TINY["vocab"], (1, 6), generator=torch.Generator().manual_seed(7)
            )
            try:
                with torch.no_grad():
                    result["logits"] = model(prompt).logits.float().sum().item()
                result["forward"] = "ok"
            except BaseException as exc:  # noqa: BLE001
                result["forward"] = f"{type(exc).__name__}: {exc}"
        patch.unpatch()
        out[case] = result
    return out


# ================================================================ item 8: negative views
def item8_negative_views(rank, world_size, group) -> list:
    """A negative view (torch._neg_view) of each float input on one rank, on `local_fused_nccl`
    (our Triton kernels, under the interpreter) and on `separate`."""
    out, seed = [], 800
    for strategy in ("local_fused_nccl", "separate"):
        with _build(group, strategy=strategy) as bridge:
            for name in ("gemm2_out", "residual", "gamma", "shared_output", "expert_weights"):
                seed += 1
                inputs, exact = _good(world_size, rank, 4, seed)
                if rank == ERRING:
                    inputs = inputs._replace(**{name: torch._neg_view(getattr(inputs, name))})
                failing = outcome(bridge, inputs, exact)
                seed += 1
                after = _good_call(bridge, world_size, rank, 3, seed)
                out.append({"case": (strategy, name), "failing": failing, "after": after})
    return out


# ================================================================ item 9: misleading errors
def item9_settings_named(rank, world_size, group) -> dict:
    """Settings each rank checks alone before any collective (so every rank raises at once, here
    with the same bad value on every rank): each error must name the variable or the argument."""
    import numpy as np

    out = {}
    env_cases = {
        "FUSION_BRIDGE_SHADOW=reference:0": ("FUSION_BRIDGE_SHADOW", "reference:0"),
        "FUSION_BRIDGE_SHADOW=nosuch": ("FUSION_BRIDGE_SHADOW", "nosuch"),
        "FUSION_BRIDGE_SHADOW=reference:1_0": ("FUSION_BRIDGE_SHADOW", "reference:1_0"),
        "timeout 1_000": ("FUSION_BRIDGE_BUILD_TIMEOUT_S", "1_000"),
        "timeout arabic-indic digits": ("FUSION_BRIDGE_BUILD_TIMEOUT_S", "\u0665"),
        "timeout vertical tab": ("FUSION_BRIDGE_BUILD_TIMEOUT_S", "\x0b5"),
        "lowercase name": ("fusion_bridge_debug", "1"),
        "dashes": ("FUSION-BRIDGE-DEBUG", "1"),
    }
    for case, (name, value) in env_cases.items():
        os.environ[name] = value
        try:
            _build(group).close()
            out[case] = {"kind": "built"}
        except BaseException as exc:  # noqa: BLE001
            out[case] = {"kind": type(exc).__name__, "msg": str(exc)}
        finally:
            os.environ.pop(name)
    arg_cases = {
        "build_timeout_s=10**400": dict(build_timeout_s=10**400),
        "build_timeout_s=np.int64(30)": dict(build_timeout_s=np.int64(30)),
        "shadow='reference:often'": dict(shadow="reference:often"),
    }
    for case, kwargs in arg_cases.items():
        try:
            _build(group, **kwargs).close()
            out[case] = {"kind": "built"}
        except BaseException as exc:  # noqa: BLE001
            out[case] = {"kind": type(exc).__name__, "msg": str(exc)}
    with tempfile.TemporaryDirectory() as home:
        os.environ["FUSION_BRIDGE_CACHE_DIR"], old_home = "~/fb-cache", os.environ.get("HOME")
        os.environ["HOME"] = home
        try:
            from fusion_bridge.tuning import tables

            out["cache_dir"] = str(tables.cache_dir()).startswith(home)
        finally:
            os.environ.pop("FUSION_BRIDGE_CACHE_DIR")
            os.environ["HOME"] = old_home or ""
    return out
