"""The rank side of tests/distributed/test_failure_protocol_round_two.py (issue 42): one function
per item of the issue, each run inside the same spawned gloo group (`every_item`), each returning
plain summaries for the parent to assert on. A case that the issue found to hang or pair calls
wrongly is followed by good calls with their own inputs and T, judged against the float64 oracle,
so a desynchronised group cannot pass.

Faults are injected on one rank by replacing a module-level function of the library for one call
(`_Inject`), by a real SIGALRM handler, or by the inputs themselves; torch.distributed is never
replaced. Cases where a peer must wait out its collective's timeout run last, on subgroups whose
collectives time out after SHORT_TIMEOUT.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import tempfile
import time
import warnings
from datetime import timedelta

import torch

from tests.distributed.test_rank_disagreement import (
    SPEC,
    SPEC_NO_SHARED,
    _build,
    _good,
    _group,
    _snapshot,
    _unchanged,
)

SHORT_TIMEOUT = timedelta(seconds=3)  # the subgroups on which a peer waits out a collective
ERRING = 1  # the rank that fails in every case


class CustomStop(BaseException):
    """A BaseException that is not an Exception, of the caller's own."""


class _Inject:
    """Replace module.name so that its `nth` call (counting from 1) raises `error` (an instance),
    or runs `action` first; the original comes back after that call."""

    def __init__(self, module, name: str, error=None, nth: int = 1, action=None) -> None:
        self.module, self.name, self.real = module, name, getattr(module, name)
        self.error, self.nth, self.action, self.seen = error, nth, action, 0
        setattr(module, name, self)

    def __call__(self, *args, **kwargs):
        self.seen += 1
        if self.seen == self.nth:
            setattr(self.module, self.name, self.real)
            if self.action is not None:
                self.action()
            if self.error is not None:
                raise self.error
        return self.real(*args, **kwargs)


class _Armed:
    """Replace module.name by a function that raises `error` on every call until disarm()."""

    def __init__(self, module, name: str, error) -> None:
        self.module, self.name, self.real, self.error = module, name, getattr(module, name), error
        setattr(module, name, self)

    def __call__(self, *args, **kwargs):
        raise self.error

    def disarm(self) -> None:
        setattr(self.module, self.name, self.real)


def outcome(bridge, inputs, exact=None) -> dict:
    """One call, summarised (any BaseException caught): what it returned or raised, NaN-ness or
    error against the oracle, time, notes, inputs unchanged."""
    from fusion_bridge.call.validation import EpilogueInputError
    from tests import oracle64

    before = _snapshot(inputs)
    start = time.monotonic()
    try:
        out = bridge(*inputs)
        r = {
            "kind": "ok",
            "res_all_nan": bool(torch.isnan(out.residual_out).all()),
            "norm_all_nan": bool(torch.isnan(out.norm_out).all()),
        }
        if exact is not None:
            r["res_err"] = oracle64.normwise_rel_err(out.residual_out, exact[0])
            r["norm_err"] = oracle64.normwise_rel_err(out.norm_out, exact[1])
    except BaseException as exc:  # noqa: BLE001 - returned to the parent, which asserts on it
        r = {
            "kind": type(exc).__name__,
            "msg": str(exc),
            "notes": list(getattr(exc, "__notes__", [])),
            "input_error": isinstance(exc, EpilogueInputError),
            "failed": getattr(exc, "failed", None),
        }
    r["seconds"] = time.monotonic() - start
    r["unchanged"] = _unchanged(before, inputs)
    return r


def _good_call(bridge, world_size, rank, tokens, seed, spec=SPEC) -> dict:
    inputs, exact = _good(world_size, rank, tokens, seed, spec)
    return outcome(bridge, inputs, exact)


# ================================================================ item 1: every exception class
def _raise_alarm() -> None:
    signal.raise_signal(signal.SIGALRM)


def _on_alarm(signum, frame):
    raise KeyboardInterrupt("SIGALRM")


def item1_exception_classes(rank, world_size, group) -> list:
    """One rank raises each BaseException class at each point before its collective, on `separate`
    and on `local_fused_nccl` (our Triton kernels under the interpreter); every failing call is
    followed by a good one."""
    import fusion_bridge.bridge as bridge_module
    from fusion_bridge.strategies import local_fused_nccl, separate

    signal.signal(signal.SIGALRM, _on_alarm)
    classes = {
        "KeyboardInterrupt": lambda: KeyboardInterrupt(),
        "CancelledError": lambda: asyncio.CancelledError(),
        "SystemExit": lambda: SystemExit(3),
        "CustomStop": lambda: CustomStop("stop"),
    }
    out, seed = [], 100
    for strategy, module, where in (
        (separate.SeparateStrategy.name, separate, "finalize_fp32"),
        (local_fused_nccl.LocalFusedNcclStrategy.name, local_fused_nccl, "finalize_partial"),
    ):
        with _build(group, strategy=strategy) as bridge:
            cases = [(cls, "index_check") for cls in classes] + [
                (cls, "strategy") for cls in classes
            ]
            cases.append(("KeyboardInterrupt", "sigalrm"))
            if strategy != "separate":  # the Triton path: a subset, it runs under the interpreter
                cases = [("KeyboardInterrupt", "index_check"), ("CustomStop", "strategy")]
            for cls, point in cases:
                if rank == ERRING:
                    if point == "index_check":
                        _Inject(bridge_module, "validate_index_values", classes[cls]())
                    elif point == "strategy":
                        _Inject(module, where, classes[cls]())
                    else:
                        _Inject(module, where, action=_raise_alarm)
                seed += 1
                failing = _good_call(bridge, world_size, rank, 5 - seed % 2, seed)
                seed += 1
                after = _good_call(bridge, world_size, rank, 4 - seed % 2, seed)
                out.append({"case": (strategy, cls, point), "failing": failing, "after": after})
    return out


# ================================================================ item 2: shadow mode
def item2_shadow(rank, world_size, group) -> list:
    """A failure after the route's collective (the shadow's is still to come), and a failure in the
    shadow before its own collective, with a shadow of another size (`reference`, fp32) and of the
    same size (`separate`)."""
    from fusion_bridge.strategies import reference, separate

    out, seed = [], 200
    for shadow in ("reference:1", "separate:1"):
        with _build(group, shadow=shadow) as bridge:
            shadow_module = reference if shadow.startswith("reference") else separate
            for point in ("after_route_collective", "shadow_before_its_collective", None):
                if rank == ERRING and point == "after_route_collective":
                    _Inject(separate, "residual_norm_outputs", RuntimeError("after (injected)"))
                elif rank == ERRING and point == "shadow_before_its_collective":
                    # separate shadowing separate: its second finalize of the call is the shadow's
                    nth = 2 if shadow_module is separate else 1
                    _Inject(shadow_module, "finalize_fp32", RuntimeError("shadow (injected)"), nth)
                seed += 1
                failing = _good_call(bridge, world_size, rank, 5 - seed % 2, seed)
                seed += 1
                after = _good_call(bridge, world_size, rank, 3 + seed % 2, seed)
                out.append({"case": (shadow, point), "failing": failing, "after": after})
            out.append(
                {"case": (shadow, "counters"), "shadow": bridge.explain().to_dict()["shadow"]}
            )
    return out


# ================================================================ item 3: T ties
def _tied(inputs, how):
    """The erring rank's inputs whose [T, ...] tensors give no T a majority (or a wrong one)."""
    perm, w, r = inputs.expanded_idx_to_permuted_idx, inputs.expert_weights, inputs.residual
    s = inputs.shared_output
    grow = lambda t: torch.cat([t, t[:1]]).contiguous()  # noqa: E731 - T+1 rows
    if how == "zero_rows_residual_and_index":  # 2-2 tie at T=0
        return inputs._replace(residual=r[:0], expanded_idx_to_permuted_idx=perm[:0])
    if how == "extra_row_residual_and_index":  # 2-2 tie at T+1
        return inputs._replace(residual=grow(r), expanded_idx_to_permuted_idx=grow(perm))
    if how == "extra_row_residual_and_weights":
        return inputs._replace(residual=grow(r), expert_weights=grow(w))
    if how == "no_shared_then_residual_and_index":  # shared missing: 2 of the 4 expected
        return inputs._replace(
            shared_output=None, residual=grow(r), expanded_idx_to_permuted_idx=grow(perm)
        )
    if how == "four_different":
        return inputs._replace(
            residual=grow(r),
            expanded_idx_to_permuted_idx=grow(grow(perm)),
            shared_output=s[:-1].contiguous(),
        )
    raise AssertionError(how)


TIES = (
    "zero_rows_residual_and_index",
    "extra_row_residual_and_index",
    "extra_row_residual_and_weights",
    "no_shared_then_residual_and_index",
    "four_different",
)


def item3_ties(rank, world_size, group) -> list:
    """Each tie on the erring rank, on fresh bridges A and B; the peer does not call A (it would
    wait out the group's timeout: that case runs last, in `waits`). The erring rank must raise
    naming every input's T, take part in nothing, and refuse its later calls on A and on B."""
    out = []
    for i, how in enumerate(TIES):
        with _build(group) as a, _build(group) as b:
            if rank == ERRING:
                inputs, _ = _good(world_size, rank, 5, seed=300 + i)
                first = outcome(a, _tied(inputs, how))
                out.append(
                    {
                        "case": how,
                        "first": first,
                        "later_a": _good_call(a, world_size, rank, 4, seed=310 + i),
                        "later_b": _good_call(b, world_size, rank, 4, seed=320 + i),
                    }
                )
    return out


# ================================================================ item 4: a closed bridge
def item4_closed(rank, world_size, group) -> list:
    """Bridges A and B called A, B, A, B (each call its own inputs); the erring rank closes A after
    its first call. Without and with debug mode."""
    out = []
    for debug in (False, True):
        a, b = _build(group, debug=debug), _build(group, debug=debug)
        calls = []
        for step, bridge in enumerate((a, b, a, b)):
            calls.append(_good_call(bridge, world_size, rank, 3 + step % 3, seed=400 + step))
            if step == 0 and rank == ERRING:
                a.close()
        a.close()
        b.close()
        out.append({"debug": debug, "calls": calls})
    return out


# ================================================================ item 5: taking part needs little
def item5_taking_part(rank, world_size, group) -> dict:
    """An allocation failure inside `separate` that lasts (taking part must not need the same
    gather); an allocation failure while fingerprinting under debug mode; a skipped call under
    debug mode, named with the rank that is behind."""
    from fusion_bridge.strategies import separate

    out = {}
    with _build(group) as bridge:
        armed = None
        if rank == ERRING:
            armed = _Armed(
                separate, "finalize_fp32", torch.OutOfMemoryError("out of memory (armed)")
            )
        out["oom"] = _good_call(bridge, world_size, rank, 6, seed=500)
        if armed is not None:
            armed.disarm()
        out["oom_after"] = _good_call(bridge, world_size, rank, 5, seed=501)
    with _build(group, debug=True) as bridge:
        if rank == ERRING:
            try:
                from fusion_bridge.call import debug_call as where
            except ImportError:  # the code as issue 42 found it
                from fusion_bridge.call import failure as where
            _Inject(where, "replicated_fingerprint", torch.OutOfMemoryError("fingerprint OOM"))
        out["debug_oom"] = _good_call(bridge, world_size, rank, 4, seed=510)
        out["debug_after"] = [
            _good_call(bridge, world_size, rank, 3 + i, seed=511 + i) for i in range(2)
        ]
    with _build(group, debug=True) as bridge:
        steps = (0, 2, 3, 4) if rank == ERRING else (0, 1, 2, 3)
        out["skipped"] = [_good_call(bridge, world_size, rank, 4, seed=520 + s) for s in steps]
    return out


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

    import fusion_bridge.build.build as build_module
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
TINY = {"hidden": 64, "inter": 128, "moe_inter": 32, "experts": 8, "top_k": 2, "layers": 3}


def item7_hf_patch(rank, world_size, group) -> dict:
    """Ranks whose models differ by two experts swapped, by two rows of one expert swapped; models
    with the same NaN weight; the patch under debug mode."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skipped": "transformers is not installed"}
    from fusion_bridge.integrations.transformers import patch_moe_epilogues
    from migration.examples.hf_moe import build_model

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
            if case == "same_nan":
                experts.down_proj[3, 0, 0] = float("nan")
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
            prompt = torch.randint(1, 512, (1, 6), generator=torch.Generator().manual_seed(7))
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


# ================================================================ the cases that wait
def waits(rank, world_size, group) -> dict:
    """Where the peer waits out its collective's timeout (SHORT_TIMEOUT): a KeyboardInterrupt as
    the erring rank enters its all-reduce, and a tie whose peer calls on. Every rank must then
    refuse its later calls at once, never return a value."""
    from fusion_bridge.strategies.base import CallStage

    out = {}
    # both made now, while the ranks are together: a group connects within its timeout
    first, second = (
        torch.distributed.new_group(list(range(world_size)), timeout=SHORT_TIMEOUT, backend="gloo")
        for _ in range(2)
    )
    with _build(first) as bridge:
        if rank == ERRING:
            inst = bridge._instances["separate"]

            class _Entering:
                """The collective's mark, once: the interrupt lands as the rank enters it."""

                def __enter__(self):
                    del inst.collective  # the class's own mark from the next call on
                    inst.call_stage = CallStage.IN_COLLECTIVE
                    raise KeyboardInterrupt("entering the all-reduce")

                def __exit__(self, *exc):
                    return False

            inst.collective = _Entering
        out["entering"] = _good_call(bridge, world_size, rank, 4, seed=900)
        out["entering_later"] = _good_call(bridge, world_size, rank, 4, seed=901)
    torch.distributed.barrier(group=group)  # the peer waited out its collective: together again
    with _build(second) as bridge:
        inputs, exact = _good(world_size, rank, 5, seed=910)
        if rank == ERRING:
            inputs = _tied(inputs, "extra_row_residual_and_index")
        out["tie"] = outcome(bridge, inputs, exact)
        out["tie_later"] = _good_call(bridge, world_size, rank, 4, seed=911)
    return out


def every_item(rank, world_size) -> dict:
    """Every item's cases, in one spawned group (spawns are the expensive part of these tests)."""
    group = _group(world_size)
    out = {
        "item1": item1_exception_classes(rank, world_size, group),
        "item2": item2_shadow(rank, world_size, group),
        "item3": item3_ties(rank, world_size, group),
        "item4": item4_closed(rank, world_size, group),
        "item5": item5_taking_part(rank, world_size, group),
        "item6": item6_settings(rank, world_size, group),
        "item7": item7_hf_patch(rank, world_size, group),
        "item8": item8_negative_views(rank, world_size, group),
        "item9": item9_settings_named(rank, world_size, group),
    }
    torch.distributed.barrier(group=group)
    out["waits"] = waits(rank, world_size, group)
    return out


__all__ = ["every_item", "SPEC", "SPEC_NO_SHARED", "TIES"]
