"""The failure path of one call of a FusionBridge: what keeps the group in step when anything
leaves `finalize_epilogue`, wherever the call stood.

A mixin of FusionBridge (bridge.py), split from it to keep each module short: these methods read
and write the bridge's call state (`_running`, `calls`, `_broken`, the call slot of
call/one_caller.py) and call the protocol's functions (call/failure.py, debug mode's agreement in
call/debug_call.py). `_running` says where the call in progress stands, set by plain stores in the
call path (no call between a step and its record, so no Python signal handler runs in between):
the constants below, None (started, no strategy yet), or a (strategy, variant, shadow next?) tuple
(that strategy's run started; its `call_stage` says whether its collective had begun).

Two public verbs live here too, for callers whose own code around the call fails (the Hugging Face
patch, an engine adapter): `fail_call(tokens, error)` takes part in a call this rank cannot make
(its expert GEMMs, router or attention failed before the call) with a NaN payload of T, through the
same path as a call that failed inside; `mark_out_of_step(reason)` says the caller skipped or added
a call it cannot make up, so every bridge of the process group refuses every later call.
"""

from __future__ import annotations

from typing import NoReturn, Optional

import torch

from fusion_bridge.call import failure, one_caller
from fusion_bridge.call.routes import token_count
from fusion_bridge.call.validation import EpilogueInputError, zero_tensor_error
from fusion_bridge.epilogue_tensors import EpilogueInputs
from fusion_bridge.ranks import call_agreement as rank_agreement
from fusion_bridge.strategies.base import CallStage, Strategy

# FusionBridge._running, where the call in progress stands (None: started, no strategy yet; a
# (strategy, variant, shadow next?) tuple: that run started)
_REFUSED = "refused"  # the call refused itself, or every rank learnt its failure: nothing to join
_DONE = "done"  # the last call returned
_IDLE = "idle"  # the last call's failure path finished


class CallSkipped(RuntimeError):
    """What `fail_call(tokens)` without an error records as this rank's failure: the caller skipped
    the call (a NaN payload took its place)."""


class FailurePath:
    """FusionBridge's failure path (see the module docstring)."""

    def fail_call(self, tokens: int, error: Optional[BaseException] = None) -> None:
        """This rank cannot make its next call (with `tokens` tokens, T): what produces its inputs
        failed (the expert GEMMs, the router, an out-of-memory, a Ctrl-C), or the caller is
        making up a call it skipped. Take part in the collectives the peers run in that call with
        a NaN payload of T (their outputs are NaN, loud; the next call is in step on every rank),
        exactly as a call that fails inside finalize_epilogue does, then raise `error` (with a
        note saying this rank took part); with `error` None, return instead.

        Needs nothing but T (no input tensor: the payload is the one reserved at build). Counts as
        a call (debug mode's agreement sees it as this rank's failure: every rank raises the same
        GroupInputError). T == 0, or one rank: nothing to take part in. Where this rank cannot
        take part (T has no route, the bridge is broken, the bridge was closed and its route needs
        its workspaces, taking part failed), every bridge on the process group refuses every
        later call and this raises EpilogueInputError saying what recovers (a KeyboardInterrupt
        stays one, with that message as a note)."""
        tokens = token_count(tokens, "fail_call")
        failed = (
            error
            if error is not None
            else CallSkipped(f"fail_call: this rank skipped call {self.calls + 1} (T={tokens})")
        )
        try:
            one_caller.enter(self)  # one call at a time per process group, as finalize_epilogue
            previous, self._running, self.calls = self._running, None, self.calls + 1
            if previous is not _DONE and previous is not _IDLE:
                self._break_unfinished(previous)
            self._call_failed(failed, self._token_inputs(tokens))
        except CallSkipped as skipped:
            if skipped is not failed:
                raise
        finally:
            one_caller.leave(self)

    def mark_out_of_step(self, reason: str) -> None:
        """The caller's calls on this rank are out of step with its peers' (it skipped or added a
        call it cannot make up, `reason` says which): this bridge and every other bridge of the
        process on its process group refuse every later call, naming `reason` and what recovers.
        No collective."""
        self._break(RuntimeError(str(reason)), "outside finalize_epilogue")

    @property
    def group_saw_last_failure(self) -> bool:
        """Whether every rank of the group raised for this rank's last call (debug mode: its
        agreement named the failure), so no peer goes on past it; False without debug mode, where
        a failed call's peers return NaN outputs and go on."""
        agreement = self._agreement
        return agreement is not None and agreement.where(self.calls) in ("reasons", "raises")

    @property
    def unusable(self) -> Optional[str]:
        """Why every call of this bridge is refused (its group out of step here), or None."""
        return self._broken

    def _token_inputs(self, tokens: int) -> EpilogueInputs:
        """Inputs that say T and nothing else: meta tensors of the call's shapes (no memory), all
        the failure path reads of a call whose inputs were never made."""
        spec, meta = self.spec, torch.device("meta")
        rows = torch.empty(tokens, spec.hidden_size, dtype=spec.dtype, device=meta)
        slots = torch.empty(tokens, spec.top_k, dtype=torch.int32, device=meta)
        return EpilogueInputs(
            rows[:1],
            slots,
            slots.float(),
            rows if spec.has_shared_output else None,
            rows,
            torch.empty(spec.hidden_size, dtype=spec.dtype, device=meta),
        )

    def _call_failed(self, error: BaseException, inputs: EpilogueInputs) -> NoReturn:
        """Whatever left finalize_epilogue: where the call stood (`_running`) decides what keeps
        the group in step. Refused (another thread holds the group, the bridge is broken, or debug
        mode's agreement already told every rank): raise. Before any strategy of the call started
        (its route's collective, or debug mode's agreement, still ahead): take part. A strategy
        started: where it stood (`_failed_in`). Ends by marking the call finished; a failure path
        that never gets there (a second interrupt inside it) leaves the mark unfinished, and the
        next call breaks the group instead of pairing wrongly (`_break_unfinished`)."""
        if not one_caller.holds(self):
            if isinstance(error, one_caller.ConcurrentCallError):
                raise error  # refused: another thread's call holds the group
            one_caller.enter(self)  # the interrupt came before the call took the group
        if isinstance(error, Exception) and not isinstance(error, EpilogueInputError):
            named = zero_tensor_error(inputs)  # a kernel's "invalid python storage", named
            if named is not None:
                named.__cause__, error = error, named
        running = self._running
        if running is _DONE or running is _IDLE:  # it came before the call counted itself
            self._running, running = None, None
            self.calls += 1
        try:
            if running is _REFUSED:
                raise error
            if self._broken is not None and running is None:
                # broken before this call got to its strategy (an interrupt before the call's own
                # refusal): never take part again, the peers are not in step with this rank
                self._raise_broken(error)
            if running is not None:
                strategy, variant, shadow_next = running
                self._failed_in(strategy, variant, inputs, error, shadow_next)
            agreed = None if self._agreement is None else self._agreement.where(self.calls)
            if agreed is None and self._agreement is not None:  # its peers wait in the agreement
                self._agreement.agree(inputs, self.calls, self._route, self._closed, failed=error)
            if agreed == "reasons":  # the peers gather the failing ranks' reasons
                rank_agreement.join_reasons(self._agreement.my_reason(), self.group)
            if agreed in ("reasons", "raises"):
                raise error
            if agreed == "in" and self.env.world_size > 1:
                self._break(error, "inside debug mode's agreement collective")
                failure.add_note(error, self._broken)
                raise error
            self._take_part_then_raise(inputs, error, self._planned_route)
        finally:
            self._running = _IDLE

    def _raise_broken(self, error: BaseException) -> NoReturn:
        """Refuse this call as every call of a broken bridge is refused (a KeyboardInterrupt stays
        one, with the message as a note)."""
        if isinstance(error, Exception):
            raise EpilogueInputError(self._broken) from error
        failure.add_note(error, self._broken)
        raise error

    def _break_unfinished(self, previous) -> None:
        """The previous call's failure path never finished (`previous`: where that call stood):
        this rank cannot tell whether it took part in its peers' collective, so the group is out of
        step on this rank (every later call refused, with what recovers)."""
        where = "before its collective" if previous is None else f"at {previous!r}"
        self._break(
            RuntimeError(
                f"call {self.calls - 1} was interrupted {where} and again in its failure path"
            ),
            "and this rank could not tell whether it took part in that call's collective",
        )

    def _failed_in(
        self, strategy: Strategy, variant, inputs: EpilogueInputs, error, shadow_next: bool
    ) -> NoReturn:
        """`strategy`'s run raised `error`; where it stood decides what keeps the group in step:
        before its collective, take part in it (and in the shadow's, when `shadow_next` and this
        call is sampled); inside it, the group is broken; after it, only the shadow's remains."""
        stage = failure.stage_of(strategy)
        if self.env.world_size > 1 and stage is CallStage.IN_COLLECTIVE:
            self._break(error, f"inside the collective of {strategy.name}")
            failure.add_note(error, self._broken)
        before = stage is CallStage.BEFORE_COLLECTIVE
        if self.env.world_size > 1 and (before or (shadow_next and self._shadow is not None)):
            route = (strategy, variant) if before else None
            self._take_part_then_raise(inputs, error, route, shadow=shadow_next)
        raise error

    def _take_part_then_raise(self, inputs, error, route, shadow: bool = True) -> NoReturn:
        """This rank's call failed before a collective of `route` (a (strategy, variant), a function
        of T planning it, or None when only the shadow's is left): take part with a NaN payload so
        the group stays in step, then raise `error`; where it cannot, refuse every later call on
        this process group and raise EpilogueInputError saying what recovers."""
        sampler = self._shadow if shadow else None
        where = failure.take_part(
            inputs, error, spec=self.spec, device=self.device, world_size=self.env.world_size,
            call=self.calls, route=route, shadow=sampler, closed=self._closed,
            shadow_strategy=self._instances[sampler.strategy] if sampler else None,
        )  # fmt: skip
        if where is not None:
            self._break(error, where)
            if isinstance(error, Exception):  # a KeyboardInterrupt stays one, with the message
                raise EpilogueInputError(self._broken) from error
            failure.add_note(error, self._broken)
        raise error
