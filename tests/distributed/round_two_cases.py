"""The rank side of tests/distributed/test_failure_protocol_round_two.py (issue 42): one function
per item of the issue (items 6-9 in round_two_settings_cases.py), each run inside the same spawned
gloo group (`every_item`), each returning plain summaries for the parent to assert on. A case that
the issue found to hang or pair calls wrongly is followed by good calls with their own inputs and T,
judged against the float64 oracle, so a desynchronised group cannot pass.

Faults are injected on one rank by replacing a module-level function of the library for one call
(`_Inject`), by a real SIGALRM handler, or by the inputs themselves; torch.distributed is never
replaced. Cases where a peer must wait out its collective's timeout run last, on subgroups whose
collectives time out after SHORT_TIMEOUT.
"""

from __future__ import annotations

import asyncio
import signal
import time
from datetime import timedelta

import torch

from tests.distributed.test_rank_disagreement import (
    SPEC,
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
    from tests.distributed.round_two_settings_cases import (
        item6_settings,
        item7_hf_patch,
        item8_negative_views,
        item9_settings_named,
    )

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


__all__ = ["ERRING", "TIES", "every_item", "outcome"]
